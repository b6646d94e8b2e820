"""The VAE decoder's anti-aliased periodic activation: 2x band-limited upsample -> SnakeBeta -> 2x decimate.

BigVGAN's "Activation1d" as AuK builds it: the snake non-linearity creates harmonics above Nyquist, so it runs
at twice the rate between two Kaiser-windowed sinc low-pass filters (12 taps, cutoff 0.25, half-width 0.3 of the
doubled rate). The upsampler is always centred; the decimating low-pass is causal when the config's
``act_causal`` is set (left padding only). Both pad by replicating the edge sample.

Module and buffer names follow the release checkpoint: ``act.alpha``, ``act.beta``, ``upsample.filter``,
``downsample.lowpass.filter``.

Two equal formulations (same taps, same edges; sums rounded in a different order, ~1e-7 relative apart):

- the convolution path (default, the reference): pad, depthwise ``conv_transpose1d``, crop, snake, pad, strided
  depthwise ``conv1d``. Each step writes and re-reads a 2x-rate tensor.
- the polyphase path (``use_fused_activations``): the 2x upsample is two phases of 6 taps, output samples 2i and
  2i + 1 each a weighted sum of shifted input samples; snake runs on the phases; the decimator is a weighted sum of
  12 strided slices of the (replicate-padded) interleaved phases. Only slicing, replicate padding, scalar-tap
  products and elementwise ops: ``torch.compile`` fuses it into three pointwise kernels, which still write and
  re-read the 2x-rate signal. Eager it is ~40 small ops: on a CPU faster than the convolutions for long narrow
  signals, slower for short wide ones.

On CUDA the pipeline's wiring runs the polyphase form as one hand-written kernel per activation (``kernels/``:
``cuda_activation``, CUDA C++ built with NVRTC, or ``triton_activation`` where that one cannot run), or where
neither runs as one ``torch.compile`` of it (:func:`compile_fused_activations`).

Shapes: ``b`` batch, ``c`` channels, ``t`` samples at the activation's input rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

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


# The polyphase form of the 2x upsample. Cropped output RATIO*i + p is the transposed conv's full output
# m = RATIO*i + p + UP_CROP, which tap k reads from padded input q = (m - k) / RATIO, i.e. from input i + offset
# with offset = (p + UP_CROP - k) / RATIO - UP_PAD.
UP_PAD = TAPS // RATIO - 1  # the convolution path's replicate padding, 5 input samples each side
UP_CROP = UP_PAD * RATIO + (TAPS - RATIO) // 2  # 15: what leaves exactly 2t of the transposed conv's output
PHASE_TAPS = tuple(
    tuple((k, (p + UP_CROP - k) // RATIO - UP_PAD) for k in range(TAPS) if (p + UP_CROP - k) % RATIO == 0)
    for p in range(RATIO)
)  # per phase, (tap, input offset) pairs; offsets -3 ... 3
PHASE_PAD = (-min(o for phase in PHASE_TAPS for _, o in phase), max(o for phase in PHASE_TAPS for _, o in phase))


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, logscale: bool) -> torch.Tensor:
    """x + 1/(beta + eps) * sin^2(alpha * x) with per-channel [c] alpha, beta (logs of them when ``logscale``)."""
    alpha, beta = alpha[None, :, None], beta[None, :, None]  # [1, c, 1]
    if logscale:
        alpha, beta = torch.exp(alpha), torch.exp(beta)
    return x + (1.0 / (beta + SNAKE_EPS)) * torch.sin(x * alpha).pow(2)


def upsample_phases(x: torch.Tensor, taps: torch.Tensor) -> list[torch.Tensor]:  # [b, c, t] -> RATIO x [b, c, t]
    """``UpSample.forward`` as its RATIO phases: phase p holds output samples RATIO*i + p."""
    t = x.shape[-1]
    taps = taps.view(TAPS)
    left = PHASE_PAD[0]
    x = F.pad(x, PHASE_PAD, mode="replicate")  # [b, c, t + 6]
    return [
        RATIO * _weighted_sum((taps[k], x[..., left + offset : left + offset + t]) for k, offset in phase)
        for phase in PHASE_TAPS
    ]


def decimate_phases(phases: list[torch.Tensor], taps: torch.Tensor, pad: tuple[int, int]) -> torch.Tensor:
    """``LowPass.forward`` of the signal whose sample RATIO*i + p is ``phases[p][..., i]``, as strided slices."""
    t = phases[0].shape[-1]
    taps = taps.view(TAPS)
    x = torch.stack(phases, dim=-1).flatten(-2)  # [b, c, t, RATIO] -> [b, c, RATIO*t], interleaved
    x = F.pad(x, pad, mode="replicate")  # [b, c, RATIO*t + 11]
    # Output i reads padded samples RATIO*i + k: slice k, step RATIO, holds them for every i.
    return _weighted_sum((taps[k], x[..., k : k + RATIO * t : RATIO]) for k in range(TAPS))


def polyphase_activation(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    up_taps: torch.Tensor,
    down_taps: torch.Tensor,
    logscale: bool,
    down_pad: tuple[int, int],
    left_pad: int = 0,
) -> torch.Tensor:  # [b, c, t] -> [b, c, left_pad + t]
    """``AliasFreeActivation.forward`` without convolutions: interpolate as phases, snake each phase, decimate;
    then ``left_pad`` zeros in front.

    A function of plain tensors, so that one ``torch.compile`` of it with dynamic shapes serves every channel
    width (dynamo keeps a module parameter's shape static, which would recompile it per width)."""
    phases = [snake_beta(phase, alpha, beta, logscale) for phase in upsample_phases(x, up_taps)]
    return _left_padded(decimate_phases(phases, down_taps, down_pad), left_pad)


class SnakeBeta(nn.Module):
    """y = x + 1/(beta + eps) * sin^2(alpha * x), per channel; alpha and beta are stored as logs when ``logscale``."""

    def __init__(self, channels: int, logscale: bool) -> None:
        super().__init__()
        self.logscale = logscale
        init = 0.0 if logscale else 1.0
        self.alpha = nn.Parameter(torch.full((channels,), init))
        self.beta = nn.Parameter(torch.full((channels,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, c, t] -> [b, c, t]
        return snake_beta(x, self.alpha, self.beta, self.logscale)


class UpSample(nn.Module):
    """Band-limited 2x interpolation: replicate-pad, depthwise transposed conv with the low-pass, crop (centred)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("filter", lowpass_taps())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, c, t] -> [b, c, 2t]
        channels = x.shape[1]
        x = F.pad(x, (UP_PAD, UP_PAD), mode="replicate")
        x = RATIO * F.conv_transpose1d(x, self.filter.expand(channels, -1, -1), stride=RATIO, groups=channels)
        return x[..., UP_CROP : x.shape[-1] - UP_CROP]


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


# ``polyphase_activation``'s signature, ``left_pad`` passed by keyword.
PolyphaseFn = Callable[..., torch.Tensor]


class AliasFreeActivation(nn.Module):
    """SnakeBeta evaluated at twice the sample rate between two low-pass filters.

    ``fused`` picks the polyphase formulation (see the module docstring), run by ``polyphase_fn``; off by default.
    """

    def __init__(self, channels: int, logscale: bool, causal: bool) -> None:
        super().__init__()
        self.act = SnakeBeta(channels, logscale)
        self.upsample = UpSample()
        self.downsample = DownSample(causal)
        self.fused = False
        self.polyphase_fn: PolyphaseFn = polyphase_activation

    def forward(self, x: torch.Tensor, left_pad: int = 0) -> torch.Tensor:  # [b, c, t] -> [b, c, left_pad + t]
        """The activation, with ``left_pad`` zeros in front of it: the causal convolution that reads it needs them,
        and the fused kernel writes them with the output instead of a copy into a padded tensor."""
        if self.fused:
            return self.polyphase(x, left_pad)
        return _left_padded(self.downsample(self.act(self.upsample(x))), left_pad)

    def polyphase(self, x: torch.Tensor, left_pad: int = 0) -> torch.Tensor:  # [b, c, t] -> [b, c, left_pad + t]
        lowpass = self.downsample.lowpass
        return self.polyphase_fn(
            x, self.act.alpha.detach(), self.act.beta.detach(), self.upsample.filter, lowpass.filter,
            self.act.logscale, lowpass.pad, left_pad=left_pad,
        )  # detached: plain tensors, whose shapes dynamo may treat as dynamic


def use_fused_activations(model: nn.Module, enabled: bool = True, fn: PolyphaseFn = polyphase_activation) -> int:
    """Switch every ``AliasFreeActivation`` in ``model`` to the polyphase path run by ``fn`` (or back); returns
    how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, AliasFreeActivation):
            module.fused = enabled
            module.polyphase_fn = fn
            count += 1
    return count


def compile_fused_activations(model: nn.Module, **options: object) -> int:
    """Switch every ``AliasFreeActivation`` in ``model`` to the polyphase path, run by one ``torch.compile`` of
    ``polyphase_activation`` (dynamic shapes, full graph; ``options`` go to ``torch.compile``); returns how many.

    One compilation serves every activation, whatever its width or length (a second one for batch 1 against
    larger batches, which dynamo specialises). Compiling a whole decoder instead traces its 109 activations one
    after another, a long start-up, and only adds the fusion of the residual adds."""
    compiled = torch.compile(polyphase_activation, dynamic=True, fullgraph=True, **options)

    def run(*args: Any, left_pad: int = 0) -> torch.Tensor:
        # The padding stays outside the compiled graph: its width would otherwise be one more guard.
        return _left_padded(compiled(*args), left_pad)

    return use_fused_activations(model, True, run)


def _left_padded(x: torch.Tensor, left_pad: int) -> torch.Tensor:
    return F.pad(x, (left_pad, 0)) if left_pad else x


def _weighted_sum(terms: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """sum(tap * x) over (0-d tap, x) pairs, accumulated left to right."""
    total = None
    for tap, x in terms:
        total = tap * x if total is None else total + tap * x
    return total


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
