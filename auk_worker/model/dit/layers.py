"""The DiT's leaf layers: time and audio embeddings, rotary positions, adaptive layer norms, the feed-forward.

Each layer is its plain torch form. Where the DiT runs a hand-written kernel instead (the position convolutions,
the adaptive norms), the kernel comes in as an argument, from the context ``AuKDiT.prepare`` builds out of the
DiT's kernel table; None runs the torch form.

Precision: the time sinusoid, rotary positions, ``inv_freq`` and the rotary products stay fp32; values are cast
to the weight dtype where they enter a Linear.

Shapes: b rows, m positions, d model width, h heads, dh head width, l latent channels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from auk_worker.model.dit.config import GatedResidualNorm, ModulatedNorm, PositionConv, Rope
from auk_worker.model.dit.kernels.position_conv import pack

ROTARY_BASE = 10000.0
TIME_FREQ_DIM = 256  # width of the time sinusoid
TIME_SCALE = 1000.0  # t in [0, 1] is scaled by this before the sinusoid
CONV_KERNEL = 31
CONV_GROUPS = 16
LAYER_NORM_EPS = 1e-6


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
            self._packed_weights = tuple(pack(conv) for conv in convs)
            self._packed = made_from
        return self._packed_weights

    def with_kernel(
        self, kernel: PositionConv, x: Tensor, mask: Tensor | None, residual: Tensor | None = None
    ) -> Tensor:
        """``forward(x, mask) + residual`` by two calls of the position-conv ``kernel`` (x [b, m, d] -> [b, m, d])."""
        (conv_a, _, conv_b, _), (packed_a, packed_b) = self.conv1d, self.packed_weights()
        h = kernel(x, packed_a, conv_a.bias, mask)
        return kernel(h, packed_b, conv_b.bias, mask, residual)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:  # x [b, m, d], mask [b, m]
        keep = None if mask is None else mask[:, None, :]  # [b, 1, m]
        conv_a, mish_a, conv_b, mish_b = self.conv1d
        # On CUDA, cuDNN runs a grouped convolution group by group, far above its arithmetic cost; the same sum as
        # one batched matrix product is much cheaper. The CPU keeps the plain convolution.
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

    def forward(
        self, z: Tensor, mask: Tensor | None, kernel: PositionConv | None = None
    ) -> Tensor:  # z [b, m, l] -> [b, m, d]
        """``kernel``: the position convolutions run by that kernel (None: the torch form)."""
        h = self.linear(z)
        if kernel is not None:
            return self.conv_pos_embed.with_kernel(kernel, h, mask, residual=h)
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

    def forward(self, x: Tensor, modulation: Tensor, kernel: ModulatedNorm | None = None) -> Tensor:
        scale, shift = modulation.chunk(2, dim=1)  # modulation [r, 2d]
        return modulated_norm(x, shift[:, None], scale[:, None], kernel)


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=LAYER_NORM_EPS) * (1 + scale) + shift


def modulated_norm(x: Tensor, shift: Tensor, scale: Tensor, kernel: ModulatedNorm | None) -> Tensor:
    """A block's adaptive norm, ``LN(x) * (1 + scale) + shift``; ``kernel``: computed by it (None: torch ops)."""
    return kernel(x, shift, scale, LAYER_NORM_EPS) if kernel is not None else _modulate(x, shift, scale)


def gated_residual_norm(
    x: Tensor, y: Tensor, gate: Tensor, keep: Tensor | None, shift: Tensor, scale: Tensor,
    kernel: GatedResidualNorm | None,
) -> tuple[Tensor, Tensor]:
    """The residual stream after the attention, ``x + gate * y`` with y zeroed at the rows ``keep`` drops, and
    its adaptive norm for the feed-forward; ``kernel``: both computed by it (None: torch ops)."""
    if kernel is not None:
        return kernel(x, y, gate, keep, shift, scale, LAYER_NORM_EPS)
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
