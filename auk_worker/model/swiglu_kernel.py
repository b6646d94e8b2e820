"""The DiT feed-forward's SwiGLU, ``silu(gate) * up`` over ``linear_in``'s output, as one Triton kernel.

``FeedForward.linear_in`` writes the gate and up halves side by side, [.., 2i]. In the compiled blocks inductor
generates this element-wise step too, but one kernel serves every length a phase meets (dynamic shapes), and in a
replayed 12 s zero-shot step it took 13.9 µs a call on average, about twice what its bytes need at the memory's
bandwidth (README, Speed on an H200). A program here takes ``BLOCK`` outputs of one position: both loads and the
store are contiguous, and nothing depends on the number of positions but the grid.

Arithmetic as inductor's: fp32 from the loads on, one rounding to the output dtype.

Shapes: p positions (every row of every context row, flattened), i the SwiGLU width.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: callers check ``available``
    triton = None

BLOCK = 1024  # outputs a program: 8 a thread over 4 warps, 16-byte accesses in bf16
WARPS = 4


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Where the kernel runs: a CUDA device with Triton, half precision (fp32 keeps torch's own kernels)."""
    return triton is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def swiglu_reference(y: Tensor) -> Tensor:
    """The kernel's contract in torch: ``silu(gate) * up`` of y's halves [.., 2i] -> [.., i], in fp32 with one
    rounding to y's dtype."""
    gate, up = y.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(y.dtype)


if triton is not None:

    @triton.jit
    def _swiglu_kernel(y_ptr, out_ptr, INNER: tl.constexpr, BLOCK: tl.constexpr):
        position = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = i < INNER
        row = y_ptr + position * (2 * INNER)
        gate = tl.load(row + i, mask=valid, other=0.0).to(tl.float32)
        up = tl.load(row + INNER + i, mask=valid, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + position * INNER + i, out.to(out_ptr.dtype.element_ty), mask=valid)

    @torch.library.triton_op("auk::swiglu", mutates_args=())
    def _swiglu(y: Tensor) -> Tensor:
        inner = y.shape[-1] // 2
        out = y.new_empty((*y.shape[:-1], inner))
        positions = out.numel() // inner
        if positions:
            grid = (positions, triton.cdiv(inner, BLOCK))  # positions on the first axis: no 65,535 limit there
            torch.library.wrap_triton(_swiglu_kernel)[grid](y, out, INNER=inner, BLOCK=BLOCK, num_warps=WARPS)
        return out


def swiglu(y: Tensor) -> Tensor:
    """``silu(gate) * up`` for y [.., 2i] (gate first, as ``linear_in`` writes it): a new contiguous [.., i].
    Runs the kernel (``available``)."""
    if triton is None:
        raise RuntimeError("the SwiGLU kernel needs Triton")
    if y.shape[-1] % 2 or y.shape[-1] == 0:
        raise ValueError(f"swiglu takes gate and up halves of one width, got a last dimension of {y.shape[-1]}")
    return _swiglu(y.contiguous())
