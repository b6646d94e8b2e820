"""The modulated-norm kernel (a block's adaptive layer norm, with the gated residual before it) against its torch
reference, and the reference against the DiT's own form. The kernel runs in Triton's CPU interpreter here (a
process of its own: the interpreter is chosen when the kernels are defined) and compiled in tests/test_gpu.py."""

from __future__ import annotations

import torch

from auk_worker.model.dit import layers
from auk_worker.model.dit.kernels.modulated_norm import gated_residual_norm_reference, modulated_norm_reference
from auk_worker.model.dit.layers import LAYER_NORM_EPS
from tests.triton_interpreter import needs_triton, run_in_interpreter

DIM = 48  # not a power of two, as the release width (1,536) is not


def inputs(rows: int, m: int, mod_rows: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """A stream, an attention output, a keep mask with dropped positions, and modulation chunks [r, 1, d] cut
    from one [r, 6d] modulation row as the blocks cut them (strided views)."""
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    modulation = rand(mod_rows, 6 * DIM).to(dtype)
    shift, scale, gate = (chunk[:, None] for chunk in modulation.chunk(6, dim=1)[:3])
    keep = torch.rand(rows, m, 1, generator=generator) > 0.3
    return {"x": (2 + 3 * rand(rows, m, DIM)).to(dtype), "y": (3 * rand(rows, m, DIM)).to(dtype), "gate": gate,
            "keep": keep, "shift": shift, "scale": scale}  # fmt: skip


def test_references_are_the_blocks_torch_form() -> None:
    """In fp32 the references compute what the blocks compute without the kernel."""
    for mod_rows in (1, 3):
        a = inputs(3, 7, mod_rows, torch.float32, seed=mod_rows)
        torch.testing.assert_close(
            modulated_norm_reference(a["x"], a["shift"], a["scale"], LAYER_NORM_EPS),
            layers.modulated_norm(a["x"], a["shift"], a["scale"], kernel=None), rtol=1e-6, atol=1e-6,
        )
        for keep in (a["keep"], None):
            args = (a["x"], a["y"], a["gate"], keep, a["shift"], a["scale"])
            for ref, torch_form in zip(gated_residual_norm_reference(*args, LAYER_NORM_EPS),
                                       layers.gated_residual_norm(*args, kernel=None)):  # fmt: skip
                torch.testing.assert_close(ref, torch_form, rtol=1e-6, atol=1e-6)
    dropped = a["keep"][..., 0].logical_not().nonzero()
    assert len(dropped) > 0  # the keep mask drops positions, so the tests above cover it


def check_kernel() -> None:
    """The kernel against the reference: position counts that do not fill a program, one modulation row for all
    rows and one per row, keep masks or none, a strided input (the final norm's slice), fp32 (tight), fp16 and bf16
    (the interpreter rounds bf16 by truncation: one unit in the last place). Run with TRITON_INTERPRET=1 (see
    below)."""
    from auk_worker.model.dit.kernels.modulated_norm import gated_residual_norm, modulated_norm

    def close(fast: torch.Tensor, exact: torch.Tensor, tolerance: float, what: tuple) -> None:
        assert fast.shape == exact.shape and fast.dtype == exact.dtype and fast.is_contiguous(), what
        error = ((fast.float() - exact.float()).abs() / exact.float().abs().clamp_min(1.0)).max().item()
        assert error <= tolerance, (*what, error)

    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2**-10), (torch.bfloat16, 2**-7)):
        for rows, m, mod_rows in ((2, 7, 1), (3, 5, 3), (1, 1, 1), (2, 16, 2)):
            a = inputs(rows, m, mod_rows, dtype, seed=rows * m + mod_rows)
            what = (dtype, rows, m, mod_rows)
            out = modulated_norm(a["x"], a["shift"], a["scale"], LAYER_NORM_EPS)
            close(out, modulated_norm_reference(a["x"], a["shift"], a["scale"], LAYER_NORM_EPS), tolerance, what)
            tail = a["x"][:, m // 2 :]  # the final norm's input: the last positions of each row, a strided view
            close(modulated_norm(tail, a["shift"], a["scale"], LAYER_NORM_EPS),
                  modulated_norm_reference(tail, a["shift"], a["scale"], LAYER_NORM_EPS), tolerance, (*what, "tail"))
            for keep in (a["keep"], None):
                args = (a["x"], a["y"], a["gate"], keep, a["shift"], a["scale"], LAYER_NORM_EPS)
                stream, normed = gated_residual_norm(*args)
                ref_stream, _ = gated_residual_norm_reference(*args)
                close(stream, ref_stream, tolerance, (*what, "stream", keep is not None))
                # The norm of the stream the kernel wrote (a one-ulp step in it moves the norm by more than one).
                ref_normed = modulated_norm_reference(stream, a["shift"], a["scale"], LAYER_NORM_EPS)
                close(normed, ref_normed, tolerance, (*what, "normed", keep is not None))
                if keep is not None:  # dropped positions keep their stream exactly
                    assert torch.equal(stream[~keep[..., 0]], a["x"][~keep[..., 0]])


@needs_triton
def test_kernel_equals_the_reference_in_the_triton_interpreter() -> None:
    run_in_interpreter("tests.test_modulated_norm_kernel", "check_kernel")
