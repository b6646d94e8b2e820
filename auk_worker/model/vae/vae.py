"""AuK's audio codec ("BigVGAN-flow" VAE): 24 kHz mono waveform <-> 50 Hz, 64-channel normalised latents.

Inference only. The encoder is a strided convolution stack with symmetric ("same") padding, emitting a
posterior mean and log-std per latent frame; the decoder is a BigVGAN generator that is causal everywhere
except ``conv_pre`` (centred) and the alias-free upsamplers (centred), and ends in a clamp, not a tanh. The
release also stores a residual coupling flow (``flow.*``); it only serves the training loss and is skipped.

Parameter and buffer names equal the release ``vae.safetensors`` keys, except that every convolution holds
one plain ``weight`` where the file holds the weight-norm pair ``weight_g`` / ``weight_v``: ``load_vae``
folds the pair on the target device (see there) and ``AuKVAE.release_state_dict`` writes it back out.

Shapes: ``b`` batch, ``t`` waveform samples (24 kHz), ``n`` latent frames (50 Hz, 480 samples each),
``d`` latent channels (64), ``c`` conv channels.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from auk_worker.errors import AudioError, CheckpointError, ConfigError, InputError
from auk_worker.model.alias_free import AliasFreeActivation, activation_span
from auk_worker.model.conv_kernel import causal_conv
from auk_worker.model.streams import beside, join
from auk_worker.model.upsample_kernel import causal_upsample

logger = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
ENCODER_WIDTH = 12  # the encoder's first conv is built 12 wide whatever downsample_channels[0] says
# Latent frames of (left, right) context the published tiling reserves per decoded frame. A safe bound: the
# exact figure for the release geometry is (52, 7), see decoder_context.
RELEASE_CONTEXT = (53, 9)
TRAINING_ONLY_PREFIX = "flow."


# ----------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class VAEConfig:
    """The release's ``model.vae`` section; defaults are the released values."""

    latent_dim: int = 64
    downsample_rate: int = 480
    target_sample_rate: int = SAMPLE_RATE
    upsample_rates: tuple[int, ...] = (5, 4, 3, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (10, 8, 6, 4, 4, 4)
    upsample_initial_channel: int = 1536
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    downsample_rates: tuple[int, ...] = (2, 2, 2, 3, 4, 5)
    downsample_channels: tuple[int, ...] = (12, 24, 48, 96, 192, 384, 768)
    snake_logscale: bool = True
    use_vae: bool = True
    causal: bool = True
    flow_hidden_channels: int = 256  # training-only flow; kept for the round trip
    act_causal: bool = True

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def from_release(cls, vae_section: dict[str, Any]) -> VAEConfig:
        """Read the release config's ``model.vae`` mapping; missing model_init_kwargs take the released values."""
        kwargs = dict(vae_section.get("model_init_kwargs") or {})
        latent_dim = vae_section.get("latent_dim", cls.latent_dim)
        inner = kwargs.pop("latent_dim", latent_dim)
        # The YAML writes model_init_kwargs.latent_dim as "${model.vae.latent_dim}"; unresolved, it is that string.
        if isinstance(inner, str) and inner.strip().startswith("${"):
            inner = latent_dim
        if inner != latent_dim:
            raise CheckpointError(f"vae config: model_init_kwargs.latent_dim {inner!r} != latent_dim {latent_dim!r}")
        known = {name for name in cls.__dataclass_fields__}
        ignored = sorted(set(kwargs) - known)
        if ignored:
            logger.info("vae config: ignoring model_init_kwargs %s", ignored)
        values = {key: _freeze(value) for key, value in kwargs.items() if key in known}
        for key in ("downsample_rate", "target_sample_rate"):
            if key in vae_section:
                values[key] = vae_section[key]
        try:
            return cls(latent_dim=latent_dim, **values)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"vae config: {exc}") from exc

    def to_release(self) -> dict[str, Any]:
        """The ``model.vae`` mapping ``from_release`` reads (lists, not tuples, as YAML writes them)."""
        kwargs = {key: _thaw(value) for key, value in asdict(self).items()}
        section = {key: kwargs.pop(key) for key in ("downsample_rate", "target_sample_rate")}
        return {
            "latent_dim": self.latent_dim,
            **section,
            "vae_name": "BigVGANFlowVAE",
            "model_init_kwargs": kwargs,
        }

    def _check(self) -> None:
        def fail(field: str, why: str) -> None:
            raise CheckpointError(f"vae config: {field} {getattr(self, field)!r}: {why}")

        if self.target_sample_rate != SAMPLE_RATE:
            fail("target_sample_rate", f"the model runs at {SAMPLE_RATE} Hz")
        if math.prod(self.downsample_rates) != self.downsample_rate:
            fail("downsample_rates", f"product must equal downsample_rate {self.downsample_rate}")
        if math.prod(self.upsample_rates) != self.downsample_rate:
            fail("upsample_rates", f"product must equal downsample_rate {self.downsample_rate}")
        if len(self.downsample_channels) != len(self.downsample_rates) + 1:
            fail("downsample_channels", "needs one entry more than downsample_rates")
        if self.downsample_channels[0] != ENCODER_WIDTH:
            fail("downsample_channels", f"the first entry must be {ENCODER_WIDTH} (the encoder's fixed first conv)")
        if len(self.upsample_kernel_sizes) != len(self.upsample_rates):
            fail("upsample_kernel_sizes", "needs one entry per upsample rate")
        if self.causal and any(k != 2 * u for k, u in zip(self.upsample_kernel_sizes, self.upsample_rates)):
            fail("upsample_kernel_sizes", "a causal upsampler needs kernel == 2 * rate")
        if self.upsample_initial_channel % 2 ** len(self.upsample_rates):
            fail("upsample_initial_channel", f"must halve {len(self.upsample_rates)} times")
        if len(self.resblock_dilation_sizes) != len(self.resblock_kernel_sizes):
            fail("resblock_dilation_sizes", "needs one dilation list per resblock kernel")
        if not self.use_vae:
            fail("use_vae", "the encoder head must emit a mean and a log-std")


def _freeze(value: Any) -> Any:
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


def _thaw(value: Any) -> Any:
    return [_thaw(v) for v in value] if isinstance(value, (list, tuple)) else value


# ----------------------------------------------------------------------------------------------- layers


class PaddedConv1d(nn.Conv1d):
    """Stride-1 conv that keeps the length: centred zero padding, or ``causal`` zero padding on the left only."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, *, causal: bool, bias: bool = True):
        reach = dilation * (kernel - 1)
        super().__init__(cin, cout, kernel, dilation=dilation, padding=0 if causal else reach // 2, bias=bias)
        self.left_pad = reach if causal else 0
        # The weight as ``conv_kernel.causal_conv`` reads it, where ``use_fast_convs`` hands this conv to that kernel.
        self.fast_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, cin, t] -> [b, cout, t]
        return super().forward(F.pad(x, (self.left_pad, 0)) if self.left_pad else x)

    def forward_padded(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:  # [b, cin, left_pad + t] -> [b, cout, t]
        """``forward`` of an input that already starts with its ``left_pad`` zeros (an activation wrote them),
        plus ``residual`` when given."""
        if self.fast_weight is not None:
            return causal_conv(x, self.fast_weight, self.bias, self.dilation[0], residual)
        y = super().forward(x)
        return y if residual is None else residual + y


class UpsampleConv(nn.ConvTranspose1d):
    """Transposed conv multiplying the length by ``stride``; causal drops the trailing ``stride`` samples."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, *, causal: bool):
        super().__init__(cin, cout, kernel, stride=stride, padding=0 if causal else (kernel - stride) // 2)
        self.trim = stride if causal else 0
        # Computed as one product and an overlap-add kernel (``upsample_kernel``) where ``use_fast_upsamplers`` says.
        self.fast = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, cin, n] -> [b, cout, n * stride]
        if self.fast:
            return causal_upsample(x, self.weight, self.bias, self.stride[0])
        x = super().forward(x)
        return x[..., : x.shape[-1] - self.trim]


class _Cut:
    """Zeroes every sample of a [b, c, t] signal at or past its row's length, in place, touching only the last
    ``w`` samples: the ones where a row's padding can be (every row's length is at least t - w)."""

    def __init__(self, lengths: torch.Tensor, t: int, tail: int | None, dtype: torch.dtype) -> None:
        w = t if tail is None else min(t, tail)
        at = torch.arange(t - w, t, device=lengths.device)
        self.kept = (at < lengths[:, None]).to(dtype)[:, None, :]  # [b, 1, w]: 1 inside the row, 0 past it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x[..., x.shape[-1] - self.kept.shape[-1] :].mul_(self.kept)
        return x


class EncoderConv(nn.Module):
    """Symmetric-padded conv held under ``layer`` (the checkpoint's key path)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1):
        super().__init__()
        self.layer = nn.Conv1d(cin, cout, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:  # [b] -> [b]
        conv = self.layer
        reach = conv.kernel_size[0] - 1 - 2 * conv.padding[0]
        return torch.where(lengths > reach, (lengths - reach - 1) // conv.stride[0] + 1, 0)

    def output_padding(self, padding: int) -> int:
        """The most output frames past a row's ``output_lengths`` when at most ``padding`` samples are past its
        length: floor(a) - floor(b) <= floor(a - b) + 1 for the two lengths' quotients."""
        return padding // self.layer.stride[0] + 1


class ResStack(nn.Module):
    """Six residual pairs (LeakyReLU 0.01 -> conv k3 dilation 2^i -> LeakyReLU 0.01 -> conv k3), all centred."""

    def __init__(self, channels: int, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LeakyReLU(0.01),
                nn.Conv1d(channels, channels, 3, dilation=2**i, padding=2**i),
                nn.LeakyReLU(0.01),
                nn.Conv1d(channels, channels, 3, padding=1),
            )
            for i in range(depth)
        )

    def forward(self, x: torch.Tensor, cut: _Cut | None = None) -> torch.Tensor:
        """With ``cut``, every conv output is cut to the rows' lengths (see ``Encoder.forward``), and ``x`` is
        updated in place."""
        for layer in self.layers:
            if cut is None:
                x = x + layer(x)
                continue
            act_a, conv_a, act_b, conv_b = layer
            h = cut(conv_a(act_a(x)))
            # x is 0 past each row's length, so cutting x + y there is cutting y: one full-size kernel, the add.
            x = cut(x.add_(conv_b(act_b(h))))
        return x


class Encoder(nn.Module):
    """[b, 1, t] -> [b, 2d, n]: a flat Sequential (``generator.{idx}`` in the checkpoint)."""

    def __init__(self, config: VAEConfig):
        super().__init__()
        widths = config.downsample_channels
        layers: list[nn.Module] = [EncoderConv(1, ENCODER_WIDTH, 3), nn.LeakyReLU(0.2)]
        for cin, cout, rate in zip(widths[:-1], widths[1:], config.downsample_rates):
            layers += [EncoderConv(cin, cout, 2 * rate, stride=rate), ResStack(cout), nn.LeakyReLU(0.2)]
        layers.append(EncoderConv(widths[-1], 2 * config.latent_dim, 3))
        self.generator = nn.Sequential(*layers)

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor | None = None, padding: int | None = None
    ) -> torch.Tensor:
        """[b, 1, t] -> [b, 2d, n]. With ``lengths`` [b], only the first ``lengths`` samples of each row are the
        clip and the rest is padding: every conv output is cut back to the length the unpadded clip would give
        it, so the padding reaches each conv exactly as its own zero padding would, and the first n frames equal
        an encode of the clip alone. Shapes then depend on t only (a CUDA graph per padded length). ``padding``:
        no row has more than that many samples past its length, so each cut touches only the signal's end."""
        if lengths is None:
            return self.generator(wav)
        cut = _Cut(lengths, wav.shape[-1], padding, wav.dtype)
        x = cut(wav.clone())
        for layer in self.generator:
            if isinstance(layer, EncoderConv):
                lengths = layer.output_lengths(lengths)
                padding = None if padding is None else layer.output_padding(padding)
                x = layer(x)
                cut = _Cut(lengths, x.shape[-1], padding, x.dtype)  # one for all the convs of a rate
                x = cut(x)
            elif isinstance(layer, ResStack):
                x = layer(x, cut)
            else:  # LeakyReLU keeps zeros zero
                x = layer(x)
        return x


class AMPBlock(nn.Module):
    """x += conv2(act2(conv1(act1(x)))) for each dilation; activations alternate act1, act2, act1, ..."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...], config: VAEConfig):
        super().__init__()
        conv = lambda d: PaddedConv1d(channels, channels, kernel, d, causal=config.causal)  # noqa: E731
        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations = nn.ModuleList(
            AliasFreeActivation(channels, config.snake_logscale, config.act_causal) for _ in range(2 * len(dilations))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, c, t] -> [b, c, t]
        acts1, acts2 = self.activations[0::2], self.activations[1::2]
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, acts1, acts2):
            h = conv1.forward_padded(act1(x, conv1.left_pad))
            x = conv2.forward_padded(act2(h, conv2.left_pad), residual=x)
        return x


# ----------------------------------------------------------------------------------------------- model


class AuKVAE(nn.Module):
    """Encoder and decoder with plain (folded) conv weights; build with ``load_vae`` for released weights."""

    def __init__(self, config: VAEConfig):
        super().__init__()
        self.config = config
        self.hop = config.downsample_rate
        self.register_buffer("global_mean", torch.zeros(config.latent_dim))
        self.register_buffer("global_log_std", torch.ones(config.latent_dim))
        self.audio_encoder = Encoder(config)

        width = config.upsample_initial_channel
        self.conv_pre = PaddedConv1d(config.latent_dim, width, 7, causal=False)  # centred even in a causal model
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for rate, kernel in zip(config.upsample_rates, config.upsample_kernel_sizes):
            # One-element inner list: the checkpoint keys are ups.{i}.0.*
            self.ups.append(nn.ModuleList([UpsampleConv(width, width // 2, kernel, rate, causal=config.causal)]))
            width //= 2
            for size, dilations in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes):
                self.resblocks.append(AMPBlock(width, size, tuple(dilations), config))
        self.activation_post = AliasFreeActivation(width, config.snake_logscale, config.act_causal)
        self.conv_post = PaddedConv1d(width, 1, 7, causal=config.causal, bias=False)
        self.blocks_per_stage = len(config.resblock_kernel_sizes)
        # CUDA streams for a stage's AMP blocks after the first, which then run beside it (DecodeGraphs sets them;
        # None: one after the other on the current stream).
        self.branch_streams: list[torch.cuda.Stream] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_pre.weight.dtype

    # -- geometry

    def valid_frames(self, num_samples: int) -> int:
        """Latent frames covered by whole hops of a ``num_samples`` clip (the length upstream reports)."""
        return num_samples // self.hop

    def encoded_frames(self, num_samples: int) -> int:
        """Frames ``encode`` actually emits: one more than ``valid_frames`` for some remainders."""
        length = num_samples
        for rate in self.config.downsample_rates:
            length = (length - 2) // rate + 1 if length >= 2 else 0  # kernel 2r, stride r, padding r - 1
        return length

    def receptive_field(self) -> tuple[int, int]:
        """Latent frames of (left, right) context one decoded frame depends on: exactly (52, 7) at release
        geometry, inside the published tiling bound (53, 9)."""
        return decoder_context(self.config)

    # -- encode / decode

    def encode(
        self, wav: torch.Tensor, sample: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """[b, t] 24 kHz waveform -> [b, n, d] normalised latents (posterior mean, or a draw when ``sample``).

        ``n`` is ``encoded_frames(t)``: the symmetric padding can add a frame past ``valid_frames(t)``. A draw
        uses ``generator`` (the global RNG when None, as upstream does).
        """
        if wav.dim() != 2:
            raise InputError(f"vae encode expects a [b, t] waveform, got {tuple(wav.shape)}")
        if wav.shape[1] < self.hop:
            raise AudioError(f"vae encode needs at least {self.hop} samples, got {wav.shape[1]}")
        with torch.autocast(device_type=wav.device.type, enabled=False):
            stats = self.audio_encoder(wav[:, None, :].to(self.dtype)).float()  # [b, 1, t] -> [b, 2d, n]
        return self.latents(stats, sample, generator)

    def latents(
        self, stats: torch.Tensor, sample: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """The encoder's statistics [b, 2d, n] -> [b, n, d] normalised latents (the second half of ``encode``)."""
        with torch.autocast(device_type=stats.device.type, enabled=False):
            stats = stats.float()
            mean, log_std = stats.chunk(2, dim=1)  # [b, d, n] each
            z = mean
            if sample:
                device = mean.device if generator is None else generator.device
                noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=device)
                z = mean + noise.to(mean.device) * torch.exp(log_std)
            z = z.transpose(1, 2)  # [b, n, d]
            return (z - self.global_mean.float()) / torch.sqrt(self.global_log_std.float())

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[b, n, d] normalised latents -> [b, n * 480] waveform in [-1, 1]."""
        if latents.dim() != 3 or latents.shape[-1] != self.config.latent_dim:
            raise InputError(f"vae decode expects [b, n, {self.config.latent_dim}] latents, got {tuple(latents.shape)}")
        with torch.autocast(device_type=latents.device.type, enabled=False):
            z = latents.float() * torch.sqrt(self.global_log_std.float()) + self.global_mean.float()
            x = self.conv_pre(z.transpose(1, 2).to(self.dtype))  # [b, d, n] -> [b, c, n]
            for stage, (up,) in enumerate(self.ups):
                x = up(x)  # [b, c / 2, t * rate]
                first = stage * self.blocks_per_stage
                x = self._blocks_mean(x, self.resblocks[first : first + self.blocks_per_stage])
            x = self.conv_post.forward_padded(self.activation_post(x, self.conv_post.left_pad))  # [b, 1, n * 480]
            return torch.clamp(x, -1.0, 1.0).squeeze(1).float()

    def _blocks_mean(self, x: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
        """The mean of a stage's AMP blocks, each over ``x``. With ``branch_streams`` every block after the first
        runs on its own CUDA stream beside the first; the sum is taken in the same order either way."""
        streams = self.branch_streams or [None] * (len(blocks) - 1)
        outs = []
        for block, stream in zip(blocks[1:], streams):
            with beside(stream):
                outs.append(block(x))
        total = blocks[0](x)
        join(*streams)
        for out in outs:
            total = total + out
        return total / len(blocks)

    def decode_tiled(
        self, latents: torch.Tensor, tile_frames: int, left: int = RELEASE_CONTEXT[0], right: int = RELEASE_CONTEXT[1]
    ) -> torch.Tensor:
        """``decode`` in windows of ``tile_frames`` (see ``plan_tiles``); equals ``decode`` to fp rounding when
        (left, right) covers ``receptive_field()``. Peak memory is bounded by the window."""
        hop = self.hop
        wav = latents.new_empty((latents.shape[0], latents.shape[1] * hop), dtype=torch.float32)  # [b, n * 480]
        for start, width, emit_start, emit_end in plan_tiles(latents.shape[1], tile_frames, left, right):
            window = self.decode(latents[:, start : start + width])  # [b, width * 480]
            first, last = (emit_start - start) * hop, (emit_end - start) * hop
            wav[:, emit_start * hop : emit_end * hop] = window[:, first:last]
        return wav

    # -- checkpoint layout

    def release_state_dict(self) -> dict[str, torch.Tensor]:
        """This module's weights in the on-disk layout: each conv ``weight`` as v = weight, g = ||v||."""
        norm_keys = weight_norm_keys(self)
        out: dict[str, torch.Tensor] = {}
        for key, tensor in self.state_dict().items():
            tensor = tensor.detach().clone()
            if key in norm_keys:
                out[key + "_g"] = torch.norm_except_dim(tensor, 2, 0)
                out[key + "_v"] = tensor
            else:
                out[key] = tensor
        return out


def weight_norm_keys(model: nn.Module) -> set[str]:
    """Module keys of every conv weight: these are ``weight_g`` / ``weight_v`` pairs on disk."""
    convs = (nn.Conv1d, nn.ConvTranspose1d)
    return {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, convs)}


def is_filter_key(key: str) -> bool:
    """The alias-free activations' low-pass taps: deterministic buffers a checkpoint may or may not carry."""
    return key.endswith(".upsample.filter") or key.endswith(".downsample.lowpass.filter")


# ----------------------------------------------------------------------------------------------- tiling


def decoder_context(config: VAEConfig) -> tuple[int, int]:
    """Latent frames of (left, right) context a decoded frame reads, from the layer geometry alone.

    Walks one output frame's sample span backwards through every layer (a residual block reads the union of
    its input and its branch; a stage reads the union of its blocks), ignoring clip edges. Exact for the
    structure, so it holds for any weights. Release geometry: 52 left, 7 right (the published 53 / 9 sums
    per-layer reaches rounded outwards, a looser bound); the right side comes from ``conv_pre`` and the
    centred upsamplers of the activations.
    """
    causal, act_causal = config.causal, config.act_causal
    frame = 1_000  # any frame far from both edges
    lo, hi = frame * config.downsample_rate, (frame + 1) * config.downsample_rate - 1
    lo, hi = _conv_span(lo, hi, 7, 1, causal)  # conv_post
    lo, hi = activation_span(lo, hi, act_causal)  # activation_post
    stages = list(zip(config.upsample_rates, config.upsample_kernel_sizes))
    for rate, kernel in reversed(stages):
        spans = []
        for size, dilations in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes):
            block_lo, block_hi = lo, hi
            for dilation in reversed(dilations):
                branch = _conv_span(block_lo, block_hi, size, 1, causal)  # conv2
                branch = activation_span(*branch, act_causal)  # act2
                branch = _conv_span(*branch, size, dilation, causal)  # conv1
                branch = activation_span(*branch, act_causal)  # act1
                block_lo, block_hi = min(block_lo, branch[0]), max(block_hi, branch[1])
            spans.append((block_lo, block_hi))
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        # Transposed conv: full output m (= u + padding) is fed by inputs i with rate*i <= m <= rate*i + kernel - 1.
        padding = 0 if causal else (kernel - rate) // 2
        lo, hi = -((kernel - 1 - lo - padding) // rate), (hi + padding) // rate
    lo, hi = _conv_span(lo, hi, 7, 1, causal=False)  # conv_pre
    return frame - lo, hi - frame


def _conv_span(lo: int, hi: int, kernel: int, dilation: int, causal: bool) -> tuple[int, int]:
    """Input samples that outputs [lo, hi] of a length-keeping conv read."""
    reach = dilation * (kernel - 1)
    left = reach if causal else reach // 2
    return lo - left, hi + reach - left


def plan_tiles(
    frames: int, tile: int, left: int = RELEASE_CONTEXT[0], right: int = RELEASE_CONTEXT[1],
    sizes: tuple[int, ...] | None = None,
) -> list[tuple[int, int, int, int]]:
    """Decode windows ``(window_start, window_frames, emit_start, emit_end)`` covering ``frames`` latents.

    Windows are ``tile`` frames wide and overlap so that every emitted frame has ``left`` frames of context
    before it and ``right`` after it inside its window, unless that side is the clip's own edge. The last
    window is pinned to the clip's end and shrinks to the smallest of ``sizes`` (compiled window lengths, at
    most ``tile``) that still holds its frames plus the left context. A clip of at most ``tile`` frames is one
    window. Example: 1000 frames, tile 512 -> (0,512,0,503), (450,512,503,953), (488,512,953,1000).
    """
    if frames <= tile:
        return [(0, frames, 0, frames)]
    if tile <= left + right:
        raise ConfigError(f"vae tile_frames {tile} must exceed the decoder context {left} + {right}")
    plan = []
    start = emit = 0
    while start + tile < frames:
        stop = start + tile - right
        plan.append((start, tile, emit, stop))
        start, emit = stop - left, stop
    fits = [size for size in sizes or () if left + frames - emit <= size <= tile]
    width = min(fits, default=tile)
    plan.append((frames - width, width, emit, frames))
    return plan


# ----------------------------------------------------------------------------------------------- loading


def load_vae(
    state: dict[str, torch.Tensor], config: VAEConfig, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> AuKVAE:
    """Build the VAE from a release-layout state dict, strictly, with weight norm folded on ``device``.

    Every key the module needs must be present and no other, except ``flow.*`` (skipped) and the low-pass
    taps (checked when present, computed when absent). Each conv weight is folded as w = g * v / ||v||, the
    norm over every axis but 0 (the input-channel axis of a transposed conv), in fp32 ON ``device``: a CPU
    fold differs by an ULP and the encoder amplifies that to ~4e-4 at the latent head. ``dtype`` other than
    fp32 casts afterwards and departs from upstream, which always runs the VAE in fp32.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = AuKVAE(config)
    wanted = model.state_dict()  # meta tensors, except the low-pass taps (built on the CPU)
    norm_keys = weight_norm_keys(model)

    needed = []
    for key in wanted:
        if key in norm_keys:
            needed += [key + "_g", key + "_v"]
        elif not is_filter_key(key):
            needed.append(key)
    missing = [key for key in needed if key not in state]
    if missing:
        raise CheckpointError(f"vae weights: missing {len(missing)} tensors: {', '.join(missing[:8])}")
    # flow.* is the residual coupling flow: it maps the posterior towards the prior for the training loss
    # only; inference decodes posterior latents directly, so its tensors are not used.
    known = set(needed) | {key for key in wanted if is_filter_key(key)}
    unexpected = [key for key in state if key not in known and not key.startswith(TRAINING_ONLY_PREFIX)]
    if unexpected:
        raise CheckpointError(f"vae weights: unexpected tensors: {', '.join(sorted(unexpected)[:8])}")

    loaded: dict[str, torch.Tensor] = {}
    for key, like in wanted.items():
        if key in norm_keys:
            gain_shape = (like.shape[0],) + (1,) * (like.dim() - 1)
            gain = _take(state, key + "_g", gain_shape, device)
            direction = _take(state, key + "_v", tuple(like.shape), device)
            loaded[key] = torch._weight_norm(direction, gain, 0)  # the kernel torch's weight_norm runs
        elif is_filter_key(key):
            loaded[key] = _filter_taps(state, key, like, device)
        else:
            loaded[key] = _take(state, key, tuple(like.shape), device)
    model.load_state_dict(loaded, strict=True, assign=True)
    model = model.to(dtype).eval().requires_grad_(False)
    ignored = sum(key.startswith(TRAINING_ONLY_PREFIX) for key in state)
    logger.info("vae: loaded %d tensors on %s (skipped %d training-only flow tensors)", len(needed), device, ignored)
    return model


def _take(state: dict[str, torch.Tensor], key: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    tensor = state[key]
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"vae weights: {key} has shape {tuple(tensor.shape)}, the config needs {shape}")
    return tensor.to(device=device, dtype=torch.float32)


def _filter_taps(
    state: dict[str, torch.Tensor], key: str, computed: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """The stored taps when present (after checking they are the computed filter), else the computed ones."""
    if key not in state:
        return computed.to(device)
    stored = _take(state, key, tuple(computed.shape), torch.device("cpu"))
    if not torch.allclose(stored, computed, rtol=0.0, atol=1e-6):
        raise CheckpointError(f"vae weights: {key} is not the 12-tap Kaiser low-pass this model computes")
    return stored.to(device)
