"""The whole anti-aliased activation as one Triton kernel: 2x upsample, SnakeBeta and decimation per output sample.

``polyphase_activation`` in ``alias_free.py`` states the computation; compiled by inductor it is three kernels
that write and re-read the 2x-rate signal, and most of a decode's time. Here each program computes a block of
outputs of one channel row straight from the input:

    y[i] = sum_k down[k] * s(clamp(2i - left + k, 0, 2t - 1))           k = 0 ... 11, left = the decimator's pad
    s(m) = u + sin^2(alpha * u) / (beta + eps),  u = up(m)               the snake at oversampled sample m
    up(2j + p) = 2 * sum_r up_taps[2r + 1 - p] * x[clamp(j + 2 + p - r, 0, t - 1)]     r = 0 ... 5 (phase p)

The clamps are the two replicate paddings. A block of ``OUT = BLOCK - HALO`` outputs i0 ... i0 + OUT - 1 reads the
oversampled samples of OUT + 5 input positions j (both phases). The program computes the BLOCK positions from its
first once each, from shifted loads of ``x``, parks them in a scratch row of its own (global memory, so it stays in
the L1/L2 caches), and after a barrier reads the twelve shifted windows the decimator's taps need: about two sines
per output. Where the decimator's window runs off an end, the clamp gives the first or last oversampled sample,
two scalars per row. The halo positions are part of the block's tensors, not a tensor of their own: one
narrower than the program's threads would be computed by every thread, and the kernel is bound by instructions.

The clamps and the edge scalars matter only where a block's reads reach past a row's ends: a block whose reads
all fall inside its row (every block but a row's first and last one or two) runs without them, a constexpr copy
of the same code, with the same loads and sums in the same order.

The kernel reads its input through the batch and channel strides, so a slice along time (the causal upsampler's
trimmed output) is not copied first, and it writes the zeros the next causal convolution reads before each row's
outputs (``left_pad``), which saves that convolution a padded copy.

Same taps, same order of the upsampler's sums; the decimator's sum runs in tap order. fp32 arithmetic whatever
the input's dtype, with libdevice's sine on the GPU. Triton also runs it on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch

from auk_worker.model.vae.alias_free import RATIO, SNAKE_EPS, TAPS

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: callers check ``available``
    triton = None

BLOCK = 256  # oversampled input positions per program (per phase), the width of its tensors
HALO = 8  # of which past the block's outputs: its last outputs' decimator windows reach 5 positions further
OUT = BLOCK - HALO  # outputs per program
PAD_BLOCK = 64  # the most zeros written before a row's outputs (the release decoder's widest causal conv: 50)


def available(device: torch.device) -> bool:
    """True where the kernel can run: a CUDA device with Triton installed."""
    return triton is not None and device.type == "cuda"


if triton is not None:
    if os.environ.get("TRITON_INTERPRET") == "1":

        @triton.jit
        def _snake(u, alpha, inv_beta):
            s = tl.sin(u * alpha)  # the interpreter's numpy sine: libdevice has no CPU form
            return u + inv_beta * (s * s)

    else:
        from triton.language.extra import libdevice

        @triton.jit
        def _snake(u, alpha, inv_beta):
            s = libdevice.sin(u * alpha)  # within 1 ulp, with full range reduction
            return u + inv_beta * (s * s)

    @triton.jit
    def _x(ptr, index, last, CLAMP: tl.constexpr):
        if CLAMP:
            index = tl.minimum(tl.maximum(index, 0), last)
        return tl.load(ptr + index).to(tl.float32)

    @triton.jit
    def _oversampled(x_row, j, last, up_ptr, alpha, inv_beta, PHASE: tl.constexpr, CLAMP: tl.constexpr = True):
        """s(2j + PHASE) for a vector of input positions j (clamped into the row; CLAMP False: j - 3 ... j + 3 all
        inside it)."""
        u = tl.zeros(j.shape, dtype=tl.float32)
        for r in tl.static_range(6):
            u += tl.load(up_ptr + 2 * r + 1 - PHASE).to(tl.float32) * _x(x_row, j + 2 + PHASE - r, last, CLAMP)
        return _snake(2.0 * u, alpha, inv_beta)

    @triton.jit
    def _block(
        x_row, y_row, scratch, first, t, y_pad, up_ptr, down_ptr, alpha, inv_beta,
        LEFT: tl.constexpr, LOW: tl.constexpr, BLOCK: tl.constexpr, HALO: tl.constexpr, EDGES: tl.constexpr,
    ):
        """The block of BLOCK - HALO outputs from ``first``; EDGES: its reads may reach past the row's ends (clamps
        and the decimator's edge scalars), else they all fall inside it."""
        body = tl.arange(0, BLOCK)
        i = first + body  # output samples; the last HALO lanes are not the block's
        ours = body < BLOCK - HALO
        last = t - 1
        if EDGES:
            # What the decimator's replicate padding repeats past the ends: the oversampled signal's first sample
            # (phase 0 at j = 0) and last (phase 1 at j = t - 1).
            s_first = tl.sum(_oversampled(x_row, tl.zeros((1,), dtype=tl.int32), last, up_ptr, alpha, inv_beta, 0))
            s_last = tl.sum(_oversampled(x_row, tl.full((1,), 0, tl.int32) + last, last, up_ptr, alpha, inv_beta, 1))

        # Tap k reads oversampled sample m = 2i + k - LEFT = 2(i + d) + p, with phase p = (k + LEFT) % 2 and
        # d = (k + 12 - LEFT) // 2 - 6 (LEFT is odd), so d runs over LOW ... LOW + 5: the block's outputs read
        # input positions j = first + LOW ... first + BLOCK - HALO - 1 + LOW + 5, within its BLOCK scratch slots.
        for p in tl.static_range(2):
            oversampled = _oversampled(x_row, first + LOW + body, last, up_ptr, alpha, inv_beta, p, EDGES)
            tl.store(scratch + p * BLOCK + body, oversampled)
        tl.debug_barrier()  # every thread's slots are written before any thread reads its neighbours'

        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(12):
            p = (k + LEFT) % 2
            d = (k + 12 - LEFT) // 2 - 6
            s = tl.load(scratch + p * BLOCK + (d - LOW) + body, mask=ours)
            if EDGES:
                m = 2 * i + (k - LEFT)
                s = tl.where(m < 0, s_first, tl.where(m > 2 * last + 1, s_last, s))
            acc += tl.load(down_ptr + k).to(tl.float32) * s
        tl.store(y_row + y_pad + i, acc.to(y_row.dtype.element_ty), mask=ours & (i < t))

    @triton.jit
    def _alias_free_kernel(
        x_ptr, y_ptr, scratch_ptr, alpha_ptr, beta_ptr, up_ptr, down_ptr, t, channels, x_batch_stride,
        x_channel_stride, y_pad,
        LEFT: tl.constexpr, LOW: tl.constexpr, LOGSCALE: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr,
        HALO: tl.constexpr, PAD_BLOCK: tl.constexpr, INTERIOR: tl.constexpr,
    ):
        row = tl.program_id(1)  # b * channels + c
        channel = row % channels
        first = tl.program_id(0) * (BLOCK - HALO)  # this block's first output sample
        x_row = x_ptr + (row // channels).to(tl.int64) * x_batch_stride + channel.to(tl.int64) * x_channel_stride
        y_row = y_ptr + row.to(tl.int64) * (y_pad + t)  # y_pad zeros, then the t outputs
        if tl.program_id(0) == 0:
            zeros = tl.arange(0, PAD_BLOCK)
            tl.store(y_row + zeros, tl.zeros((PAD_BLOCK,), dtype=y_ptr.dtype.element_ty), mask=zeros < y_pad)
        alpha = tl.load(alpha_ptr + channel).to(tl.float32)
        beta = tl.load(beta_ptr + channel).to(tl.float32)
        if LOGSCALE:
            alpha = tl.exp(alpha)
            beta = tl.exp(beta)
        inv_beta = 1.0 / (beta + EPS)
        scratch = scratch_ptr + (row.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)) * (2 * BLOCK)
        # Inside the row: the upsampler's reads, x[first + LOW - 3 ... first + LOW + BLOCK + 2], and the
        # decimator's, m = 2 * first - LEFT ... 2 * (first + BLOCK - HALO - 1) + 11 - LEFT.
        inside = (first + LOW - 3 >= 0) & (first + LOW + BLOCK + 2 <= t - 1)
        inside = inside & (2 * first - LEFT >= 0) & (2 * (first + BLOCK - HALO - 1) + 11 - LEFT <= 2 * t - 1)
        if inside & INTERIOR:
            _block(x_row, y_row, scratch, first, t, y_pad, up_ptr, down_ptr, alpha, inv_beta, LEFT, LOW, BLOCK,
                   HALO, False)
        else:
            _block(x_row, y_row, scratch, first, t, y_pad, up_ptr, down_ptr, alpha, inv_beta, LEFT, LOW, BLOCK,
                   HALO, True)


def fused_activation(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    up_taps: torch.Tensor,
    down_taps: torch.Tensor,
    logscale: bool,
    down_pad: tuple[int, int],
    left_pad: int = 0,
    *,
    interior: bool = True,
) -> torch.Tensor:  # [b, c, t] -> [b, c, left_pad + t]
    """``alias_free.polyphase_activation`` as one kernel launch (same signature, a ``PolyphaseFn``).

    ``x`` may be a slice along time (the causal upsampler's trimmed output): rows are read through its strides,
    not copied. The ``left_pad`` zeros are written by the kernel too. ``interior`` False sends every block through
    the edge handling, which blocks inside a row skip (the tests compare the two)."""
    if triton is None:
        raise RuntimeError("the fused alias-free kernel needs Triton")
    if RATIO != 2 or TAPS != 12 or sum(down_pad) != TAPS - 1 or down_pad[0] % 2 == 0:
        raise ValueError(f"the kernel is written for 2x, 12 taps and a full decimator pad, odd on the left; "
                         f"got pad {down_pad}")
    if not 0 <= left_pad <= PAD_BLOCK:
        raise ValueError(f"the kernel writes at most {PAD_BLOCK} padding zeros, not {left_pad}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, c, t = x.shape
    left = down_pad[0]
    y = x.new_empty((b, c, left_pad + t))
    if y.numel() == 0 or t == 0:
        return y.zero_()
    grid = (triton.cdiv(t, OUT), b * c)
    scratch = torch.empty(grid[0] * grid[1] * 2 * BLOCK, device=x.device, dtype=torch.float32)
    _alias_free_kernel[grid](
        x, y, scratch, alpha.contiguous(), beta.contiguous(), up_taps.reshape(-1).contiguous(),
        down_taps.reshape(-1).contiguous(), t, c, x.stride(0), x.stride(1), left_pad,
        LEFT=left, LOW=(12 - left) // 2 - 6, LOGSCALE=bool(logscale), EPS=SNAKE_EPS, BLOCK=BLOCK, HALO=HALO,
        PAD_BLOCK=PAD_BLOCK, INTERIOR=interior,
    )
    return y
