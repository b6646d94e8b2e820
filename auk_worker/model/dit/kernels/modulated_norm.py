"""The DiT's adaptive layer norms as one Triton kernel each, with the gated residual before them.

Every block normalises its stream twice and modulates the result by its time-dependent rows: ``LN(x) * (1 + scale) +
shift`` (layer norm without affine weights). Before the second norm it adds the attention's output through its gate,
``x + gate * y``, with y zeroed at padded positions (``keep``). Inductor fuses each of these into one kernel too,
but a slower one (bench/RESULTS.md). A program takes ``ROWS`` positions, loads each of them once, and writes the
modulated norm (and the new residual stream) once.

Arithmetic: fp32 from the load on, one rounding to the output dtype per output. The residual sum is rounded to the
stream's dtype before it is normalised, as the stored stream is what the torch form normalises.

Shapes: bc rows, m positions, d channels; modulation chunks [r, 1, d] with r = 1 (every row at one time) or bc.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: callers check ``available``
    triton = None

# One position per program with two warps: the fastest launch settings of bench.kernels' norm stage on the H200.
ROWS = 1
WARPS = 2


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Where the kernel runs: a CUDA device with Triton, half precision (fp32 keeps torch's own kernels)."""
    return triton is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def modulated_norm_reference(x: Tensor, shift: Tensor, scale: Tensor, eps: float) -> Tensor:
    """The kernel's contract in torch, in fp32 with one rounding: ``LN(x) * (1 + scale) + shift`` in x's dtype."""
    normed = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (1 + scale.float()) + shift.float()).to(x.dtype)


def gated_residual_norm_reference(
    x: Tensor, y: Tensor, gate: Tensor, keep: Tensor | None, shift: Tensor, scale: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``x + gate * y`` (y zeroed where ``keep`` [bc, m, 1] is False) rounded to x's dtype, and its modulated norm."""
    if keep is not None:
        y = y.masked_fill(~keep, 0.0)
    x = (x.float() + gate.float() * y.float()).to(x.dtype)
    return x, modulated_norm_reference(x, shift, scale, eps)


if triton is not None:

    @triton.jit
    def _modulated_norm_kernel(
        x_ptr, y_ptr, gate_ptr, keep_ptr, shift_ptr, scale_ptr, x_out_ptr, out_ptr,
        positions, m, x_row_stride, x_position_stride, mod_row_stride,
        EPS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, RESIDUAL: tl.constexpr,
        KEEP: tl.constexpr,
    ):
        # EPS is a constant, not an argument: inside a compiled graph inductor passes a float argument as fp64,
        # which would carry the variance into fp64 arithmetic.
        p = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # positions over bc * m
        valid = p < positions
        d = tl.arange(0, BLOCK_D)
        mask = valid[:, None] & (d < D)[None, :]
        p = p.to(tl.int64)
        row = p // m
        x_at = (row * x_row_stride + (p % m) * x_position_stride)[:, None] + d[None, :]
        dense = p[:, None] * D + d[None, :]  # y and the outputs are contiguous [bc * m, d]
        mod = row[:, None] * mod_row_stride + d[None, :]
        x = tl.load(x_ptr + x_at, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:
            y = tl.load(y_ptr + dense, mask=mask, other=0.0).to(tl.float32)
            if KEEP:
                keep = tl.load(keep_ptr + p, mask=valid, other=0)
                y = tl.where(keep[:, None] != 0, y, 0.0)
            gate = tl.load(gate_ptr + mod, mask=mask, other=0.0).to(tl.float32)
            stream = (x + gate * y).to(x_out_ptr.dtype.element_ty)
            tl.store(x_out_ptr + dense, stream, mask=mask)
            x = stream.to(tl.float32)
        mean = tl.sum(x, axis=1) / D
        centered = tl.where(mask, x - mean[:, None], 0.0)
        inv_std = tl.rsqrt(tl.sum(centered * centered, axis=1) / D + EPS)
        shift = tl.load(shift_ptr + mod, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + mod, mask=mask, other=0.0).to(tl.float32)
        out = centered * inv_std[:, None] * (1.0 + scale) + shift
        tl.store(out_ptr + dense, out.to(out_ptr.dtype.element_ty), mask=mask)

    def _launch(
        x: Tensor, y: Tensor | None, gate: Tensor | None, keep: Tensor | None, shift: Tensor, scale: Tensor,
        x_out: Tensor | None, out: Tensor, mod_row_stride: int, eps: float,
    ) -> None:
        bc, m, dim = x.shape
        positions = bc * m
        torch.library.wrap_triton(_modulated_norm_kernel)[(triton.cdiv(positions, ROWS),)](
            x, y, gate, keep, shift, scale, x_out, out, positions, m, x.stride(0), x.stride(1), mod_row_stride,
            EPS=eps, D=dim, BLOCK_D=triton.next_power_of_2(dim), ROWS=ROWS, RESIDUAL=y is not None, KEEP=keep is not None,
            num_warps=WARPS,
        )

    @torch.library.triton_op("auk::modulated_norm", mutates_args=())
    def _modulated_norm(x: Tensor, shift: Tensor, scale: Tensor, mod_row_stride: int, eps: float) -> Tensor:
        out = x.new_empty(x.shape)
        _launch(x, None, None, None, shift, scale, None, out, mod_row_stride, eps)
        return out

    @torch.library.triton_op("auk::gated_residual_norm", mutates_args=())
    def _gated_residual_norm(
        x: Tensor, y: Tensor, gate: Tensor, keep: Tensor | None, shift: Tensor, scale: Tensor, mod_row_stride: int,
        eps: float,
    ) -> tuple[Tensor, Tensor]:
        x_out, out = x.new_empty(x.shape), x.new_empty(x.shape)
        _launch(x, y, gate, keep, shift, scale, x_out, out, mod_row_stride, eps)
        return x_out, out


def _modulation(rows: int, *chunks: Tensor) -> tuple[int, list[Tensor]]:
    """The chunks [r, 1, d] (r = 1 or ``rows``) with one row stride for all, and that stride (0 when r = 1)."""
    if chunks[0].shape[0] == 1:
        return 0, list(chunks)
    strides = {chunk.stride(0) for chunk in chunks}
    if len(strides) == 1 and all(chunk.stride(-1) == 1 for chunk in chunks):
        return strides.pop(), list(chunks)
    chunks = tuple(chunk.contiguous() for chunk in chunks)
    return chunks[0].stride(0), list(chunks)


def _check(x: Tensor, *chunks: Tensor) -> None:
    if triton is None:
        raise RuntimeError("the modulated-norm kernel needs Triton")
    bc, _, dim = x.shape
    for chunk in chunks:
        # Dimension by dimension: in a phase compiled by inductor, dynamo (torch 2.11 and 2.13) once judged a
        # torch.Size `in` a tuple of shapes wrongly, and this raised inside a step graph's capture.
        rows = chunk.shape[0] if chunk.dim() == 3 else -1
        if (rows != 1 and rows != bc) or chunk.shape[1:] != (1, dim):
            raise ValueError(f"modulation chunks must be [1 or {bc}, 1, {dim}], got {tuple(chunk.shape)}")


def modulated_norm(x: Tensor, shift: Tensor, scale: Tensor, eps: float) -> Tensor:
    """``LN(x) * (1 + scale) + shift`` of x [bc, m, d] (any strides with unit channel stride) into a new
    contiguous tensor. Runs the kernel (``available``)."""
    _check(x, shift, scale)
    if x.stride(-1) != 1:
        x = x.contiguous()
    stride, (shift, scale) = _modulation(x.shape[0], shift, scale)
    return _modulated_norm(x, shift, scale, stride, eps)


def gated_residual_norm(
    x: Tensor, y: Tensor, gate: Tensor, keep: Tensor | None, shift: Tensor, scale: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """The residual stream ``x + gate * y`` (y zeroed where ``keep`` [bc, m, 1] is False), and its modulated norm,
    both new contiguous [bc, m, d]. Runs the kernel (``available``)."""
    _check(x, gate, shift, scale)
    stride, (gate, shift, scale) = _modulation(x.shape[0], gate, shift, scale)
    keep = None if keep is None else keep.contiguous()
    return _gated_residual_norm(x.contiguous(), y.contiguous(), gate, keep, shift, scale, stride, eps)
