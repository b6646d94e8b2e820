"""The DiT's hyper-parameters, its kernel table, and the per-request context ``AuKDiT.prepare`` computes.

``DiTConfig`` is read once from the release config's ``model.arch``. ``DiTKernels`` names the hand-written
kernels the DiT runs in place of its torch form (None: the torch form); the pipeline's wiring fills it from the
resolved fast paths, and tests build the table they need. ``DiTContext`` holds what is fixed for a request batch
across ODE steps, the kernels it runs with included, so that a CUDA graph captured for one context is keyed by them.

Shapes:
    bc   rows of a context (b, or 2b with CFG)      m   positions of a sequence
    na   audio positions [ref | target]             nt  text tokens      ns  single-stream positions, nt + na
    n    target frames   d  model width   h  heads   dh  head width
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from auk_worker.errors import CheckpointError

logger = logging.getLogger(__name__)

_REQUIRED_ARCH_KEYS = ("dim", "heads", "ff_mult", "text_hidden_dim", "num_layers", "num_single_layers")
_OPTIONAL_ARCH_KEYS = ("dim_head", "attn_mask_enabled")
# Accepted by the upstream constructor but meaningless at inference (training switches, attention kernel choice).
_TRAINING_ONLY_ARCH_KEYS = frozenset(
    {"depth", "dropout", "checkpoint_activations", "checkpoint_every_n_layers", "attn_backend"}
)


@dataclass(frozen=True, kw_only=True)
class DiTConfig:
    """Architecture hyper-parameters, read once from the release config's ``model.arch``."""

    dim: int
    heads: int
    dim_head: int = 64  # its own field upstream (not dim // heads)
    ff_mult: float
    text_hidden_dim: int
    latent_dim: int
    num_layers: int
    num_single_layers: int
    attn_mask_enabled: bool = True

    @property
    def ff_inner_dim(self) -> int:
        return int(self.dim * self.ff_mult)

    @classmethod
    def from_arch(cls, arch: Mapping[str, Any], latent_dim: int) -> DiTConfig:
        """Build from ``model.arch``; ``latent_dim`` comes from ``model.vae`` (upstream passes it separately)."""
        unknown = sorted(set(arch) - set(_REQUIRED_ARCH_KEYS) - set(_OPTIONAL_ARCH_KEYS) - _TRAINING_ONLY_ARCH_KEYS)
        if unknown:
            raise CheckpointError(f"model.arch has unknown key(s) {unknown}")
        missing = [key for key in _REQUIRED_ARCH_KEYS if key not in arch]
        if missing:
            raise CheckpointError(f"model.arch is missing required key(s) {missing}")
        ints = {key: arch[key] for key in ("dim", "heads", "text_hidden_dim", "num_layers", "num_single_layers")}
        ints["dim_head"] = arch.get("dim_head", 64)
        ints["latent_dim"] = latent_dim
        for key, value in ints.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if "layers" in key else 1):
                raise CheckpointError(f"model.arch.{key} must be a positive integer, got {value!r}")
        ff_mult = arch["ff_mult"]
        if isinstance(ff_mult, bool) or not isinstance(ff_mult, (int, float)) or not ff_mult > 0:
            raise CheckpointError(f"model.arch.ff_mult must be a positive number, got {ff_mult!r}")
        attn_mask_enabled = arch.get("attn_mask_enabled", True)
        if not isinstance(attn_mask_enabled, bool):
            raise CheckpointError(f"model.arch.attn_mask_enabled must be a boolean, got {attn_mask_enabled!r}")
        ignored = sorted(set(arch) & _TRAINING_ONLY_ARCH_KEYS)
        if ignored:
            logger.debug("dit config: ignoring training-only arch keys %s", ignored)
        return cls(ff_mult=float(ff_mult), attn_mask_enabled=attn_mask_enabled, **ints)


# ---------------------------------------------------------------------------------------------------------------
# The kernel table

# (q, k, v [rows * m, h, dh], starts [rows + 1], count [rows], m) -> [rows * m, h, dh]; the hand-written kernel
# also takes ``split=`` and ``first=`` (see ``attend``).
VarlenAttention = Callable[..., Tensor]
# ([(qkv, q weight, k weight, cos, sin), ...], heads, eps, slot) -> q, k, v [bc, seq, h, dh]
AttentionInputs = Callable[..., tuple[Tensor, Tensor, Tensor]]
ModulatedNorm = Callable[..., Tensor]  # (x, shift, scale, eps) -> LN(x) * (1 + scale) + shift
GatedResidualNorm = Callable[..., tuple[Tensor, Tensor]]  # (x, y, gate, keep, shift, scale, eps) -> (x', norm(x'))
PositionConv = Callable[..., Tensor]  # (x, packed weight, bias, keep, residual) -> mish(conv(x)) + residual


@dataclass(frozen=True)
class DiTKernels:
    """The kernels the DiT runs in place of its torch form; None everywhere is the plain torch path.

    ``varlen_attention`` makes masked batches attend over each row's visible keys (``VisibleKeys``) instead of
    through a boolean mask; ``attention_kernel``, where that is on, serves those calls instead (the hand-written
    kernel, which also writes a joint attention's two parts and the last block's queries itself)."""

    varlen_attention: VarlenAttention | None = None
    attention_kernel: VarlenAttention | None = None
    attention_inputs: AttentionInputs | None = None  # q, k, v from the qkv projection in one call
    modulated_norm: ModulatedNorm | None = None  # a block's adaptive norm
    gated_residual_norm: GatedResidualNorm | None = None  # the gated residual with the norm after it
    position_conv: PositionConv | None = None  # each of the audio embedding's position convolutions


# ---------------------------------------------------------------------------------------------------------------
# Per-request context


@dataclass(frozen=True)
class Rope:
    """Rotary tables for one sequence: integer positions and fp32 cos/sin, pairs interleaved."""

    positions: Tensor  # [bc, m] long
    cos: Tensor  # [bc, m, 1, dh] fp32
    sin: Tensor  # [bc, m, 1, dh] fp32


@dataclass(frozen=True)
class VisibleKeys:
    """A key mask in the form a variable-length attention kernel reads instead of the mask: each row's keys
    reordered visible first, and how many are visible. The kernel attends over the first ``count`` keys of each
    row, so hidden keys cost nothing, and the counts live on the device, so one captured shape serves them all."""

    order: Tensor  # [bc, m] long: key positions, the visible ones first, each group in sequence order
    slot: Tensor  # [bc, m] int32: each key's place in that order (order's inverse)
    count: Tensor  # [bc] int32
    starts: Tensor  # [bc + 1] int32: where each row begins in the rows' packed sequence, row * m
    varlen_attention: VarlenAttention  # the kernel that attends over them
    attention_kernel: VarlenAttention | None = None  # the hand-written kernel in its place (DiTKernels)


@dataclass(frozen=True)
class JointLayout:
    """What the double-stream blocks need besides the streams themselves."""

    rope_audio: Rope  # over [ref | target]
    rope_text: Rope
    key_mask: Tensor | None  # [bc, 1, 1, na + nt] True = attend, keys in [audio, text] order; None = all
    visible_keys: VisibleKeys | None  # the same mask for the variable-length kernel; None = use key_mask
    audio_keep: Tensor | None  # [bc, na, 1] False rows are zeroed after attention; None = keep all
    text_keep: Tensor | None  # [bc, nt, 1]
    attention_inputs: AttentionInputs | None = None  # the DiT's kernels (DiTKernels); None: the torch form
    modulated_norm: ModulatedNorm | None = None
    gated_residual_norm: GatedResidualNorm | None = None


@dataclass(frozen=True)
class SingleLayout:
    """What the single-stream blocks need: the sequence is [text | ref | target]."""

    rope: Rope
    key_mask: Tensor | None  # [bc, 1, 1, ns]
    visible_keys: VisibleKeys | None
    keep: Tensor | None  # [bc, ns, 1]
    target_keep: Tensor | None  # [bc, n, 1]: keep's last n rows, the target's (the last block's outputs)
    attention_inputs: AttentionInputs | None = None
    modulated_norm: ModulatedNorm | None = None
    gated_residual_norm: GatedResidualNorm | None = None


@dataclass(frozen=True)
class DiTContext:
    """Everything about a request batch that does not change across ODE steps (see :meth:`AuKDiT.prepare`)."""

    cfg: bool  # rows are [cond_0..cond_{b-1}, uncond_0..uncond_{b-1}]
    text: Tensor  # [bc, nt, d] projected text; zero on uncond rows
    ref: Tensor | None  # [bc, np, d] embedded reference; uncond rows embed zero latents; None when np == 0
    target_mask: Tensor | None  # [b, n] valid target frames for the conv embedding; None = all valid
    target_len: int  # n
    joint: JointLayout
    single: SingleLayout
    position_conv: PositionConv | None = None  # the target's position convolutions' kernel; None: the torch form

    @property
    def rows(self) -> int:
        return self.text.shape[0]

    @property
    def batch(self) -> int:
        return self.rows // 2 if self.cfg else self.rows
