"""The VAE decoder's narrow causal convolutions as one Triton kernel each, with the bias and the residual add fused.

Past the third upsampler the decoder's signals are long and narrow (96, 48 and 24 channels over 72k to 288k
samples for a 12 s clip), and cuDNN runs those convolutions far from the memory bandwidth they need, with the
residual add a kernel of its own. Here one program computes a tile of ``COUT_BLOCK`` output channels by
``BLOCK_T`` samples (``_tile``) as a sum of ``kernel`` matrix products, one per tap:

    y[o, t] = bias[o] + sum_j sum_i w[o, i, j] * x[i, t + j * dilation]  (+ residual[o, t])

where ``x`` already starts with the conv's ``dilation * (kernel - 1)`` zeros (the activation kernel writes them, see
``triton_activation``), so every read is in bounds and no output needs a mask on the time axis but the last. The
products run on the tensor cores in TF32, as cuDNN runs these fp32 convolutions under torch's defaults; both differ
from true fp32 by TF32's rounding (tests/test_gpu.py), so the exact precision keeps cuDNN with TF32 off. Triton also
runs it on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: callers check ``available``
    triton = None

MAX_WIDTH = 96  # the widest convolution handed to the kernel; cuDNN does well on the wider ones


def available(device: torch.device) -> bool:
    """True where the kernel can run: a CUDA device with Triton installed."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _causal_conv_kernel(
        x_ptr, w_ptr, bias_ptr, residual_ptr, y_ptr, t, channels, kernel, dilation, residual_batch_stride,
        residual_channel_stride,
        HAS_RESIDUAL: tl.constexpr, CIN_BLOCK: tl.constexpr, COUT_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        batch = tl.program_id(2).to(tl.int64)
        outs = tl.program_id(1) * COUT_BLOCK + tl.arange(0, COUT_BLOCK)  # output channels
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # output samples
        reach = dilation * (kernel - 1)
        x_batch = x_ptr + batch * channels * (reach + t)  # [channels, reach + t] rows
        acc = tl.zeros((COUT_BLOCK, BLOCK_T), dtype=tl.float32)
        for first_in in range(0, channels, CIN_BLOCK):
            ins = first_in + tl.arange(0, CIN_BLOCK)
            w_mask = (outs[:, None] < channels) & (ins[None, :] < channels)
            x_mask = (ins[:, None] < channels) & (ts[None, :] < t)
            for j in range(kernel):
                # w is stored [kernel, out, in]: tap j's [COUT_BLOCK, CIN_BLOCK] block is contiguous along ``in``.
                w = tl.load(w_ptr + (j * channels + outs[:, None]) * channels + ins[None, :], mask=w_mask, other=0.0)
                x = tl.load(x_batch + ins[:, None] * (reach + t) + (ts[None, :] + j * dilation), mask=x_mask, other=0.0)
                acc = tl.dot(w, x, acc, input_precision=PRECISION)
        acc += tl.load(bias_ptr + outs, mask=outs < channels, other=0.0)[:, None]
        y_mask = (outs[:, None] < channels) & (ts[None, :] < t)
        if HAS_RESIDUAL:
            r = residual_ptr + batch * residual_batch_stride + outs[:, None].to(tl.int64) * residual_channel_stride
            acc += tl.load(r + ts[None, :], mask=y_mask, other=0.0)
        tl.store(y_ptr + (batch * channels + outs[:, None]) * t + ts[None, :], acc, mask=y_mask)


def _tile(channels: int) -> tuple[int, int, int, int]:
    """(CIN_BLOCK, COUT_BLOCK, BLOCK_T, num_warps) for a width: all output channels in one program (tl.dot needs
    16 or more), input channels 16 at a time below 96. Chosen by timing the release widths (24, 48 and 96 channels
    at kernel 3 and 11) on an H200."""
    cout = max(16, triton.next_power_of_2(channels))
    if cout <= 32:
        return 16, cout, 64, 4
    return (16 if cout <= 64 else 32), cout, 128, (4 if cout <= 64 else 8)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dilation: int, residual: torch.Tensor | None = None
) -> torch.Tensor:  # [b, c, reach + t] -> [b, c, t]
    """``residual + conv1d(x, weight, bias, dilation=dilation)`` for a square conv over an input that starts with its
    ``reach = dilation * (kernel - 1)`` padding. ``weight`` is [kernel, out, in] (``tap_major``); fp32 only."""
    if triton is None:
        raise RuntimeError("the causal convolution kernel needs Triton")
    kernel, channels, _ = weight.shape
    b, cin, padded = x.shape
    t = padded - dilation * (kernel - 1)
    if cin != channels or t < 0 or x.dtype != torch.float32:
        raise ValueError(f"causal_conv takes fp32 [b, {channels}, reach + t] input, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    y = x.new_empty((b, channels, t))
    if y.numel() == 0:
        return y
    if residual is not None and (residual.shape != y.shape or residual.stride(-1) != 1):
        raise ValueError(f"the residual must be [b, c, t] {tuple(y.shape)} with unit stride in time")
    cin_block, cout_block, block_t, warps = _tile(channels)
    grid = (triton.cdiv(t, block_t), triton.cdiv(channels, cout_block), b)
    _causal_conv_kernel[grid](
        x, weight, bias, y if residual is None else residual, y, t, channels, kernel, dilation,
        0 if residual is None else residual.stride(0), 0 if residual is None else residual.stride(1),
        HAS_RESIDUAL=residual is not None, CIN_BLOCK=cin_block, COUT_BLOCK=cout_block, BLOCK_T=block_t,
        PRECISION="tf32", num_warps=warps,
    )
    return y


def tap_major(weight: torch.Tensor) -> torch.Tensor:
    """A conv weight [out, in, kernel] as the kernel reads it: [kernel, out, in], contiguous."""
    return weight.permute(2, 0, 1).contiguous()
