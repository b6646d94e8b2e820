"""The DiT's convolutional position embedding as one Triton kernel per convolution, Mish and the row mask fused.

``ConvPositionEmbedding`` runs two grouped convolutions over the embedded latents (31 taps, 16 groups, 'same'
padding), each followed by Mish, with the padded positions zeroed around them; the target's embedding runs at every
ODE step. cuDNN runs grouped convolutions group by group, far from their arithmetic cost, so on the GPU the torch
form (``layers._grouped_conv_as_bmm``) builds an im2col copy, 31 times the input (57 MB for a 12 s target in bf16),
and multiplies it in one batched product: eight element-wise kernels and two batched products. Here one program
computes ``BLOCK_T`` positions of one group's output channels as a sum of matrix products, one per tap and block of
``CI_BLOCK`` input channels, reading the input straight from its [b, m, d] layout (the embedding linear's output: no
transposes, no im2col):

    y[t, o] = mish(bias[o] + sum_j sum_i w[o, i, j] * x[t + j - taps // 2, i])   (zero where ``keep`` is False)

with x read as zero outside the sequence and at the positions ``keep`` drops, then ``+ residual[t, o]`` where one
is given (``AudioEmbedding``'s ``conv_pos_embed(h) + h``). The weights are packed once, tap-major and with each
group's output channels padded to a power of two (``pack``).

Arithmetic: the products in the inputs' dtype (bf16 on the fast path) with fp32 sums, the bias, Mish and the
residual in fp32, one rounding per output. The torch form rounds after the convolution, after Mish and after
the residual add.

Shapes: b rows, m positions, d = groups * ci channels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: callers check ``available``
    triton = None

BLOCK_T = 64  # positions per program
WARPS = 4
MISH_LINEAR_FROM = 20.0  # past this Mish is the identity in fp32 (torch's softplus threshold)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Where the kernel runs: a CUDA device with Triton, half precision (fp32 keeps the torch form)."""
    return triton is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def _blocks(ci: int) -> tuple[int, int]:
    """(CI_BLOCK, CO_BLOCK) for ``ci`` channels a group: input channels in blocks of up to 32, output channels
    padded to a power of two; both at least 16, a matrix product's least."""
    co_block = max(16, 1 << (ci - 1).bit_length())
    return min(32, co_block), co_block


def pack(conv: nn.Conv1d) -> Tensor:
    """``conv``'s weight [d, ci, taps] as the kernel reads it: [taps, groups, ci, CO_BLOCK], zero past ci outputs."""
    d, ci, taps = conv.weight.shape
    groups = conv.groups
    _, co_block = _blocks(ci)
    packed = conv.weight.new_zeros(taps, groups, ci, co_block)
    # weight[g * ci + o, i, j] -> packed[j, g, i, o]
    packed[..., :ci] = conv.weight.reshape(groups, ci, ci, taps).permute(3, 0, 2, 1)
    return packed


def unpack(packed: Tensor) -> Tensor:
    """``pack``'s inverse: the conv weight [d, ci, taps]."""
    taps, groups, ci, _ = packed.shape
    return packed[..., :ci].permute(1, 3, 2, 0).reshape(groups * ci, ci, taps)


def position_conv_reference(
    x: Tensor, packed: Tensor, bias: Tensor, keep: Tensor | None = None, residual: Tensor | None = None
) -> Tensor:
    """The kernel's contract in torch, in fp32 with one rounding to x's dtype: x [b, m, d] -> [b, m, d]."""
    weight = unpack(packed).float()
    keep_rows = None if keep is None else keep[:, :, None]
    h = x.float() if keep_rows is None else x.float().masked_fill(~keep_rows, 0.0)
    y = nn.functional.conv1d(h.transpose(1, 2), weight, bias.float(), padding=weight.shape[-1] // 2,
                             groups=packed.shape[1]).transpose(1, 2)  # fmt: skip
    y = nn.functional.mish(y)
    if keep_rows is not None:
        y = y.masked_fill(~keep_rows, 0.0)
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _position_conv_kernel(
        x_ptr, w_ptr, bias_ptr, keep_ptr, residual_ptr, out_ptr, m, x_row_stride, x_position_stride,
        GROUPS: tl.constexpr, CI: tl.constexpr, TAPS: tl.constexpr, CI_BLOCK: tl.constexpr, CO_BLOCK: tl.constexpr,
        BLOCK_T: tl.constexpr, KEEP: tl.constexpr, RESIDUAL: tl.constexpr, LINEAR_FROM: tl.constexpr,
    ):
        block, group, row = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        ts = block * BLOCK_T + tl.arange(0, BLOCK_T)  # output positions
        outs = tl.arange(0, CO_BLOCK)  # the group's output channels (padded)
        x_row = x_ptr + row * x_row_stride + group * CI
        acc = tl.zeros((BLOCK_T, CO_BLOCK), dtype=tl.float32)
        for j in range(TAPS):
            sources = ts + (j - TAPS // 2)
            present = (sources >= 0) & (sources < m)
            if KEEP:
                present &= tl.load(keep_ptr + row * m + sources, mask=present, other=0) != 0
            for first in tl.static_range(0, CI, CI_BLOCK):
                ins = first + tl.arange(0, CI_BLOCK)
                x = tl.load(x_row + sources[:, None] * x_position_stride + ins[None, :],
                            mask=present[:, None] & (ins < CI)[None, :], other=0.0)  # fmt: skip
                # packed [taps, groups, ci, CO_BLOCK]: this tap's and group's block is contiguous
                w = tl.load(w_ptr + ((j * GROUPS + group) * CI + ins)[:, None] * CO_BLOCK + outs[None, :],
                            mask=(ins < CI)[:, None], other=0.0)  # fmt: skip
                acc = tl.dot(x, w, acc)
        real = outs < CI
        y = acc + tl.load(bias_ptr + group * CI + outs, mask=real, other=0.0).to(tl.float32)[None, :]
        # Mish: y * tanh(softplus(y)) = y * n (n + 2) / (n (n + 2) + 2) with n = e^y, exact in the limits.
        n = tl.exp(tl.minimum(y, LINEAR_FROM))
        n = n * (n + 2.0)
        y = y * (n / (n + 2.0))
        inside = ts < m
        if KEEP:
            y = tl.where((tl.load(keep_ptr + row * m + ts, mask=inside, other=0) != 0)[:, None], y, 0.0)
        at = (row * m + ts)[:, None] * (GROUPS * CI) + group * CI + outs[None, :]  # out, residual: [b, m, d]
        stored = inside[:, None] & real[None, :]
        if RESIDUAL:
            y += tl.load(residual_ptr + at, mask=stored, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=stored)

    @torch.library.triton_op("auk::position_conv", mutates_args=())
    def _position_conv(
        x: Tensor, packed: Tensor, bias: Tensor, keep: Tensor | None, residual: Tensor | None
    ) -> Tensor:
        b, m, d = x.shape
        taps, groups, ci, _ = packed.shape
        ci_block, co_block = _blocks(ci)
        out = x.new_empty(b, m, d)
        torch.library.wrap_triton(_position_conv_kernel)[(triton.cdiv(m, BLOCK_T), groups, b)](
            x, packed, bias, keep, residual, out, m, x.stride(0), x.stride(1),
            GROUPS=groups, CI=ci, TAPS=taps, CI_BLOCK=ci_block, CO_BLOCK=co_block, BLOCK_T=BLOCK_T,
            KEEP=keep is not None, RESIDUAL=residual is not None, LINEAR_FROM=MISH_LINEAR_FROM, num_warps=WARPS,
        )
        return out


def position_conv(
    x: Tensor, packed: Tensor, bias: Tensor, keep: Tensor | None = None, residual: Tensor | None = None
) -> Tensor:
    """``mish(conv(x))`` with the rows ``keep`` [b, m] drops zeroed in and out, plus ``residual`` (None: none),
    for x [b, m, d] (any strides with unit channel stride) and a 'same'-padded grouped convolution whose weight
    ``pack`` made. Returns a new contiguous [b, m, d] in x's dtype. Runs the kernel (``available``)."""
    if triton is None:
        raise RuntimeError("the position convolution kernel needs Triton")
    taps, groups, ci, _ = packed.shape
    if x.dim() != 3 or x.shape[-1] != groups * ci or taps % 2 == 0:
        raise ValueError(f"x must be [b, m, {groups * ci}] for an odd tap count, got {tuple(x.shape)}, {taps} taps")
    if x.stride(-1) != 1:
        x = x.contiguous()
    keep = None if keep is None else keep.contiguous()
    residual = None if residual is None else residual.contiguous()
    return _position_conv(x, packed, bias, keep, residual)
