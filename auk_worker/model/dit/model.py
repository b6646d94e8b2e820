"""Stage 1 backbone: the AuK DiT ("Flux2Edit"), a Flux-style MMDiT that predicts flow velocities over VAE latents.

Follows the upstream backbone as auk-model.md section 3 describes it: ``num_layers`` double-stream blocks attend
jointly over the audio stream ``[ref | target]`` and the text stream (concatenated in the order [audio, text]),
then ``num_single_layers`` single-stream blocks run over ``[text | ref | target]``; only the last ``n`` positions
(the target) are projected back to latent space. Parameter and buffer names are the upstream ones without the
``transformer.`` prefix, so a release checkpoint loads with ``load_state_dict(strict=True, assign=True)``.

Prepare once, step many: :meth:`AuKDiT.prepare` computes what is fixed for a request (projected text, embedded
reference, rotary tables, masks; the CFG rows) into a :class:`DiTContext`; :meth:`AuKDiT.forward` evaluates one
velocity for the noisy target. No state is cached on the module.

Precision: works with fp32 weights (exact) or bf16 weights without autocast. The time sinusoid, rotary positions,
``inv_freq`` and the rotary products stay fp32; values are cast to the weight dtype where they enter a Linear.

Attention: where a context hides keys (batch or bucket padding, a masked reference frame), a GPU in half
precision runs a variable-length kernel over each row's visible keys (:class:`VisibleKeys`, built once in
``prepare``): the hand-written one (``varlen_attention_kernel``) where Triton runs, else FlashAttention's;
elsewhere SDPA takes the boolean mask, as upstream does. Both attend over the same keys.
There too, q, k and v go from the qkv projection to the attention's input in one kernel
(``attention_inputs_kernel``: q and k normed and rotated, the double blocks' two streams straight into the joint
sequence, k and v straight into the visible-first order). In half precision on a GPU the audio embedding's two
grouped position convolutions run as one ``position_conv_kernel`` call each (no im2col copy), with Mish, the
padded frames' zeroing and the embedding's residual in the same pass.

Shapes:
    b    requests (rows of the ODE state)
    bc   rows of a context: b, or 2b with CFG (cond rows 0..b-1, then uncond rows)
    n    target frames (padded)          np   reference frames (padded; 0 without a reference)
    na   audio positions, np + n         nt   text tokens (padded)
    ns   single-stream positions, nt + na
    d    model width   h  heads   dh  head width   l  latent channels   dt  text hidden width
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from auk_worker.errors import CheckpointError, InputError
from auk_worker.model import (
    attention_inputs_kernel,
    modulated_norm_kernel,
    position_conv_kernel,
    varlen_attention_kernel,
)
from auk_worker.model.streams import beside, join

logger = logging.getLogger(__name__)

ROTARY_BASE = 10000.0
TIME_FREQ_DIM = 256  # width of the time sinusoid
TIME_SCALE = 1000.0  # t in [0, 1] is scaled by this before the sinusoid
CONV_KERNEL = 31
CONV_GROUPS = 16
LAYER_NORM_EPS = 1e-6

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
    kernel: bool = False  # the hand-written kernel (varlen_attention_kernel) instead of FlashAttention's


@dataclass(frozen=True)
class JointLayout:
    """What the double-stream blocks need besides the streams themselves."""

    rope_audio: Rope  # over [ref | target]
    rope_text: Rope
    key_mask: Tensor | None  # [bc, 1, 1, na + nt] True = attend, keys in [audio, text] order; None = all
    visible_keys: VisibleKeys | None  # the same mask for the variable-length kernel; None = use key_mask
    audio_keep: Tensor | None  # [bc, na, 1] False rows are zeroed after attention; None = keep all
    text_keep: Tensor | None  # [bc, nt, 1]
    inputs_kernel: bool = False  # q, k, v through the attention-inputs kernel (attention_inputs)
    norm_kernel: bool = False  # adaptive norms and gated residuals through the modulated-norm kernel


@dataclass(frozen=True)
class SingleLayout:
    """What the single-stream blocks need: the sequence is [text | ref | target]."""

    rope: Rope
    key_mask: Tensor | None  # [bc, 1, 1, ns]
    visible_keys: VisibleKeys | None
    keep: Tensor | None  # [bc, ns, 1]
    target_keep: Tensor | None  # [bc, n, 1]: keep's last n rows, the target's (the last block's outputs)
    inputs_kernel: bool = False
    norm_kernel: bool = False


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
    conv_kernel: bool = False  # the target's position convolutions through the position-conv kernel

    @property
    def rows(self) -> int:
        return self.text.shape[0]

    @property
    def batch(self) -> int:
        return self.rows // 2 if self.cfg else self.rows


# ---------------------------------------------------------------------------------------------------------------
# Leaf modules


def _all_or_none(mask: Tensor) -> Tensor | None:
    """None when every entry is True: a full mask is numerically a no-op, and no mask keeps SDPA on fast kernels."""
    return None if bool(mask.all()) else mask


def _zero_rows(x: Tensor, keep: Tensor | None) -> Tensor:
    return x if keep is None else x.masked_fill(~keep, 0.0)


class TimestepEmbedding(nn.Module):
    """Sinusoid of ``TIME_SCALE * t`` (fp32, [sin | cos]) followed by Linear -> SiLU -> Linear."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:  # t [b] -> [b, d]
        half = TIME_FREQ_DIM // 2
        rate = math.log(10000) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -rate)  # [half]
        angles = TIME_SCALE * t.float()[:, None] * freqs[None, :]  # [b, half]
        wave = torch.cat((angles.sin(), angles.cos()), dim=-1)  # [b, 256] fp32
        return self.time_mlp(wave.to(self.time_mlp[0].weight.dtype))


def _version(t: Tensor) -> int:
    """How many times ``t`` was written in place (0 for an inference tensor, which keeps no count)."""
    return 0 if t.is_inference() else t._version


class ConvPositionEmbedding(nn.Module):
    """Two grouped convolutions with Mish; frames outside ``mask`` are zeroed before and after each conv."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        pad = CONV_KERNEL // 2
        self.conv1d = nn.Sequential(
            nn.Conv1d(dim, dim, CONV_KERNEL, groups=CONV_GROUPS, padding=pad),
            nn.Mish(),
            nn.Conv1d(dim, dim, CONV_KERNEL, groups=CONV_GROUPS, padding=pad),
            nn.Mish(),
        )
        self._packed: tuple[tuple[int, int], ...] | None = None  # what the packed weights were made from
        self._packed_weights: tuple[Tensor, ...] = ()

    def packed_weights(self) -> tuple[Tensor, ...]:
        """Both convolutions' weights as the position-conv kernel reads them, packed again only when a weight
        changed (loaded, moved, cast or written in place). ``AuKDiT.prepare`` calls it, outside any CUDA graph
        capture; a graph captured before a weight changes keeps reading the packing it was captured with."""
        convs = (self.conv1d[0], self.conv1d[2])
        made_from = tuple((conv.weight.data_ptr(), _version(conv.weight)) for conv in convs)
        if self._packed != made_from:
            self._packed_weights = tuple(position_conv_kernel.pack(conv) for conv in convs)
            self._packed = made_from
        return self._packed_weights

    def with_kernel(self, x: Tensor, mask: Tensor | None, residual: Tensor | None = None) -> Tensor:
        """``forward(x, mask) + residual`` by two position-conv kernels (x [b, m, d] -> [b, m, d])."""
        (conv_a, _, conv_b, _), (packed_a, packed_b) = self.conv1d, self.packed_weights()
        h = position_conv(x, packed_a, conv_a.bias, mask)
        return position_conv(h, packed_b, conv_b.bias, mask, residual)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:  # x [b, m, d], mask [b, m]
        keep = None if mask is None else mask[:, None, :]  # [b, 1, m]
        conv_a, mish_a, conv_b, mish_b = self.conv1d
        # On CUDA, cuDNN runs a grouped convolution group by group at ~10x its arithmetic cost; the same sum as
        # one batched matrix product is far cheaper. The CPU keeps the plain convolution.
        conv = _grouped_conv_as_bmm if x.is_cuda else (lambda h, layer: layer(h))
        h = _zero_rows(x.transpose(1, 2), keep)  # [b, d, m]
        h = mish_a(_zero_rows(conv(h, conv_a), keep))
        h = mish_b(_zero_rows(conv(h, conv_b), keep))
        return h.transpose(1, 2)  # [b, m, d]


def _grouped_conv_as_bmm(h: Tensor, layer: nn.Conv1d) -> Tensor:
    """``layer(h)`` for a grouped, 'same'-padded Conv1d, computed as im2col + one batched matmul per group."""
    b, d, m = h.shape
    g, k = layer.groups, layer.kernel_size[0]
    cols = F.pad(h, (layer.padding[0], layer.padding[0])).unfold(2, k, 1)  # [b, d, m, k]
    cols = cols.reshape(b, g, d // g, m, k).permute(1, 0, 3, 2, 4).reshape(g, b * m, (d // g) * k)  # [g, b*m, ci*k]
    weight = layer.weight.reshape(g, -1, (d // g) * k).transpose(1, 2)  # [g, ci*k, co]
    out = torch.bmm(cols, weight)  # [g, b*m, co]
    out = out.reshape(g, b, m, -1).permute(1, 0, 3, 2).reshape(b, -1, m)  # [b, d, m]
    return out + layer.bias[None, :, None]


class AudioEmbedding(nn.Module):
    """Latents to model width: ``Linear(z) + ConvPos(Linear(z))``."""

    def __init__(self, latent_dim: int, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(latent_dim, dim)
        self.conv_pos_embed = ConvPositionEmbedding(dim)

    def forward(self, z: Tensor, mask: Tensor | None, kernel: bool = False) -> Tensor:  # z [b, m, l] -> [b, m, d]
        """``kernel``: the position convolutions by the position-conv kernel."""
        h = self.linear(z)
        if kernel:
            return self.conv_pos_embed.with_kernel(h, mask, residual=h)
        return self.conv_pos_embed(h, mask) + h


class RotaryEmbedding(nn.Module):
    """Rotary frequencies for interleaved (GPT-J) pairs, held in the persistent buffer ``inv_freq`` [dh // 2].

    The release stores a bf16-rounded copy of the analytic schedule and upstream uses those stored values, so the
    buffer is used as loaded. It is kept in fp32 whatever dtype the module is cast or loaded to.
    """

    def __init__(self, dim_head: int) -> None:
        super().__init__()
        exponents = torch.arange(0, dim_head, 2, dtype=torch.float32) / dim_head
        self.register_buffer("inv_freq", 1.0 / (ROTARY_BASE**exponents), persistent=True)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> RotaryEmbedding:
        # Follow device moves but never round the frequencies: `.to(bfloat16)` would otherwise cast the buffer.
        before = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            source = self.inv_freq if before.is_meta else before
            self.inv_freq = source.to(device=self.inv_freq.device, dtype=torch.float32)
        return self

    def _load_from_state_dict(self, state_dict: dict[str, Tensor], prefix: str, *args: Any, **kwargs: Any) -> None:
        key = prefix + "inv_freq"
        if key in state_dict:  # a checkpoint cast wholesale to bf16 still loads its frequencies as fp32
            state_dict[key] = state_dict[key].to(torch.float32)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def tables(self, positions: Tensor) -> Rope:
        angles = positions.to(torch.float32)[..., None] * self.inv_freq.to(torch.float32)  # [bc, m, dh/2]
        angles = angles.repeat_interleave(2, dim=-1)[:, :, None]  # [bc, m, 1, dh], pairs share a frequency
        return Rope(positions=positions, cos=angles.cos(), sin=angles.sin())


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate interleaved pairs (a, b) of ``x`` [bc, m, h, dh] in fp32; returns x's dtype."""
    x32 = x.float()
    pairs = x32.unflatten(-1, (-1, 2))  # [bc, m, h, dh/2, 2]
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (a, b) -> (-b, a)
    return (x32 * rope.cos + rotated * rope.sin).to(x.dtype)


class AdaLayerNorm(nn.Module):
    """Six modulation chunks from the time embedding, in the order
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp.

    ``linear(silu(temb))`` is the block's modulation row [r, 6d] (see :meth:`AuKDiT.modulation`); ``forward``
    splits a row into its chunks, each [r, 1, d]."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, modulation: Tensor) -> tuple[Tensor, ...]:
        return tuple(chunk[:, None] for chunk in modulation.chunk(6, dim=1))


class AdaLayerNormFinal(nn.Module):
    """Final modulation; its two chunks are (scale, shift), the reverse of the block order."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: Tensor, modulation: Tensor, kernel: bool = False) -> Tensor:  # modulation [r, 2d]
        scale, shift = modulation.chunk(2, dim=1)
        return _modulated_norm(x, shift[:, None], scale[:, None], kernel)


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=LAYER_NORM_EPS) * (1 + scale) + shift


# The kernel of contexts with conv_kernel; CPU tests swap in a reference.
position_conv = position_conv_kernel.position_conv
# The kernels of layouts with norm_kernel; CPU tests swap in references.
modulated_norm = modulated_norm_kernel.modulated_norm
gated_residual_norm = modulated_norm_kernel.gated_residual_norm


def _modulated_norm(x: Tensor, shift: Tensor, scale: Tensor, kernel: bool) -> Tensor:
    """A block's adaptive norm, ``LN(x) * (1 + scale) + shift``; ``kernel``: as one modulated-norm kernel."""
    return modulated_norm(x, shift, scale, LAYER_NORM_EPS) if kernel else _modulate(x, shift, scale)


def _gated_residual_norm(
    x: Tensor, y: Tensor, gate: Tensor, keep: Tensor | None, shift: Tensor, scale: Tensor, kernel: bool
) -> tuple[Tensor, Tensor]:
    """The residual stream after the attention, ``x + gate * y`` with y zeroed at the rows ``keep`` drops, and
    its adaptive norm for the feed-forward; ``kernel``: both from one modulated-norm kernel."""
    if kernel:
        return gated_residual_norm(x, y, gate, keep, shift, scale, LAYER_NORM_EPS)
    x = x + gate * _zero_rows(y, keep)
    return x, _modulate(x, shift, scale)


class FeedForward(nn.Module):
    """SwiGLU with the gate and up projections fused into ``linear_in``; no biases."""

    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * inner_dim, bias=False)
        self.linear_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.linear_in(x).chunk(2, dim=-1)
        return self.linear_out(F.silu(gate) * up)


def attend(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, visible_keys: VisibleKeys | None,
    keys_in_order: bool = False, split: int | None = None, first: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of q, k, v [bc, m, h, dh] over the keys ``key_mask`` [bc, 1, 1, m] lets through (None = all);
    returns [bc, m, h*dh]. With ``visible_keys`` (the same mask, reordered) the variable-length kernel runs
    instead of a masked one: the same sum over the same keys, on the [bc * m, h, dh] layout the projections
    already have (no transposes). ``keys_in_order``: k and v already come in ``visible_keys``' order.

    With ``split`` it returns the first ``split`` positions and the rest as two parts, [bc, split, h*dh] and
    [bc, m - split, h*dh]; the hand-written kernel writes each part contiguous, so that each goes into its own
    output projection as one plain matrix (a strided part costs the audio stream's projection a slower product
    and a separate bias add: bench/RESULTS.md).

    With ``first`` only the queries from position ``first`` on are attended, over the same keys: [bc, m - first,
    h*dh]. SDPA and the hand-written kernel compute only those; FlashAttention's attends every query."""
    bc, m, h, dh = q.shape
    if visible_keys is None:
        q, k, v = (t.transpose(1, 2) for t in (q[:, first:], k, v))  # [bc, h, m (q: m - first), dh] views
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask).transpose(1, 2).flatten(2)
    else:
        if not keys_in_order:
            order = visible_keys.order[:, :, None, None].expand(bc, m, h, dh)
            k, v = k.gather(1, order), v.gather(1, order)
        q, k, v = (t.reshape(bc * m, h, dh) for t in (q, k, v))
        starts, count = visible_keys.starts, visible_keys.count
        if visible_keys.kernel and split is not None:  # the two parts, each written in one piece
            out = varlen_attention_kernel.varlen_attention(q, k, v, starts, count, m, split=split)
            return out[: bc * split].view(bc, split, h * dh), out[bc * split :].view(bc, m - split, h * dh)
        if visible_keys.kernel and first:
            out = varlen_attention_kernel.varlen_attention(q, k, v, starts, count, m, first=first)
            return out.view(bc, m - first, h * dh)
        kernel = varlen_attention_kernel.varlen_attention if visible_keys.kernel else varlen_attention
        out = kernel(q, k, v, starts, count, m).reshape(bc, m, h * dh)[:, first:]
    return out if split is None else (out[:, :split], out[:, split:])


def flash_varlen_attention(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, count: Tensor, m: int) -> Tensor:
    """FlashAttention over rows packed as [rows * m, h, dh]: row i's queries attend to its first ``count[i]``
    keys. CUDA, fp16 or bf16 only (:func:`varlen_attention_supported`)."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, starts, starts, m, m, 0.0, False, False, seqused_k=count)
    return out[0]


varlen_attention = flash_varlen_attention  # the kernel `attend` calls; CPU tests swap in a reference
# The kernel of layouts with inputs_kernel; CPU tests swap in a reference.
attention_inputs = attention_inputs_kernel.attention_inputs


def varlen_attention_supported(device: torch.device, dtype: torch.dtype, dim_head: int) -> bool:
    """Where the variable-length kernel runs: FlashAttention's GPUs (sm80 and later), half precision, head widths
    it compiles (multiples of 8 up to 256)."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(device) >= (8, 0)
        and dim_head % 8 == 0
        and dim_head <= 256
    )


class Attention(nn.Module):
    """Self-attention with per-head RMSNorm (torch's default eps) on q and k, then rotary positions. Holds the
    weights; the block runs the qkv and output projections as parts of its phases (:class:`BlockPhases`)."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head)
        self.q_norm = nn.RMSNorm(dim_head, elementwise_affine=True)
        self.k_norm = nn.RMSNorm(dim_head, elementwise_affine=True)
        self.to_out = nn.ModuleList([nn.Linear(heads * dim_head, dim)])  # named `to_out.0` in the release

    def _project(self, qkv: Tensor, q_norm: nn.Module, k_norm: nn.Module, rope: Rope) -> tuple[Tensor, ...]:
        q, k, v = (part.unflatten(-1, (self.heads, self.dim_head)) for part in qkv.chunk(3, dim=-1))
        # q, k, v: [bc, m, h*dh] -> [bc, m, h, dh]
        return apply_rope(q_norm(q), rope), apply_rope(k_norm(k), rope), v

    def _fused_attention(
        self,
        streams: list[tuple[Tensor, nn.RMSNorm, nn.RMSNorm, Rope]],
        key_mask: Tensor | None,
        visible_keys: VisibleKeys | None,
        first: int = 0,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attention over the (qkv, q_norm, k_norm, rope) streams joined along the sequence, their q, k, v made by
        the attention-inputs kernel (k and v straight into ``visible_keys``' order): [bc, sum m, h*dh], or with
        two streams the output of each ([bc, m_i, h*dh], see ``attend``'s ``split``); ``first`` as ``attend``'s."""
        eps = self.q_norm.eps if self.q_norm.eps is not None else torch.finfo(torch.float32).eps  # torch's default
        slot = None if visible_keys is None else visible_keys.slot
        q, k, v = attention_inputs(
            [(qkv, q_norm.weight, k_norm.weight, rope.cos, rope.sin) for qkv, q_norm, k_norm, rope in streams],
            self.heads, eps, slot,
        )
        split = streams[0][0].shape[1] if len(streams) == 2 else None
        return attend(q, k, v, key_mask, visible_keys, keys_in_order=True, split=split, first=first)

    def attend_qkv(self, qkv: Tensor, layout: SingleLayout, first: int = 0) -> Tensor:
        """The attention from the qkv projection [bc, m, 3*h*dh] to the output projection's input [bc, m, h*dh];
        ``first``: only the queries from that position on, [bc, m - first, h*dh] (keys from every position)."""
        if layout.inputs_kernel:
            return self._fused_attention([(qkv, self.q_norm, self.k_norm, layout.rope)], layout.key_mask,
                                         layout.visible_keys, first)
        q, k, v = self._project(qkv, self.q_norm, self.k_norm, layout.rope)
        return attend(q, k, v, layout.key_mask, layout.visible_keys, first=first)


class JointAttention(Attention):
    """Audio (x) and text (c) keep their own projections and norms, and attend together as [audio, text]."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__(dim, heads, dim_head)
        self.to_qkv_c = nn.Linear(dim, 3 * heads * dim_head)
        self.c_q_norm = nn.RMSNorm(dim_head, elementwise_affine=True)
        self.c_k_norm = nn.RMSNorm(dim_head, elementwise_affine=True)
        self.to_out_c = nn.Linear(heads * dim_head, dim)

    def attend_streams(self, qkv: Tensor, qkv_c: Tensor, layout: JointLayout) -> tuple[Tensor, Tensor]:
        """The joint attention from the two streams' qkv projections ([bc, na, 3*h*dh], [bc, nt, 3*h*dh]) to the
        output projections' inputs, audio [bc, na, h*dh] and text [bc, nt, h*dh], over the joint sequence (audio
        positions first). Padded rows are zeroed by the block (layout.audio_keep, text_keep)."""
        if layout.inputs_kernel:  # both streams written straight into the joint sequence
            streams = [(qkv, self.q_norm, self.k_norm, layout.rope_audio),
                       (qkv_c, self.c_q_norm, self.c_k_norm, layout.rope_text)]  # fmt: skip
            return self._fused_attention(streams, layout.key_mask, layout.visible_keys)
        q, k, v = self._project(qkv, self.q_norm, self.k_norm, layout.rope_audio)
        cq, ck, cv = self._project(qkv_c, self.c_q_norm, self.c_k_norm, layout.rope_text)
        q, k, v = (torch.cat(pair, dim=1) for pair in ((q, cq), (k, ck), (v, cv)))  # [bc, na + nt, h, dh]
        return attend(q, k, v, layout.key_mask, layout.visible_keys, split=qkv.shape[1])


def block_inputs(h: Tensor, shift: Tensor, scale: Tensor, to_qkv: nn.Module, norm_kernel: bool) -> Tensor:
    """One stream's way into a block's attention: its adaptive norm, then the qkv projection.
    [bc, m, d] -> [bc, m, 3*h*dh]."""
    return to_qkv(_modulated_norm(h, shift, scale, norm_kernel))


def block_outputs(
    h: Tensor, attended: Tensor, to_out: nn.Module, gate: Tensor, keep: Tensor | None, shift_ff: Tensor,
    scale_ff: Tensor, ff: nn.Module, gate_ff: Tensor, norm_kernel: bool,
) -> Tensor:
    """One stream's way out of a block: the attention's output projection into the residual stream through its
    gate (zeroed at the rows ``keep`` drops), then the feed-forward through its own norm and gate. [bc, m, d]."""
    h, normed = _gated_residual_norm(h, to_out(attended), gate, keep, shift_ff, scale_ff, norm_kernel)
    return h + gate_ff * ff(normed)


@dataclass(frozen=True)
class BlockPhases:
    """What a block runs, in three phases per stream: the way into the attention, the attention, the way out.
    ``compile_dit_blocks`` swaps in compiled phases. Split this way, a double block's text stream can run its
    phases on a second CUDA stream, beside the audio stream's (``AuKDiT.text_stream``)."""

    inputs: Callable[..., Tensor] = block_inputs
    attention: Callable[..., Tensor] = Attention.attend_qkv  # (attn, qkv, layout, first)
    joint_attention: Callable[..., tuple[Tensor, Tensor]] = JointAttention.attend_streams  # (attn, qkv, qkv_c, layout)
    outputs: Callable[..., Tensor] = block_outputs

    def compiled(self, **options: Any) -> BlockPhases:
        """The streams' phases (``inputs``, ``outputs``) through ``torch.compile(phase, **options)``. The attention
        phases stay as they are: on the fast path they are the hand-written kernels already (see bench/RESULTS.md
        on what compiling them cost)."""
        return replace(self, inputs=torch.compile(self.inputs, **options), outputs=torch.compile(self.outputs, **options))


PLAIN_PHASES = BlockPhases()


class DoubleStreamBlock(nn.Module):
    """MMDiT block: separate modulation and feed-forward per stream, one joint attention."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.attn_norm_c = AdaLayerNorm(config.dim)
        self.attn_norm_x = AdaLayerNorm(config.dim)
        self.attn = JointAttention(config.dim, config.heads, config.dim_head)
        self.ff_c = FeedForward(config.dim, config.ff_inner_dim)
        self.ff_x = FeedForward(config.dim, config.ff_inner_dim)

    def forward(
        self,
        x: Tensor,
        c: Tensor,
        modulation: tuple[Tensor, Tensor],
        layout: JointLayout,
        phases: BlockPhases = PLAIN_PHASES,
        text_stream: torch.cuda.Stream | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``text_stream``: the text stream's phases run there, beside the audio stream's (None: one after the
        other on the current stream). Each stream's arithmetic is the same either way."""
        x_mod, c_mod = modulation  # [r, 6d] each, r = 1 or bc
        x_shift, x_scale, x_gate, x_shift_ff, x_scale_ff, x_gate_ff = self.attn_norm_x(x_mod)
        c_shift, c_scale, c_gate, c_shift_ff, c_scale_ff, c_gate_ff = self.attn_norm_c(c_mod)
        attn, kernel = self.attn, layout.norm_kernel
        with beside(text_stream):
            qkv_c = phases.inputs(c, c_shift, c_scale, attn.to_qkv_c, kernel)
        qkv = phases.inputs(x, x_shift, x_scale, attn.to_qkv, kernel)
        join(text_stream)
        out_x, out_c = phases.joint_attention(attn, qkv, qkv_c, layout)  # [bc, na, h*dh], [bc, nt, h*dh]
        with beside(text_stream):
            c = phases.outputs(c, out_c, attn.to_out_c, c_gate, layout.text_keep, c_shift_ff, c_scale_ff, self.ff_c,
                               c_gate_ff, kernel)
        x = phases.outputs(x, out_x, attn.to_out[0], x_gate, layout.audio_keep, x_shift_ff, x_scale_ff, self.ff_x,
                           x_gate_ff, kernel)
        join(text_stream)
        return x, c


class SingleStreamBlock(nn.Module):
    """DiT block over the whole [text | ref | target] sequence."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNorm(config.dim)
        self.attn = Attention(config.dim, config.heads, config.dim_head)
        self.ff = FeedForward(config.dim, config.ff_inner_dim)

    def forward(
        self, h: Tensor, modulation: Tensor, layout: SingleLayout, phases: BlockPhases = PLAIN_PHASES,
        target: int | None = None,
    ) -> Tensor:  # modulation [r, 6d]
        """``target``: only the last ``target`` positions come out, [bc, target, d], their queries over the keys
        and values of every position. The DiT's last block runs so: only the target is projected to latents, so
        the rest of its queries, output projection and feed-forward would be thrown away."""
        shift, scale, gate, shift_ff, scale_ff, gate_ff = self.attn_norm(modulation)
        attn, kernel = self.attn, layout.norm_kernel
        qkv = phases.inputs(h, shift, scale, attn.to_qkv, kernel)
        keep = layout.keep
        if target is None:
            out = phases.attention(attn, qkv, layout)
        else:
            first = h.shape[1] - target
            out = phases.attention(attn, qkv, layout, first)
            # Contiguous, as every other block's input: the compiled phase then serves this block as well.
            h, keep = h[:, first:].contiguous(), layout.target_keep
        return phases.outputs(h, out, attn.to_out[0], gate, keep, shift_ff, scale_ff, self.ff, gate_ff, kernel)


# ---------------------------------------------------------------------------------------------------------------
# The backbone


def _lengths(name: str, lens: Tensor | None, rows: int, full: int, lowest: int) -> Tensor:
    """Validate per-row lengths [rows] within [lowest, full]; None means every row is full. Returns them on the
    CPU (read there without a GPU sync when the caller passes host tensors, as the pipeline does)."""
    if lens is None:
        return torch.full((rows,), full, dtype=torch.long)
    lens = torch.as_tensor(lens).cpu()
    if lens.shape != (rows,) or lens.is_floating_point() or lens.dtype == torch.bool:
        raise InputError(f"{name} must be an integer tensor of shape [{rows}], got {tuple(lens.shape)} {lens.dtype}")
    lens = lens.long()
    if rows and (int(lens.min()) < lowest or int(lens.max()) > full):
        raise InputError(f"{name} must lie in [{lowest}, {full}], got {lens.tolist()}")
    return lens


def _positions(present: Tensor) -> Tensor:
    """Rank of each present item within its row (cumsum - 1); absent items take their neighbour's position."""
    return (present.long().cumsum(dim=1) - 1).clamp_min(0)


def _key_mask(visible: Tensor) -> Tensor | None:
    mask = _all_or_none(visible)
    return None if mask is None else mask[:, None, None, :]  # [bc, m] -> [bc, 1, 1, m]


def _visible_keys(key_mask: Tensor | None, enabled: bool, kernel: bool, device: torch.device) -> VisibleKeys | None:
    """``key_mask`` [bc, 1, 1, m] as :class:`VisibleKeys` on ``device`` when ``enabled`` (None without a mask);
    ``kernel``: for the hand-written kernel."""
    if key_mask is None or not enabled:
        return None
    visible = key_mask[:, 0, 0, :]  # [bc, m]
    rows, m = visible.shape
    order = torch.argsort((~visible).to(torch.int8), dim=1, stable=True)  # built where the mask is, then moved
    return VisibleKeys(
        order=_to_device(order, device),
        slot=_to_device(torch.argsort(order, dim=1).to(torch.int32), device),
        count=_to_device(visible.sum(dim=1, dtype=torch.int32), device),
        starts=_to_device(torch.arange(rows + 1, dtype=torch.int32) * m, device),
        kernel=kernel,
    )


def _to_device(t: Tensor | None, device: torch.device) -> Tensor | None:
    """A host tensor copied to ``device`` without waiting for it (None stays None)."""
    return None if t is None else t.to(device, non_blocking=True)


def _switch(setting: bool | None, supported: bool) -> bool:
    """A fast-path switch of the model: its setting, or where None (automatic) whether the path is supported."""
    return supported if setting is None else setting


def _keep(valid: Tensor) -> Tensor | None:
    keep = _all_or_none(valid)
    return None if keep is None else keep[..., None]  # [bc, m] -> [bc, m, 1]


class AuKDiT(nn.Module):
    """The AuK velocity model. Build on the meta device and load the release weights strictly."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        self.time_embed = TimestepEmbedding(config.dim)
        self.txt_proj = nn.Linear(config.text_hidden_dim, config.dim)
        self.txt_norm = nn.RMSNorm(config.dim, elementwise_affine=True)
        self.audio_embed = AudioEmbedding(config.latent_dim, config.dim)
        self.rotary_embed = RotaryEmbedding(config.dim_head)
        self.transformer_blocks = nn.ModuleList(DoubleStreamBlock(config) for _ in range(config.num_layers))
        self.single_transformer_blocks = nn.ModuleList(
            SingleStreamBlock(config) for _ in range(config.num_single_layers)
        )
        self.norm_out = AdaLayerNormFinal(config.dim)
        self.proj_out = nn.Linear(config.dim, config.latent_dim)
        # Masked attention runs through the variable-length kernel, the attention's q, k, v are made by the
        # attention-inputs kernel, the adaptive norms by the modulated-norm kernel: None = wherever each is
        # supported.
        self.varlen_attention: bool | None = None
        self.inputs_kernel: bool | None = None
        self.norm_kernel: bool | None = None
        # The variable-length attention through the hand-written kernel instead of FlashAttention's.
        self.attention_kernel: bool | None = None
        # The position convolutions of the audio embedding through the position-conv kernel.
        self.conv_kernel: bool | None = None
        # The blocks' phases (compiled by compile_dit_blocks), and the CUDA stream the double blocks' text stream
        # runs on beside the audio stream (None: the current stream; StepGraphs sets one).
        self.phases = PLAIN_PHASES
        self.text_stream: torch.cuda.Stream | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def prepare(
        self,
        text: Tensor,
        text_lens: Tensor,
        ref: Tensor | None,
        ref_lens: Tensor | None,
        ref_valid_lens: Tensor | None,
        target_len: int,
        target_lens: Tensor | None = None,
        *,
        cfg: bool,
    ) -> DiTContext:
        """Compute the per-request context for a batch of ``b`` rows.

        text [b, nt, dt] fused condition, valid for the first ``text_lens`` tokens of each row.
        ref [b, np, l] normalised reference latents (or None / np == 0): the first ``ref_lens`` frames of a row take
        sequence positions, of which the first ``ref_valid_lens`` are visible to attention (an encoder's extra
        frame past floor(T/480) takes a position but is masked; None = all). ``target_len`` is the padded target
        length n, ``target_lens`` the valid frames per row (None = n). With ``cfg`` the rows are doubled into
        [cond..., uncond...]: uncond rows see zero projected text (same text mask) and a reference of zero latents.

        The lengths are read on the host: pass host tensors (as the pipeline does) and preparing never waits for
        the GPU. Positions count only the items a row holds, so a padded row gets the positions it would have
        alone. Batch padding is never visible as a key. Masked reference frames are hidden as keys when
        ``attn_mask_enabled``; with it off they stay visible, as upstream does for a single request.
        """
        config, device, dtype = self.config, self.device, self.dtype
        if text.ndim != 3 or text.shape[-1] != config.text_hidden_dim or text.shape[1] < 1:
            raise InputError(f"text must be [b, nt >= 1, {config.text_hidden_dim}], got {tuple(text.shape)}")
        rows, nt = text.shape[:2]
        if isinstance(target_len, bool) or not isinstance(target_len, int) or target_len < 1:
            raise InputError(f"target_len must be a positive integer, got {target_len!r}")
        if ref is not None and (ref.ndim != 3 or ref.shape[0] != rows or ref.shape[-1] != config.latent_dim):
            raise InputError(f"ref must be [{rows}, np, {config.latent_dim}], got {tuple(ref.shape)}")
        np_ = 0 if ref is None else ref.shape[1]

        # The masks are built on the host from host lengths and moved once, so preparing never waits for the GPU.
        text_valid = torch.arange(nt) < _lengths("text_lens", text_lens, rows, nt, 1)[:, None]  # [b, nt]
        target_valid = torch.arange(target_len) < _lengths("target_lens", target_lens, rows, target_len, 1)[:, None]
        ref_lens = _lengths("ref_lens", ref_lens, rows, np_, 0)
        ref_valid_lens = ref_lens if ref_valid_lens is None else _lengths("ref_valid_lens", ref_valid_lens, rows, np_, 0)
        if bool((ref_valid_lens > ref_lens).any()):
            raise InputError("ref_valid_lens must not exceed ref_lens")
        ref_present = torch.arange(np_) < ref_lens[:, None]  # [b, np]
        ref_valid = torch.arange(np_) < ref_valid_lens[:, None]  # [b, np]

        conv_kernel = _switch(self.conv_kernel, position_conv_kernel.available(device, dtype))
        if conv_kernel:
            self.audio_embed.conv_pos_embed.packed_weights()  # here, not in a step graph's capture
        c = self.txt_norm(self.txt_proj(text.to(device=device, dtype=dtype)))  # [b, nt, d]
        ref_embed = None
        ref_conv_mask = _to_device(_all_or_none(ref_valid), device)
        if np_ > 0:
            ref = ref.to(device=device, dtype=dtype)
            ref_embed = self.audio_embed(ref, ref_conv_mask, conv_kernel)  # [b, np, d]

        def branches(cond: Tensor, uncond: Tensor) -> Tensor:
            return torch.cat((cond, uncond), dim=0) if cfg else cond

        c = branches(c, torch.zeros_like(c))  # uncond text is zeroed after txt_proj + txt_norm
        if ref_embed is not None and cfg:  # embedded only for CFG's uncond rows
            ref_embed = branches(ref_embed, self.audio_embed(torch.zeros_like(ref), ref_conv_mask, conv_kernel))
        text_valid, ref_present, ref_valid, target_present = (
            branches(mask, mask) for mask in (text_valid, ref_present, ref_valid, target_valid)
        )

        audio_present = torch.cat((ref_present, target_present), dim=1)  # [bc, na]
        audio_valid = torch.cat((ref_valid, target_present), dim=1)
        audio_visible = audio_valid if config.attn_mask_enabled else audio_present
        single_present = torch.cat((text_valid, audio_present), dim=1)  # [bc, ns]

        def rope(present: Tensor) -> Rope:
            return self.rotary_embed.tables(_to_device(_positions(present), device))

        varlen = _switch(self.varlen_attention, varlen_attention_supported(device, dtype, config.dim_head))
        inputs_kernel = _switch(self.inputs_kernel, attention_inputs_kernel.available(device, dtype, config.dim_head))
        norm_kernel = _switch(self.norm_kernel, modulated_norm_kernel.available(device, dtype))
        attention_kernel = _switch(self.attention_kernel, varlen_attention_kernel.available(device, dtype, config.dim_head))
        joint_mask = _key_mask(torch.cat((audio_visible, text_valid), dim=1))
        single_mask = _key_mask(torch.cat((text_valid, audio_visible), dim=1))
        joint = JointLayout(
            rope_audio=rope(audio_present),
            rope_text=rope(text_valid),
            key_mask=_to_device(joint_mask, device),
            visible_keys=_visible_keys(joint_mask, varlen, attention_kernel, device),
            audio_keep=_to_device(_keep(audio_valid), device),
            text_keep=_to_device(_keep(text_valid), device),
            inputs_kernel=inputs_kernel,
            norm_kernel=norm_kernel,
        )
        single = SingleLayout(
            rope=rope(single_present),
            key_mask=_to_device(single_mask, device),
            visible_keys=_visible_keys(single_mask, varlen, attention_kernel, device),
            keep=_to_device(_keep(torch.cat((text_valid, audio_valid), dim=1)), device),
            target_keep=_to_device(_keep(target_present), device),
            inputs_kernel=inputs_kernel,
            norm_kernel=norm_kernel,
        )
        return DiTContext(
            cfg=cfg,
            text=c,
            ref=ref_embed,
            target_mask=_to_device(_all_or_none(target_valid), device),
            target_len=target_len,
            joint=joint,
            single=single,
            conv_kernel=conv_kernel,
        )

    def _modulation_layers(self) -> list[nn.Module]:
        """Every adaLN layer in the order their rows are laid out in :meth:`modulation`."""
        layers: list[nn.Module] = []
        for block in self.transformer_blocks:
            layers += [block.attn_norm_x, block.attn_norm_c]
        layers += [block.attn_norm for block in self.single_transformer_blocks]
        return [*layers, self.norm_out]

    @property
    def modulation_widths(self) -> list[int]:
        """Width of each adaLN layer's part of a :meth:`modulation` row, in layout order."""
        return [layer.linear.out_features for layer in self._modulation_layers()]

    def modulation(self, t: Tensor) -> Tensor:
        """Every adaLN linear's output at times ``t`` [s]: the modulation rows [s, width], laid out block by
        block (double blocks' audio then text, single blocks, the final norm).

        They depend on t alone, so a sampler can compute them for a whole time grid once per render
        (``forward(..., modulation=rows[i : i + 1])``) rather than re-reading every modulation weight each step."""
        act = F.silu(self.time_embed(t))  # [s, d]
        return torch.cat([layer.linear(act) for layer in self._modulation_layers()], dim=1)

    def forward(self, x: Tensor, t: Tensor | float, ctx: DiTContext, modulation: Tensor | None = None) -> Tensor:
        """Velocity for every context row: x [b, n, l] noisy target (the ODE state, NOT doubled for CFG),
        t a 0-d or [b] time in [0, 1]. Returns [bc, n, l] in the weight dtype, cond rows then uncond rows.

        ``modulation`` [1, width] is ``self.modulation(t[None])`` computed ahead (every row at the same t); when
        None it is computed here, per row. The target is embedded once and shared by both CFG branches."""
        b = ctx.batch
        if x.shape != (b, ctx.target_len, self.config.latent_dim):
            raise InputError(f"x must be [{b}, {ctx.target_len}, {self.config.latent_dim}], got {tuple(x.shape)}")
        if modulation is None:
            t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
            t = t.expand(b) if t.ndim == 0 else t
            if t.shape != (b,):
                raise InputError(f"t must be a scalar or of shape [{b}], got {tuple(t.shape)}")
            modulation = self.modulation(t)  # [b, width]
            if ctx.cfg:
                modulation = modulation.repeat(2, 1)  # [2b, width]: cond rows, then uncond rows
        rows = iter(modulation.split(self.modulation_widths, dim=1))  # one [r, width_i] per adaLN layer, in layout order

        target = self.audio_embed(x.to(self.dtype), ctx.target_mask, ctx.conv_kernel)  # [b, n, d]
        if ctx.cfg:
            target = target.repeat(2, 1, 1)  # [2b, n, d]: cond rows, then uncond rows
        audio = target if ctx.ref is None else torch.cat((ctx.ref, target), dim=1)  # [bc, na, d]
        text = ctx.text  # [bc, nt, d]

        for block in self.transformer_blocks:
            audio, text = block(audio, text, (next(rows), next(rows)), ctx.joint, self.phases, self.text_stream)
        h = torch.cat((text, audio), dim=1)  # [bc, ns, d]
        *blocks, last = self.single_transformer_blocks or [None]
        for block in blocks:
            h = block(h, next(rows), ctx.single, self.phases)
        # Only the target, the last n positions, is projected to latents: the last block computes only those.
        n = ctx.target_len
        h = h[:, -n:] if last is None else last(h, next(rows), ctx.single, self.phases, target=n)  # [bc, n, d]
        return self.proj_out(self.norm_out(h, next(rows), ctx.single.norm_kernel))  # [bc, n, l]
