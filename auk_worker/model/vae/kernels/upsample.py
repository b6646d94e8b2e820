"""The VAE decoder's causal upsamplers as one matrix product and one Triton overlap-add kernel.

A causal upsampler is a transposed convolution with stride s, kernel 2s and the last s outputs dropped. Output
sample q * s + r (r < s) then reads exactly two taps: tap r of input q and tap r + s of input q - 1:

    y[o, q*s + r] = bias[o] + sum_i w[i, o, r] * x[i, q] + sum_i w[i, o, r + s] * x[i, q - 1]

So one product ``taps = w' @ x`` with w' the weight [in, out, 2s] read as [out * 2s, in] gives every tap of every
input, [out, 2s, n], and a kernel adds the two that meet at each output and the bias (``_overlap_add_kernel``).
cuDNN runs the widest of these (1,536 to 768 channels, stride 5) with its legacy transposed-conv engine, several
times slower than the product and the add (bench/RESULTS.md).
The product follows cuDNN's TF32 setting, as the convolution it replaces did.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: callers check ``available``
    triton = None

BLOCK_Q = 256  # input positions per program


def available(device: torch.device) -> bool:
    """True where the kernel can run: a CUDA device with Triton installed."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _overlap_add_kernel(taps_ptr, bias_ptr, y_ptr, n, stride, outs, BLOCK_Q: tl.constexpr, PHASES: tl.constexpr):
        o = tl.program_id(1)  # output channel
        row = tl.program_id(2).to(tl.int64) * outs + o  # of the [b * out] rows
        qs = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # input positions
        rs = tl.arange(0, PHASES)  # output phases, PHASES >= stride
        mask = (qs[:, None] < n) & (rs[None, :] < stride)
        taps = taps_ptr + row * (2 * stride) * n  # this row's [2s, n] taps
        now = tl.load(taps + rs[None, :] * n + qs[:, None], mask=mask, other=0.0)
        before = tl.load(taps + (rs[None, :] + stride) * n + qs[:, None] - 1, mask=mask & (qs[:, None] > 0), other=0.0)
        out = now + before + tl.load(bias_ptr + o)
        tl.store(y_ptr + row * n * stride + qs[:, None] * stride + rs[None, :], out, mask=mask)


@contextmanager
def _matmul_tf32_as_cudnn() -> Iterator[None]:
    """Matrix products in TF32 exactly when cuDNN's convolutions are (torch's defaults differ: on and off)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def causal_upsample(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: int) -> torch.Tensor:
    """``conv_transpose1d(x, weight, bias, stride)`` without its last ``stride`` samples, for ``weight`` [in, out,
    2 * stride]: [b, in, n] -> [b, out, n * stride]. fp32 only."""
    if triton is None:
        raise RuntimeError("the causal upsampler kernel needs Triton")
    cin, cout, kernel = weight.shape
    b, channels, n = x.shape
    if kernel != 2 * stride or channels != cin or x.dtype != torch.float32:
        raise ValueError(f"causal_upsample takes fp32 [b, {cin}, n] input and a kernel of 2 * stride, got "
                         f"{x.dtype} {tuple(x.shape)} and kernel {kernel}, stride {stride}")
    with _matmul_tf32_as_cudnn():
        taps = torch.matmul(weight.reshape(cin, cout * kernel).T, x)  # [b, out * 2s, n]
    y = x.new_empty((b, cout, n * stride))
    if y.numel():
        grid = (triton.cdiv(n, BLOCK_Q), cout, b)
        phases = triton.next_power_of_2(stride)
        _overlap_add_kernel[grid](taps, bias, y, n, stride, cout, BLOCK_Q=BLOCK_Q, PHASES=phases)
    return y
