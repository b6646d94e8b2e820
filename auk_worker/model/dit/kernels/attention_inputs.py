"""The attention's inputs as one Triton kernel: q and k through per-head RMSNorm and rotary positions, and v,
from the qkv projection straight into the attention's input layout.

Every DiT attention normalises each head of q and k (RMSNorm over the head width, learned weight) and rotates
interleaved pairs (a, b) -> (a cos - b sin, b cos + a sin) by the rotary tables. Inductor fuses this into one kernel
per block, but that kernel loads each element's rotary partner, and its weight, with predicated scalar loads, far
below the memory bandwidth the work could use. Here a program takes ``BLOCK`` (position, head) rows of q, k and v,
loads each row once, swaps the pairs in registers and writes [bc, seq, h, dh]. The double blocks' two streams
(audio, then text) each write their part of the joint sequence, so no concatenation follows. Where the
variable-length attention will read each row's keys visible first (``VisibleKeys``), k and v are written in that
order (``slot``: each key's place in it), so no gather follows either.

Arithmetic as inductor's compile of the torch form (``Attention._project``): fp32 from the load on, the normed
value not rounded before the rotation, one rounding to the output dtype at the end.

Shapes: bc rows, m positions of a stream, seq the positions of all streams, h heads, dh head width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: callers check ``available``
    triton = None

BLOCK = 32  # (position, head) rows per program

Stream = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # qkv [bc, m, 3*h*dh], q weight [dh], k weight, cos, sin
Attention = tuple[Tensor, Tensor, Tensor]  # q, k, v [bc, seq, h, dh]


def available(device: torch.device, dtype: torch.dtype, dim_head: int) -> bool:
    """Where the kernel runs: a CUDA device with Triton, half precision, a power-of-two head width."""
    return (
        triton is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and dim_head >= 2
        and dim_head & (dim_head - 1) == 0
    )


def attention_inputs_reference(
    streams: Sequence[Stream], heads: int, eps: float, slot: Tensor | None = None
) -> Attention:
    """The kernel's contract in torch: q and k of each stream normed and rotated in fp32, the streams joined along
    the sequence in order; with ``slot`` [bc, seq], key j of a row moved (in k and v) to place ``slot[row, j]``.
    For tests, and the CPU."""
    parts: list[Attention] = []
    for qkv, q_weight, k_weight, cos, sin in streams:
        q, k, v = (part.unflatten(-1, (heads, -1)) for part in qkv.chunk(3, dim=-1))
        q, k = (_norm_rope(x.float(), w, cos, sin, eps).to(qkv.dtype) for x, w in ((q, q_weight), (k, k_weight)))
        parts.append((q, k, v))
    q, k, v = (torch.cat(column, dim=1) for column in zip(*parts))
    if slot is not None:
        place = slot.long()[:, :, None, None].expand_as(k)
        k, v = (torch.empty_like(t).scatter_(1, place, t) for t in (k, v))
    return q, k, v.contiguous()


def _norm_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:  # x [bc, m, h, dh] fp32
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    pairs = normed.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return normed * cos + rotated * sin


if triton is not None:

    @triton.jit
    def _normed_rotated(ptrs, mask, weight_ptr, cos, sin, eps, BLOCK: tl.constexpr, DH: tl.constexpr):
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK, DH]
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / DH + eps)
        weight = tl.load(weight_ptr + tl.arange(0, DH)).to(tl.float32)
        normed = x * inv_rms[:, None] * weight[None, :]
        a, b = tl.split(tl.reshape(normed, (BLOCK, DH // 2, 2)))  # each [BLOCK, DH / 2]
        rotated = tl.reshape(tl.join(-b, a), (BLOCK, DH))
        return normed * cos + rotated * sin

    @triton.jit
    def _attention_inputs_kernel(
        qkv_ptr, q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, slot_ptr,
        rows, m, seq, offset, eps,
        HEADS: tl.constexpr, DH: tl.constexpr, BLOCK: tl.constexpr, REORDER: tl.constexpr,
    ):
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (position, head) rows of this stream, position-major
        mask = (r < rows)[:, None]
        position = (r // HEADS).to(tl.int64)  # over the stream's bc * m positions
        head = (r % HEADS)[:, None] * DH
        d = tl.arange(0, DH)[None, :]
        src = qkv_ptr + position[:, None] * (3 * HEADS * DH) + head + d
        table = position[:, None] * DH + d  # cos and sin are [bc * m, dh]
        cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
        row_start = (position // m) * seq
        place = offset + position % m  # in the joint sequence
        q_dst = (row_start + place)[:, None] * (HEADS * DH) + head + d
        if REORDER:  # the key's place in its row's visible-first order
            place = tl.load(slot_ptr + row_start + place, mask=r < rows, other=0).to(tl.int64)
        kv_dst = (row_start + place)[:, None] * (HEADS * DH) + head + d
        q = _normed_rotated(src, mask, q_weight_ptr, cos, sin, eps, BLOCK, DH)
        tl.store(q_ptr + q_dst, q.to(q_ptr.dtype.element_ty), mask=mask)
        k = _normed_rotated(src + HEADS * DH, mask, k_weight_ptr, cos, sin, eps, BLOCK, DH)
        tl.store(k_ptr + kv_dst, k.to(k_ptr.dtype.element_ty), mask=mask)
        v = tl.load(src + 2 * HEADS * DH, mask=mask, other=0.0)
        tl.store(v_ptr + kv_dst, v, mask=mask)

    @torch.library.triton_op("auk::attention_inputs", mutates_args=())
    def _attention_inputs(
        qkv: list[Tensor], q_weight: list[Tensor], k_weight: list[Tensor], cos: list[Tensor], sin: list[Tensor],
        heads: int, eps: float, slot: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        bc, _, width = qkv[0].shape
        dim_head = width // (3 * heads)
        seq = sum(part.shape[1] for part in qkv)
        q, k, v = (qkv[0].new_empty(bc, seq, heads, dim_head) for _ in range(3))
        offset = 0
        for i, part in enumerate(qkv):
            m = part.shape[1]
            rows = bc * m * heads
            torch.library.wrap_triton(_attention_inputs_kernel)[(triton.cdiv(rows, BLOCK),)](
                part, q, k, v, q_weight[i], k_weight[i], cos[i], sin[i], slot, rows, m, seq, offset, eps,
                HEADS=heads, DH=dim_head, BLOCK=BLOCK, REORDER=slot is not None,
            )
            offset += m
        return q, k, v


def attention_inputs(streams: Sequence[Stream], heads: int, eps: float, slot: Tensor | None = None) -> Attention:
    """q, k, v [bc, seq, h, dh] of one or more streams, q and k normed and rotated, the streams joined along the
    sequence in order; with ``slot`` [bc, seq] (int32), k and v of key j of a row go to place ``slot[row, j]``.
    cos and sin are a stream's fp32 rotary tables [bc, m, 1, dh]. Runs the kernel (``available``)."""
    if triton is None:
        raise RuntimeError("the attention-inputs kernel needs Triton")
    qkv, q_weight, k_weight, cos, sin = (list(column) for column in zip(*streams))
    return _attention_inputs(
        [t.contiguous() for t in qkv], q_weight, k_weight, [t.contiguous() for t in cos],
        [t.contiguous() for t in sin], heads, eps, None if slot is None else slot.contiguous(),
    )
