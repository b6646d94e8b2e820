"""The whole anti-aliased activation as one Triton kernel: 2x upsample, SnakeBeta and decimation per output sample.

``polyphase_activation`` in ``alias_free.py`` states the computation; compiled by inductor it is three kernels
that write and re-read the 2x-rate signal, at about a sixth of the H200's memory bandwidth (15.5 ms of a 27 ms,
300-frame decode). Here each program computes a block of outputs of one channel row straight from the input:

    y[i] = sum_k down[k] * s(clamp(2i - left + k, 0, 2t - 1))           k = 0 ... 11, left = the decimator's pad
    s(m) = u + sin^2(alpha * u) / (beta + eps),  u = up(m)               the snake at oversampled sample m
    up(2j + p) = 2 * sum_r up_taps[2r + 1 - p] * x[clamp(j + 2 + p - r, 0, t - 1)]     r = 0 ... 5 (phase p)

The clamps are the two replicate paddings. Inside the signal, the oversampled sample a tap reads has a phase and
offset fixed by the tap alone, so the twelve ``s`` values are twelve shifted vectors computed from shifted loads of
``x``; where the decimator's window runs off an end, the clamp gives the first or last oversampled sample, two
scalars per row. Each oversampled sample is recomputed by the six outputs that read it: about 12 sines per
output, against 2 in the three-kernel form, for one read of ``x`` and one write of ``y``.

Same taps, same order of the upsampler's sums; the decimator's sum runs in tap order. fp32 arithmetic whatever
the input's dtype, with libdevice's sine on the GPU. Triton also runs it on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch

from auk_worker.model.alias_free import RATIO, SNAKE_EPS, TAPS, compile_fused_activations, use_fused_activations

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: callers check ``available``
    triton = None

BLOCK = 256  # outputs per program


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
    def _clamped(ptr, index, last):
        return tl.load(ptr + tl.minimum(tl.maximum(index, 0), last)).to(tl.float32)

    @triton.jit
    def _alias_free_kernel(
        x_ptr, y_ptr, alpha_ptr, beta_ptr, up_ptr, down_ptr, t, channels,
        LEFT: tl.constexpr, LOGSCALE: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(1)  # b * channels + c
        channel = row % channels
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # output samples
        x_row = x_ptr + row.to(tl.int64) * t
        alpha = tl.load(alpha_ptr + channel).to(tl.float32)
        beta = tl.load(beta_ptr + channel).to(tl.float32)
        if LOGSCALE:
            alpha = tl.exp(alpha)
            beta = tl.exp(beta)
        inv_beta = 1.0 / (beta + EPS)
        last = t - 1
        # The oversampled signal's first sample (phase 0, j = 0) and last (phase 1, j = t - 1): what the
        # decimator's replicate padding repeats past the ends.
        u_first = 0.0
        u_last = 0.0
        for r in tl.static_range(6):
            u_first += tl.load(up_ptr + 2 * r + 1).to(tl.float32) * _clamped(x_row, 2 - r, last)
            u_last += tl.load(up_ptr + 2 * r).to(tl.float32) * _clamped(x_row, last + 3 - r, last)
        s_first = _snake(2.0 * u_first, alpha, inv_beta)
        s_last = _snake(2.0 * u_last, alpha, inv_beta)

        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(12):
            # Tap k reads oversampled sample m = 2i + k - LEFT = 2(i + d) + p, with phase p = (k + LEFT) % 2
            # and d = (k + 12 - LEFT) // 2 - 6 (LEFT is odd), both fixed at compile time.
            u = tl.zeros((BLOCK,), dtype=tl.float32)
            for r in tl.static_range(6):
                tap = tl.load(up_ptr + 2 * r + 1 - (k + LEFT) % 2).to(tl.float32)
                shift = (k + 12 - LEFT) // 2 - 6 + 2 + (k + LEFT) % 2 - r
                u += tap * _clamped(x_row, i + shift, last)
            s = _snake(2.0 * u, alpha, inv_beta)
            m = 2 * i + (k - LEFT)
            s = tl.where(m < 0, s_first, tl.where(m > 2 * last + 1, s_last, s))
            acc += tl.load(down_ptr + k).to(tl.float32) * s
        tl.store(y_ptr + row.to(tl.int64) * t + i, acc.to(y_ptr.dtype.element_ty), mask=i < t)


def fused_activation(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    up_taps: torch.Tensor,
    down_taps: torch.Tensor,
    logscale: bool,
    down_pad: tuple[int, int],
) -> torch.Tensor:  # [b, c, t] -> [b, c, t]
    """``alias_free.polyphase_activation`` as one kernel launch (same signature, a ``PolyphaseFn``)."""
    if triton is None:
        raise RuntimeError("the fused alias-free kernel needs Triton")
    if RATIO != 2 or TAPS != 12 or sum(down_pad) != TAPS - 1:
        raise ValueError(f"the kernel is written for 2x, 12 taps and a full decimator pad, got pad {down_pad}")
    x = x.contiguous()
    b, c, t = x.shape
    y = torch.empty_like(x)
    if y.numel() == 0:
        return y
    grid = (triton.cdiv(t, BLOCK), b * c)
    _alias_free_kernel[grid](
        x, y, alpha.contiguous(), beta.contiguous(), up_taps.reshape(-1).contiguous(),
        down_taps.reshape(-1).contiguous(), t, c,
        LEFT=down_pad[0], LOGSCALE=bool(logscale), EPS=SNAKE_EPS, BLOCK=BLOCK,
    )
    return y


def use_fast_activations(model: torch.nn.Module, device: torch.device) -> str:
    """Switch ``model``'s anti-aliased activations to their fastest form on ``device``: this kernel on a CUDA
    device with Triton, else one ``torch.compile`` of the polyphase form. Returns which, for the log."""
    if available(device):
        use_fused_activations(model, True, fused_activation)
        return "triton kernel"
    compile_fused_activations(model)
    return "compiled polyphase"
