"""The codec's hyper-parameters (the release's ``model.vae``) and the geometry they imply: how far a decoded frame
reads, and how a long clip is decoded in overlapping windows.

Shapes: ``n`` latent frames (50 Hz, 480 samples each).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from auk_worker.errors import CheckpointError, ConfigError
from auk_worker.model.vae.alias_free import activation_span

logger = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
ENCODER_WIDTH = 12  # the encoder's first conv is built 12 wide whatever downsample_channels[0] says
# Latent frames of (left, right) context the published tiling reserves per decoded frame. A safe bound: the
# exact figure for the release geometry is (52, 7), see decoder_context.
RELEASE_CONTEXT = (53, 9)


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


