"""The SwiGLU kernel (a feed-forward's ``silu(gate) * up``) against its torch reference, and the reference against
the DiT's own form. The kernel runs in Triton's CPU interpreter here (a process of its own: the interpreter is
chosen when the kernels are defined) and compiled in tests/test_gpu.py."""

from __future__ import annotations

import torch

from auk_worker.model.dit import FeedForward
from auk_worker.model.swiglu_kernel import swiglu_reference
from tests.triton_interpreter import needs_triton, run_in_interpreter


def test_reference_is_the_feed_forwards_torch_form() -> None:
    """In fp32 the reference is what ``FeedForward`` computes between its two products."""
    torch.manual_seed(0)
    ff = FeedForward(24, 40)
    x = torch.randn(3, 7, 24)
    with torch.no_grad():
        expected = ff(x)
        torch.testing.assert_close(ff.linear_out(swiglu_reference(ff.linear_in(x))), expected, rtol=1e-6, atol=1e-6)


def check_kernel() -> None:
    """The kernel against the reference: widths that do not fill a program and one that takes two, position
    counts of one and more, a non-contiguous input, fp32 (tight), fp16 and bf16 (the interpreter rounds bf16 by
    truncation: one unit in the last place). Run with TRITON_INTERPRET=1 (see below)."""
    from auk_worker.model.swiglu_kernel import BLOCK, swiglu

    generator = torch.Generator().manual_seed(1)
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.float16, 2**-10), (torch.bfloat16, 2**-7)):
        for shape in ((1, 1, 2 * 40), (2, 5, 2 * 40), (3, 2 * (BLOCK + 24)), (4, 2 * 8)):
            y = (3 * torch.randn(*shape, generator=generator)).to(dtype)
            for what, source in (("", y), (" strided", y.transpose(0, -2).contiguous().transpose(0, -2))):
                out = swiglu(source)
                exact = swiglu_reference(source)
                assert out.shape == exact.shape and out.dtype == dtype and out.is_contiguous(), (dtype, shape)
                error = ((out.float() - exact.float()).abs() / exact.float().abs().clamp_min(1.0)).max().item()
                assert error <= tolerance, (dtype, shape, what, error)
    try:
        swiglu(torch.zeros(2, 7))
    except ValueError as exc:
        assert "halves" in str(exc)
    else:
        raise AssertionError("an odd width was accepted")


@needs_triton
def test_kernel_equals_the_reference_in_the_triton_interpreter() -> None:
    run_in_interpreter("tests.test_swiglu_kernel", "check_kernel")
