"""The attention's q/k preparation as one Triton kernel: per-head RMSNorm and rotary positions, from the qkv
projection straight into the attention's input layout.

Every DiT attention normalises each head of q and k (RMSNorm over the head width, learned weight) and rotates
interleaved pairs (a, b) -> (a cos - b sin, b cos + a sin) by the rotary tables. Inductor fuses this into one
kernel per block, but that kernel loads each element's rotary partner, and its weight, with predicated scalar
loads; on the H200 it ran at about a quarter of the memory bandwidth (24 µs a call at 1,534 positions). Here a
program takes ``BLOCK`` (position, head) rows of q and of k, loads each row once, swaps the pairs in registers and
writes [bc, seq, h, dh]. The double blocks' two streams (audio, then text) each write their part of the joint
sequence, so no concatenation follows.

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


def available(device: torch.device, dtype: torch.dtype, dim_head: int) -> bool:
    """Where the kernel runs: a CUDA device with Triton, half precision, a power-of-two head width."""
    return (
        triton is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and dim_head >= 2
        and dim_head & (dim_head - 1) == 0
    )


def norm_rope_reference(streams: Sequence[Stream], heads: int, eps: float) -> tuple[Tensor, Tensor]:
    """The kernel's contract in torch: q and k of each stream normed and rotated in fp32, the streams joined along
    the sequence in order. For tests, and the CPU."""
    outputs: list[tuple[Tensor, Tensor]] = []
    for qkv, q_weight, k_weight, cos, sin in streams:
        q, k, _ = (part.unflatten(-1, (heads, -1)).float() for part in qkv.chunk(3, dim=-1))
        outputs.append(tuple(_norm_rope(x, w, cos, sin, eps).to(qkv.dtype) for x, w in ((q, q_weight), (k, k_weight))))
    q, k = zip(*outputs)
    return torch.cat(q, dim=1), torch.cat(k, dim=1)


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
    def _norm_rope_kernel(
        qkv_ptr, q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr,
        rows, m, seq, offset, eps,
        HEADS: tl.constexpr, DH: tl.constexpr, BLOCK: tl.constexpr,
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
        dst = ((position // m) * seq + offset + position % m)[:, None] * (HEADS * DH) + head + d
        q = _normed_rotated(src, mask, q_weight_ptr, cos, sin, eps, BLOCK, DH)
        tl.store(q_ptr + dst, q.to(q_ptr.dtype.element_ty), mask=mask)
        k = _normed_rotated(src + HEADS * DH, mask, k_weight_ptr, cos, sin, eps, BLOCK, DH)
        tl.store(k_ptr + dst, k.to(k_ptr.dtype.element_ty), mask=mask)

    @torch.library.triton_op("auk::qk_norm_rope", mutates_args=())
    def _qk_norm_rope(
        qkv: list[Tensor], q_weight: list[Tensor], k_weight: list[Tensor], cos: list[Tensor], sin: list[Tensor],
        heads: int, eps: float,
    ) -> tuple[Tensor, Tensor]:
        bc, _, width = qkv[0].shape
        dim_head = width // (3 * heads)
        seq = sum(part.shape[1] for part in qkv)
        q = qkv[0].new_empty(bc, seq, heads, dim_head)
        k = qkv[0].new_empty(bc, seq, heads, dim_head)
        offset = 0
        for i, part in enumerate(qkv):
            m = part.shape[1]
            rows = bc * m * heads
            torch.library.wrap_triton(_norm_rope_kernel)[(triton.cdiv(rows, BLOCK),)](
                part, q, k, q_weight[i], k_weight[i], cos[i], sin[i], rows, m, seq, offset, eps,
                HEADS=heads, DH=dim_head, BLOCK=BLOCK,
            )
            offset += m
        return q, k


def norm_rope(streams: Sequence[Stream], heads: int, eps: float) -> tuple[Tensor, Tensor]:
    """q and k [bc, seq, h, dh] of one or more streams, each normed and rotated, joined along the sequence in
    order. cos and sin are a stream's fp32 rotary tables [bc, m, 1, dh]. Runs the kernel (``available``)."""
    if triton is None:
        raise RuntimeError("the q/k kernel needs Triton")
    qkv, q_weight, k_weight, cos, sin = (list(column) for column in zip(*streams))
    return _qk_norm_rope(
        [t.contiguous() for t in qkv], q_weight, k_weight, [t.contiguous() for t in cos],
        [t.contiguous() for t in sin], heads, eps,
    )
