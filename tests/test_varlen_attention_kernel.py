"""The variable-length attention kernel (each row's queries over its first ``count`` keys) against its torch
reference, and the reference against masked SDPA. The kernel runs in Triton's CPU interpreter here (a process of
its own: the interpreter is chosen when the kernels are defined)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from auk_worker.model.dit.kernels.varlen_attention import varlen_attention_reference
from tests.triton_interpreter import needs_triton, run_in_interpreter

HEADS = 2


def packed(rows: int, m: int, dim_head: int, dtype: torch.dtype, seed: int, strided: bool) -> tuple[torch.Tensor, ...]:
    """q, k, v [rows * m, HEADS, dh]. ``strided``: views as the blocks make them, q, k and v each with strides
    of its own: q and k cut from one qkv projection (position stride 3 h dh), v every other head-width slice of a
    wider tensor (head stride 2 dh)."""
    generator = torch.Generator().manual_seed(seed)
    total = rows * m
    if not strided:
        return tuple(torch.randn(total, HEADS, dim_head, generator=generator).to(dtype) for _ in range(3))
    qkv = torch.randn(total, 3 * HEADS * dim_head, generator=generator).to(dtype)
    q, k, _ = (part.unflatten(-1, (HEADS, dim_head)) for part in qkv.chunk(3, dim=-1))
    v = torch.randn(total, HEADS, 2 * dim_head, generator=generator).to(dtype)[..., dim_head:]
    return q, k, v


def uniform(rows: int, m: int, counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``starts`` and ``count`` (int32) of rows of m positions each, as ``dit.VisibleKeys`` has them."""
    return torch.arange(rows + 1, dtype=torch.int32) * m, torch.tensor(counts, dtype=torch.int32)


def test_reference_is_masked_sdpa() -> None:
    """Over uniform rows the reference is SDPA with a boolean key mask (rows with visible keys), and zeros where a
    row has none; over ragged rows it treats each row on its own."""
    rows, m, dim_head = 4, 13, 16
    q, k, v = packed(rows, m, dim_head, torch.float32, seed=1, strided=True)
    starts, count = uniform(rows, m, (13, 5, 1, 0))
    out = varlen_attention_reference(q, k, v, starts, count, m)
    visible = torch.arange(m) < count[:, None]  # [rows, m]
    sdpa = F.scaled_dot_product_attention(
        *(t.unflatten(0, (rows, m)).transpose(1, 2) for t in (q, k, v)), attn_mask=visible[:, None, None, :]
    ).transpose(1, 2).flatten(0, 1)  # [rows * m, h, dh]
    torch.testing.assert_close(out[: 3 * m], sdpa[: 3 * m], rtol=1e-6, atol=1e-6)
    assert torch.equal(out[3 * m :], torch.zeros_like(out[3 * m :]))

    ragged = torch.tensor([0, 5, 18, 26], dtype=torch.int32)  # rows of 5, 13 and 8 positions
    joint = varlen_attention_reference(q[:26], k[:26], v[:26], ragged, count[:3], m)
    one_row = torch.tensor([0, 13], dtype=torch.int32)
    alone = varlen_attention_reference(q[5:18], k[5:18], v[5:18], one_row, count[1:2], m)  # the second row
    assert torch.equal(joint[5:18], alone)


def multiply_bf16_tiles_by_value() -> None:
    """Triton's interpreter stores bf16 as its raw bits (uint16) and its ``tl.dot`` multiplies those bits; make it
    multiply the values, exactly (fp32), as the GPU's bf16 matrix products do. Only the interpreter is patched."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    by_bits = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        a, b = (self.cast_impl(t, tl.float32) if t.dtype.scalar == tl.bfloat16 else t for t in (a, b))
        return by_bits(self, a, b, d, *args)

    InterpreterBuilder.create_dot = create_dot


def check_kernel() -> None:
    """The kernel against the reference. The default launch settings (64 x 64 blocks) at m = 150: three query
    blocks, the last partial; counts of a full row, an exact multiple of the key block (no masked block), a
    partial row, less than one key block, none. Small blocks (16 x 32) at m = 37 (three query blocks) with the
    same kinds of counts, and over ragged rows; there also with keys that grow along the row, so that the second
    key block's scores pass the first block's maximum by far: a wrong rescale of the running sums would weigh the
    first block's values e^tens too much. Contiguous and strided q, k, v; dh 16 and 32; fp32, fp16, bf16. Every
    output finite, padded queries included.

    Tolerances: fp32 1e-5 (the reference's sums in another order), 5e-5 with the growing keys (scores of a few
    hundred, which fp32 holds to about 1e-5: 1.6e-5 measured). Half precision: the kernel rounds the softmax
    weights to q's dtype for the product with v, as FlashAttention does, and the output once, each within one unit
    in the last place relative, so the error is within 2 ulp * max |v|: 2^-10 in fp16 (2^-11 per rounding), 2^-6 in
    bf16 (2^-7 per rounding under the interpreter's truncation; half that on a GPU, which rounds to nearest).
    Run with TRITON_INTERPRET=1 (see below)."""
    from auk_worker.model.dit.kernels.varlen_attention import launch_settings, varlen_attention

    multiply_bf16_tiles_by_value()
    default, small = launch_settings(), (16, 32, 4, 1)  # small: quick in the interpreter; 16 != 32 tells the two apart
    assert default == (64, 64, 4, 3)  # the settings the GPU runs are the ones tested here
    ragged = torch.tensor([0, 5, 42, 67], dtype=torch.int32), torch.tensor([3, 37, 25], dtype=torch.int32)
    cases = [  # (launch, m, dh, starts, count, keys growing along the row)
        (None, 150, 32, *uniform(5, 150, (150, 128, 97, 40, 0)), False),
        (small, 37, 16, *uniform(6, 37, (37, 32, 21, 16, 9, 0)), False),
        (small, 37, 32, *ragged, False),
        (small, 37, 32, *ragged, True),
    ]
    tolerances = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-6}  # fp32 absolute, else x max|v|
    for dtype, tolerance in tolerances.items():
        for launch, m, dim_head, starts, count, rising in cases:
            for strided in (False, True):
                total = int(starts[-1])
                tensors = packed(len(count), m, dim_head, dtype, seed=m + dim_head, strided=strided)
                q, k, v = (t[:total] for t in tensors)  # ragged rows: the positions the starts cover
                if rising:  # each key about half a unit larger than the one before it
                    k = k * (1 + torch.arange(total, dtype=dtype) / 2)[:, None, None]
                what = (dtype, launch, m, dim_head, count.tolist(), strided, rising)
                out = varlen_attention(q, k, v, starts, count, m, launch=launch)
                assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous(), what
                assert torch.isfinite(out).all(), what
                exact = varlen_attention_reference(q, k, v, starts, count, m)
                error = (out.float() - exact.float()).abs().max().item()
                if dtype != torch.float32:
                    error /= v.float().abs().max().item()
                assert error <= (5 * tolerance if rising and dtype == torch.float32 else tolerance), (*what, error)


def check_split_output() -> None:
    """With ``split`` the kernel writes the same values, every row's first ``split`` positions first and then every
    row's rest: a joint attention's audio and text parts, each contiguous. Splits inside the first query block,
    on a block's edge and inside the last; a row with no visible key. Bad splits are refused."""
    from auk_worker.model.dit.kernels.varlen_attention import varlen_attention

    multiply_bf16_tiles_by_value()
    launch = (16, 32, 4, 1)
    rows, m = 3, 37
    starts, count = uniform(rows, m, (37, 20, 0))
    q, k, v = packed(rows, m, 32, torch.bfloat16, seed=5, strided=True)
    whole = varlen_attention(q, k, v, starts, count, m, launch=launch)
    by_row = whole.view(rows, m, *whole.shape[1:])
    for split in (5, 16, 30):
        out = varlen_attention(q, k, v, starts, count, m, split=split, launch=launch)
        assert out.shape == whole.shape and out.is_contiguous()
        first, rest = out[: rows * split].view(rows, split, *out.shape[1:]), out[rows * split :]
        assert torch.equal(first, by_row[:, :split]), split
        assert torch.equal(rest.view(rows, m - split, *out.shape[1:]), by_row[:, split:]), split
    for split in (0, m):
        try:
            varlen_attention(q, k, v, starts, count, m, split=split, launch=launch)
        except ValueError:
            continue
        raise AssertionError(f"split {split} was accepted")


def check_first_queries() -> None:
    """With ``first`` the kernel computes only each row's queries from ``first`` on, over the same keys, and
    writes them row after row: the same values as the whole output's (each query's sum is its own). ``first``
    inside the first query block, on a block's edge and inside the last; a row with no visible key; the reference
    lays its output out the same way. Bad values are refused."""
    from auk_worker.model.dit.kernels.varlen_attention import varlen_attention

    multiply_bf16_tiles_by_value()
    launch = (16, 32, 4, 1)
    rows, m = 3, 37
    starts, count = uniform(rows, m, (37, 20, 0))
    q, k, v = packed(rows, m, 32, torch.bfloat16, seed=6, strided=True)
    by_row = varlen_attention(q, k, v, starts, count, m, launch=launch).view(rows, m, HEADS, 32)
    for first in (5, 16, 30):
        out = varlen_attention(q, k, v, starts, count, m, first=first, launch=launch)
        assert out.shape == (rows * (m - first), HEADS, 32) and out.is_contiguous(), first
        assert torch.equal(out.view(rows, m - first, HEADS, 32), by_row[:, first:]), first
        exact = varlen_attention_reference(q, k, v, starts, count, m, first=first)
        assert exact.shape == out.shape
        assert (out.float() - exact.float()).abs().max().item() <= 2**-6 * v.float().abs().max().item(), first
    for bad in ({"first": m}, {"first": 3, "split": 5}):
        try:
            varlen_attention(q, k, v, starts, count, m, launch=launch, **bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")


@needs_triton
def test_kernel_equals_the_reference_in_the_triton_interpreter() -> None:
    run_in_interpreter("tests.test_varlen_attention_kernel", "check_kernel")


@needs_triton
def test_split_output_holds_each_part_contiguous_in_the_triton_interpreter() -> None:
    run_in_interpreter("tests.test_varlen_attention_kernel", "check_split_output")


@needs_triton
def test_first_queries_only_in_the_triton_interpreter() -> None:
    run_in_interpreter("tests.test_varlen_attention_kernel", "check_first_queries")


@needs_triton
def test_the_op_traces_on_fake_tensors() -> None:
    """Inside a compiled region the op is traced on fake tensors: it gives the output's shape without running."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from auk_worker.model.dit.kernels.varlen_attention import varlen_attention

    with FakeTensorMode():
        q, k, v = packed(2, 9, 16, torch.bfloat16, seed=2, strided=True)
        starts, count = uniform(2, 9, (9, 4))
        out = varlen_attention(q, k, v, starts, count, 9)
    assert out.shape == (18, HEADS, 16) and out.dtype == torch.bfloat16 and out.is_contiguous()
