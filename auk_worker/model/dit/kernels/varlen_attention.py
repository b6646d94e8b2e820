"""The DiT's variable-length attention as one Triton kernel: each row's queries over only its first ``count`` keys.

With ``VisibleKeys`` the DiT's blocks put each row's visible keys first and attend over the first ``count[i]`` of
them, on the [rows * m, h, dh] layout the projections already have. FlashAttention-2's variable-length kernel
(``flash_varlen_attention`` at the end of this file) does this with the counts on the device, but on Hopper it
is well behind cuDNN's kernel without a mask (bench/RESULTS.md). This kernel has the same contract, reads the
counts on the device too (no host sync, one captured graph for all counts), and leaves the matrix products to
Triton, which emits Hopper's wgmma for them on sm90.

A program takes ``BLOCK_M`` queries of one head of one row, loads them once, and walks that row's visible keys in
blocks of ``BLOCK_N``: an online softmax (FlashAttention's) in fp32 with exp2, log2(e) folded into the scale. Only
the last, partial key block is masked; hidden keys past it are never read. Programs of one (row, head) are
launched together, so after the first its keys and values come mostly from L2.

Arithmetic as FlashAttention's: scores and the running sums in fp32, the softmax weights rounded to the inputs'
dtype for the product with v, the output rounded once at the end. A row with no visible keys gets zeros.

Shapes: rows packed one after another, at most m positions each (``starts``: FlashAttention's cumulative
lengths, ``row * m`` in the DiT), h heads, dh head width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: callers check ``available``
    triton = None

# Launch settings: 64 queries by 64 keys a step over four warps (one warpgroup, wgmma's unit), three stages of key
# and value loads in flight: among the fastest of the settings bench.kernels' attention stage compares on the H200.
BLOCK_M = 64
BLOCK_N = 64
WARPS = 4
STAGES = 3

Launch = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, warps, stages)


def launch_settings() -> Launch:
    """The launch settings in use now: the module's (a benchmark may override them, or pass its own)."""
    return BLOCK_M, BLOCK_N, WARPS, STAGES


def available(device: torch.device, dtype: torch.dtype, dim_head: int) -> bool:
    """Where the kernel runs: a CUDA device with Triton, half precision, a power-of-two head width of 16 to 128
    (a tile's width; 16 is the matrix product's least)."""
    return (
        triton is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and 16 <= dim_head <= 128
        and dim_head & (dim_head - 1) == 0
    )


def varlen_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, starts: Tensor, count: Tensor, m: int, *, split: int | None = None,
    first: int = 0,
) -> Tensor:
    """The kernel's contract in torch, in fp32 with one rounding to q's dtype: for each row i (positions
    ``starts[i]:starts[i + 1]`` of q, k, v [total, h, dh]), softmax(q kᵀ / sqrt(dh)) v over the row's first
    ``count[i]`` keys; zeros where count[i] is 0. Returns [total, h, dh], its parts laid out as ``varlen_attention``
    lays them out for a ``split``, or each row's queries from ``first`` on. For tests (it syncs with the host)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    bounds, counts = starts.tolist(), count.tolist()
    for i, visible in enumerate(counts):
        begin, end = bounds[i], bounds[i + 1]
        if end - begin > m:
            raise ValueError(f"row {i} has {end - begin} positions, more than m = {m}")
        visible = max(0, min(visible, end - begin))
        if visible == 0:
            continue
        rq, rk, rv = (t[begin:end].float().transpose(0, 1) for t in (q, k, v))  # [h, length, dh]
        weights = torch.softmax(rq @ rk[:, :visible].transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
        out[begin:end] = (weights @ rv[:, :visible]).transpose(0, 1)
    by_row = out.view(len(counts), m, *out.shape[1:]) if split is not None or first else None
    if split is not None:
        out = torch.cat((by_row[:, :split].flatten(0, 1), by_row[:, split:].flatten(0, 1)))
    elif first:
        out = by_row[:, first:].flatten(0, 1)
    return out.to(q.dtype)


if triton is not None:

    @triton.jit
    def _key_block(acc, total, top, q, k_ptrs, v_ptrs, keys, qk_scale: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASK: tl.constexpr):
        """One block of keys folded into the online softmax: ``acc`` [BLOCK_M, DH] the weighted sum of values,
        ``total`` the weights' sum, ``top`` the largest score (log2 units), all relative to ``top``. MASK: only
        the block's first ``keys`` keys are visible (the last block; every full block has none hidden)."""
        if MASK:
            visible = tl.arange(0, BLOCK_N) < keys
            k = tl.load(k_ptrs, mask=visible[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=visible[:, None], other=0.0)  # zeros: a hidden key's weight is 0, not NaN
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        dots = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32, not yet scaled
        if MASK:
            dots = tl.where(visible[None, :], dots, float("-inf"))
        # The scale is positive, so the largest scaled score is the largest dot scaled; each weight's argument is
        # then one fma (dot * scale - top) rather than a product and a difference.
        new_top = tl.maximum(top, tl.max(dots, axis=1) * qk_scale)  # finite: every block has a visible key
        weights = tl.math.exp2(dots * qk_scale - new_top[:, None])
        rescale = tl.math.exp2(top - new_top)  # 0 at the first block (top = -inf)
        total = total * rescale + tl.sum(weights, axis=1)
        acc = tl.dot(weights.to(v.dtype), v, acc * rescale[:, None])
        return acc, total, new_top

    @triton.jit
    def _varlen_attention_kernel(
        q_ptr, k_ptr, v_ptr, starts_ptr, count_ptr, out_ptr,
        q_stride, q_head_stride, k_stride, k_head_stride, v_stride, v_head_stride, split, first,
        HEADS: tl.constexpr, DH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK_SCALE: tl.constexpr,
        SPLIT: tl.constexpr, FIRST: tl.constexpr,
    ):
        # The scale is a compile-time constant: inductor passes a float argument as fp64, which would carry the
        # whole softmax into fp64.
        # The query block varies fastest: the blocks of one (row, head) run together and share its keys in L2.
        block, head, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(starts_ptr + row)
        length = tl.load(starts_ptr + row + 1) - start
        keys = tl.maximum(tl.minimum(tl.load(count_ptr + row), length), 0)
        start = start.to(tl.int64)
        i = first + block * BLOCK_M + tl.arange(0, BLOCK_M)  # query positions in the row
        j = tl.arange(0, BLOCK_N)  # key positions in a block
        d = tl.arange(0, DH)
        queries = (i < length)[:, None]  # the last block's positions past the row are neither read nor written
        q_at = (start + i)[:, None] * q_stride + head * q_head_stride + d[None, :]
        q = tl.load(q_ptr + q_at, mask=queries, other=0.0)
        k_ptrs = k_ptr + start * k_stride + head * k_head_stride + j[:, None] * k_stride + d[None, :]
        v_ptrs = v_ptr + start * v_stride + head * v_head_stride + j[:, None] * v_stride + d[None, :]

        acc = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        full = keys // BLOCK_N * BLOCK_N
        for n in range(0, full, BLOCK_N):
            acc, total, top = _key_block(
                acc, total, top, q, k_ptrs + n * k_stride, v_ptrs + n * v_stride, BLOCK_N, QK_SCALE, BLOCK_N, False
            )
        if full < keys:
            acc, total, top = _key_block(
                acc, total, top, q, k_ptrs + full * k_stride, v_ptrs + full * v_stride, keys - full, QK_SCALE,
                BLOCK_N, True,
            )
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # no visible keys: acc is 0, and so is the output
        at = start + i
        if SPLIT:  # rows of one length: every row's first ``split`` positions first, then every row's rest
            rows = tl.num_programs(2)
            at = tl.where(i < split, row * split + i, rows * split + row * (length - split) + i - split).to(tl.int64)
        elif FIRST:  # rows of one length, each its queries from ``first`` on
            at = (row * (length - first) + i - first).to(tl.int64)
        out_at = at[:, None] * (HEADS * DH) + head * DH + d[None, :]
        tl.store(out_ptr + out_at, out.to(out_ptr.dtype.element_ty), mask=queries)

    @torch.library.triton_op("auk::varlen_attention", mutates_args=())
    def _varlen_attention(
        q: Tensor, k: Tensor, v: Tensor, starts: Tensor, count: Tensor, m: int, split: int, first: int,
        block_m: int, block_n: int, warps: int, stages: int,
    ) -> Tensor:
        total, heads, dim_head = q.shape
        rows = count.shape[0]
        out = q.new_empty(total - rows * first, heads, dim_head)
        qk_scale = math.log2(math.e) / math.sqrt(dim_head)  # exp(x / sqrt(dh)) = exp2(x * qk_scale)
        grid = (triton.cdiv(m - first, block_m), heads, rows)
        torch.library.wrap_triton(_varlen_attention_kernel)[grid](
            q, k, v, starts, count, out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), split, first,
            HEADS=heads, DH=dim_head, BLOCK_M=block_m, BLOCK_N=block_n, QK_SCALE=qk_scale, SPLIT=split < m,
            FIRST=first > 0, num_warps=warps, num_stages=stages,
        )
        return out


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, starts: Tensor, count: Tensor, m: int, *, split: int | None = None,
    first: int = 0, launch: Launch | None = None,
) -> Tensor:
    """Attention over rows packed as q, k, v [total, h, dh] (any strides with unit channel stride), as
    ``flash_varlen_attention``: row i is positions ``starts[i]:starts[i + 1]`` (``starts`` [rows + 1] int32,
    at most m positions a row) and its queries attend to its first ``count[i]`` keys (``count`` [rows] int32, read
    on the device); zeros where count[i] is 0. Returns a new contiguous [total, h, dh] in q's dtype.

    ``split`` (0 < split < m) is for rows all m long (starts[i] = i * m): the output then holds every row's first
    ``split`` positions, row after row, and after them every row's other m - split: two parts, each contiguous (a
    joint attention's audio and text outputs, each the input of its own projection). ``first`` (0 < first < m,
    rows all m long, no ``split``): only each row's queries from position ``first`` on, the output
    [rows * (m - first), h, dh], while the keys stay every row's first ``count``: the DiT's last block, whose
    outputs are kept only at the target. ``launch``: (BLOCK_M, BLOCK_N, warps, stages) instead of
    ``launch_settings()``. Runs the kernel (``available``)."""
    if triton is None:
        raise RuntimeError("the variable-length attention kernel needs Triton")
    dim_head = q.shape[-1]
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must be one shape [total, h, dh], got {[tuple(t.shape) for t in (q, k, v)]}")
    if dim_head < 16 or dim_head & (dim_head - 1):
        raise ValueError(f"the head width must be a power of two of at least 16, got {dim_head}")
    if split is not None and not (0 < split < m and q.shape[0] == (starts.shape[0] - 1) * m):
        raise ValueError(f"split {split} needs rows of m = {m} positions and 0 < split < m")
    if first and not (0 < first < m and split is None and q.shape[0] == (starts.shape[0] - 1) * m):
        raise ValueError(f"first {first} needs rows of m = {m} positions, 0 < first < m and no split")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _varlen_attention(
        q, k, v, starts, count, m, m if split is None else split, first, *(launch or launch_settings())
    )


# ---------------------------------------------------------------------------------------------------------------
# FlashAttention's variable-length kernel, the same contract without ``split`` and ``first``


def flash_available(device: torch.device, dtype: torch.dtype, dim_head: int) -> bool:
    """Where FlashAttention's kernel runs: sm80 and later, half precision, head widths it compiles (multiples of 8
    up to 256)."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(device) >= (8, 0)
        and dim_head % 8 == 0
        and dim_head <= 256
    )


def flash_varlen_attention(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, count: Tensor, m: int) -> Tensor:
    """FlashAttention over rows packed as [rows * m, h, dh]: row i's queries attend to its first ``count[i]``
    keys. CUDA, fp16 or bf16 only (:func:`flash_available`)."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, starts, starts, m, m, 0.0, False, False, seqused_k=count)
    return out[0]
