"""One Triton kernel from a block's qkv projection to attention-ready q, k and v, the key mask included.

What it computes per token and head is what ``Attention._project`` states: per-head RMSNorm of q and k (fp32
arithmetic, weight applied in fp32, one rounding to the activations' dtype), then the interleaved-pair rotary
rotation in fp32 (one more rounding); v is copied. Inductor generates the same work as a kernel that reaches
about a quarter of the H200's memory bandwidth, followed by the concatenation of the two streams of a double
block and the key gather of the masked path; here one pass writes each stream straight to its place in the
joint sequence.

The key mask travels as one more head channel (``FLAG_CHANNELS`` wide, so the head stays a multiple of 8 wide):
1 on every query, 0 on a visible key and ``HIDDEN_KEY`` on a hidden one, 0 in v. A hidden key's score drops by
``HIDDEN_KEY * scale`` (-3750 at dh 64), its softmax weight underflows to exactly 0, and a visible key's score is
unchanged (it adds 1 * 0); so an attention kernel without a mask, cuDNN's, computes the masked attention exactly.

Triton also runs it on the CPU under ``TRITON_INTERPRET=1``, which is how the CPU tests check it.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: callers check ``available``
    triton = None

FLAG_CHANNELS = 8  # the mask's extra head channels (the first carries the flag)
HIDDEN_KEY = -30000.0  # a hidden key's flag; exact in bf16 and fp16
BLOCK_TOKENS = 16  # tokens per program; a program handles one head of them


def available(device: torch.device) -> bool:
    """True where the kernel can run: a CUDA device with Triton installed."""
    return triton is not None and device.type == "cuda"


def supported_head(dim_head: int) -> bool:
    """The kernel loads a head as one power-of-two block."""
    return dim_head >= 2 and dim_head & (dim_head - 1) == 0


if triton is not None:

    @triton.jit
    def _norm_rope(base, d, partner, sign, mask, weight_ptr, eps, cos, sin, DH: tl.constexpr):
        """RMSNorm (fp32, weighted, rounded to the output dtype) then the rotary rotation of one head's rows."""
        x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)  # [T, DH]
        x_partner = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / DH + eps)  # [T]
        w = tl.load(weight_ptr + d).to(tl.float32)
        w_partner = tl.load(weight_ptr + partner).to(tl.float32)
        out_type = base.dtype.element_ty
        normed = (x * inv_rms[:, None] * w[None, :]).to(out_type).to(tl.float32)
        normed_partner = (x_partner * inv_rms[:, None] * w_partner[None, :]).to(out_type).to(tl.float32)
        return normed * cos + (sign[None, :] * normed_partner) * sin

    @triton.jit
    def _attention_inputs_kernel(
        qkv_ptr,  # [rows, m, 3 * heads * DH] (last dim contiguous)
        q_weight_ptr,  # [DH]
        k_weight_ptr,
        cos_ptr,  # [rows, m, DH] fp32, contiguous
        sin_ptr,
        flag_ptr,  # [rows, seq] key flags (read when FLAGGED)
        out_ptr,  # [3, rows, seq, heads, WIDTH]
        tokens,  # rows * m
        m,  # this stream's positions per row
        seq,  # positions per row in the output
        offset,  # where this stream starts in the output sequence
        qkv_row_stride,
        qkv_token_stride,
        out_part_stride,  # rows * seq * heads * WIDTH
        eps,
        HEADS: tl.constexpr,
        DH: tl.constexpr,
        WIDTH: tl.constexpr,  # DH, or DH + FLAG_CHANNELS when FLAGGED
        FLAGGED: tl.constexpr,
        EXTRA: tl.constexpr,  # FLAG_CHANNELS
        BLOCK_T: tl.constexpr,
    ):
        head = tl.program_id(1)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [T] token of this stream, row-major
        live = t < tokens
        row, pos = t // m, t % m
        d = tl.arange(0, DH)
        partner = d ^ 1  # the other element of d's rotary pair
        sign = tl.where(d % 2 == 0, -1.0, 1.0)  # (a, b) -> (a cos - b sin, b cos + a sin)
        mask = live[:, None]

        src = qkv_ptr + row[:, None] * qkv_row_stride + pos[:, None] * qkv_token_stride + head * DH  # [T, 1]
        table = (t[:, None] * DH) + d[None, :]  # cos/sin are [rows, m, DH], contiguous
        cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
        dst_token = row * seq + offset + pos  # [T]
        dst = out_ptr + (dst_token[:, None] * HEADS + head) * WIDTH  # [T, 1]
        out_type = out_ptr.dtype.element_ty

        q = _norm_rope(src, d, partner, sign, mask, q_weight_ptr, eps, cos, sin, DH)
        k = _norm_rope(src + HEADS * DH, d, partner, sign, mask, k_weight_ptr, eps, cos, sin, DH)
        v = tl.load(src + 2 * HEADS * DH + d[None, :], mask=mask, other=0.0)
        tl.store(dst + d[None, :], q.to(out_type), mask=mask)
        tl.store(dst + out_part_stride + d[None, :], k.to(out_type), mask=mask)
        tl.store(dst + 2 * out_part_stride + d[None, :], v.to(out_type), mask=mask)
        if FLAGGED:
            e = tl.arange(0, EXTRA)
            first = (e == 0)[None, :]
            flag = tl.load(flag_ptr + dst_token, mask=live, other=0.0).to(tl.float32)  # [T]
            zero = tl.zeros([BLOCK_T, EXTRA], dtype=tl.float32)
            extra = dst + DH + e[None, :]
            tl.store(extra, tl.where(first, 1.0, zero).to(out_type), mask=mask)
            tl.store(extra + out_part_stride, tl.where(first, flag[:, None] + zero, zero).to(out_type), mask=mask)
            tl.store(extra + 2 * out_part_stride, zero.to(out_type), mask=mask)


def write_stream(
    out: Tensor,
    offset: int,
    qkv: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    key_flag: Tensor | None,
) -> None:
    """Write one stream's q, k, v (from ``qkv`` [rows, m, 3 * heads * dh]) into ``out`` [3, rows, seq, heads,
    width] at sequence positions ``offset ... offset + m - 1``; ``cos``/``sin`` [rows, m, 1, dh] fp32. With
    ``key_flag`` [rows, seq] the flag channels are written too (width = dh + FLAG_CHANNELS)."""
    _, rows, seq, heads, width = out.shape
    m, dh = qkv.shape[1], q_weight.shape[0]
    flagged = key_flag is not None
    if width != dh + (FLAG_CHANNELS if flagged else 0) or qkv.stride(-1) != 1 or not out.is_contiguous():
        raise ValueError(f"attention inputs: width {width} for dh {dh}, flagged={flagged}, or a strided tensor")
    cos, sin = (table.reshape(rows * m, dh).contiguous() for table in (cos, sin))
    flags = key_flag.contiguous() if flagged else cos  # any pointer when not read
    grid = (triton.cdiv(rows * m, BLOCK_TOKENS), heads)
    _attention_inputs_kernel[grid](
        qkv, q_weight, k_weight, cos, sin, flags, out,
        rows * m, m, seq, offset, qkv.stride(0), qkv.stride(1), out.stride(0), eps,
        HEADS=heads, DH=dh, WIDTH=width, FLAGGED=flagged, EXTRA=FLAG_CHANNELS, BLOCK_T=BLOCK_TOKENS,
    )
