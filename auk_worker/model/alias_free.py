"""The VAE decoder's anti-aliased periodic activation: 2x band-limited upsample -> SnakeBeta -> 2x decimate.

BigVGAN's "Activation1d" as AuK builds it: the snake non-linearity creates harmonics above Nyquist, so it runs
at twice the rate between two Kaiser-windowed sinc low-pass filters (12 taps, cutoff 0.25, half-width 0.3 of the
doubled rate). The upsampler is always centred; the decimating low-pass is causal when the config's
``act_causal`` is set (left padding only). Both pad by replicating the edge sample.

Module and buffer names follow the release checkpoint: ``act.alpha``, ``act.beta``, ``upsample.filter``,
``downsample.lowpass.filter``.

Shapes: ``b`` batch, ``c`` channels, ``t`` samples at the activation's input rate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

RATIO = 2  # oversampling factor
TAPS = 12  # low-pass length at the oversampled rate
SNAKE_EPS = 1e-9  # keeps 1 / exp(beta) finite


def kaiser_sinc_taps(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """Kaiser-windowed sinc low-pass normalised to unit DC gain, as a [1, 1, kernel_size] fp32 CPU tensor.

    ``cutoff`` and ``half_width`` are in cycles per sample. Built on the CPU in fp32 whatever the ambient
    device, so the taps are the same numbers the reference computes at construction.
    """
    half = kernel_size // 2
    # Kaiser's design formula: stop-band attenuation (dB) from the transition width, then the window's beta.
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21.0) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, periodic=False, beta=beta, dtype=torch.float32, device="cpu")
    if kernel_size % 2 == 0:
        time = torch.arange(-half, half, dtype=torch.float32, device="cpu") + 0.5
    else:
        time = torch.arange(kernel_size, dtype=torch.float32, device="cpu") - half
    taps = 2 * cutoff * window * torch.sinc(2 * cutoff * time)
    taps = taps / taps.sum()
    return taps.view(1, 1, kernel_size)


def lowpass_taps() -> torch.Tensor:
    """The one filter every alias-free activation uses, for both directions: [1, 1, 12]."""
    return kaiser_sinc_taps(cutoff=0.5 / RATIO, half_width=0.6 / RATIO, kernel_size=TAPS)


class SnakeBeta(nn.Module):
    """y = x + 1/(beta + eps) * sin^2(alpha * x), per channel; alpha and beta are stored as logs when ``logscale``."""

    def __init__(self, channels: int, logscale: bool) -> None:
        super().__init__()
        self.logscale = logscale
        init = 0.0 if logscale else 1.0
        self.alpha = nn.Parameter(torch.full((channels,), init))
        self.beta = nn.Parameter(torch.full((channels,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, c, t] -> [b, c, t]
        alpha = self.alpha[None, :, None]  # [1, c, 1]
        beta = self.beta[None, :, None]
        if self.logscale:
            alpha, beta = torch.exp(alpha), torch.exp(beta)
        return x + (1.0 / (beta + SNAKE_EPS)) * torch.sin(x * alpha).pow(2)


class UpSample(nn.Module):
    """Band-limited 2x interpolation: replicate-pad, depthwise transposed conv with the low-pass, crop (centred)."""

    def __init__(self) -> None:
        super().__init__()
        self.pad = TAPS // RATIO - 1  # 5 input samples each side
        # The transposed conv grows 2(t + 2*pad) by TAPS - RATIO; cropping this much each side leaves exactly 2t.
        self.crop = self.pad * RATIO + (TAPS - RATIO) // 2  # 15
        self.register_buffer("filter", lowpass_taps())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, c, t] -> [b, c, 2t]
        channels = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = RATIO * F.conv_transpose1d(x, self.filter.expand(channels, -1, -1), stride=RATIO, groups=channels)
        return x[..., self.crop : x.shape[-1] - self.crop]


class LowPass(nn.Module):
    """Depthwise low-pass with stride 2 over replicate padding; causal pads only on the left."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.pad = (TAPS - 1, 0) if causal else (TAPS // 2 - 1, TAPS // 2)
        self.register_buffer("filter", lowpass_taps())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, c, 2t] -> [b, c, t]
        channels = x.shape[1]
        x = F.pad(x, self.pad, mode="replicate")
        return F.conv1d(x, self.filter.expand(channels, -1, -1), stride=RATIO, groups=channels)


class DownSample(nn.Module):
    """Holds the decimating low-pass under ``lowpass`` (the checkpoint's key path)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.lowpass = LowPass(causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, c, 2t] -> [b, c, t]
        return self.lowpass(x)


class AliasFreeActivation(nn.Module):
    """SnakeBeta evaluated at twice the sample rate between two low-pass filters."""

    def __init__(self, channels: int, logscale: bool, causal: bool) -> None:
        super().__init__()
        self.act = SnakeBeta(channels, logscale)
        self.upsample = UpSample()
        self.downsample = DownSample(causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, c, t] -> [b, c, t]
        return self.downsample(self.act(self.upsample(x)))


def activation_span(lo: int, hi: int, causal: bool) -> tuple[int, int]:
    """Input samples [lo', hi'] that outputs [lo, hi] of an AliasFreeActivation read (edges ignored)."""
    down_left = TAPS - 1 if causal else TAPS // 2 - 1
    # Decimating low-pass: output u reads oversampled samples 2u - down_left ... 2u - down_left + TAPS - 1.
    up_lo, up_hi = RATIO * lo - down_left, RATIO * hi - down_left + TAPS - 1
    # Upsampler: cropped output m is full output m + crop, fed by padded inputs q with RATIO*q <= m + crop
    # <= RATIO*q + TAPS - 1; padded input q is input q - pad.
    pad = TAPS // RATIO - 1
    crop = pad * RATIO + (TAPS - RATIO) // 2
    first = -((-(up_lo + crop - TAPS + 1)) // RATIO) - pad
    last = (up_hi + crop) // RATIO - pad
    return first, last
