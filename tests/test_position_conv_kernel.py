"""The DiT's position-convolution kernel against its torch reference. The kernel runs in Triton's CPU interpreter
here (a process of its own: the interpreter is chosen when the kernels are defined) and compiled in
tests/test_gpu.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from auk_worker.model.dit.kernels.position_conv import pack, position_conv_reference, unpack
from tests.test_varlen_attention_kernel import multiply_bf16_tiles_by_value
from tests.triton_interpreter import needs_triton, run_in_interpreter


def make_conv(dim: int, groups: int, taps: int = 31, seed: int = 0) -> nn.Conv1d:
    torch.manual_seed(seed)
    return nn.Conv1d(dim, dim, taps, groups=groups, padding=taps // 2)


def test_pack_puts_each_tap_and_group_block_together_and_unpack_inverts_it() -> None:
    conv = make_conv(96, 16, taps=5)  # 6 channels a group, output channels padded to 16
    packed = pack(conv)
    assert packed.shape == (5, 16, 6, 16)
    assert torch.equal(packed[3, 2, 4, 1], conv.weight[2 * 6 + 1, 4, 3])  # [tap, group, in, out] <- [out, in, tap]
    assert torch.equal(packed[..., 6:], torch.zeros_like(packed[..., 6:]))
    assert torch.equal(unpack(packed), conv.weight)


def test_reference_is_the_modules_conv_then_mish_with_the_rows_zeroed() -> None:
    """The reference (what the kernel is checked against) is the torch form: rows zeroed, conv, Mish, rows zeroed."""
    conv = make_conv(64, 16)
    x = torch.randn(2, 40, 64)
    keep = torch.arange(40)[None] < torch.tensor([40, 29])[:, None]
    expected = F.mish(conv(x.masked_fill(~keep[..., None], 0).transpose(1, 2))).transpose(1, 2)
    expected = expected.masked_fill(~keep[..., None], 0)
    with torch.no_grad():
        torch.testing.assert_close(position_conv_reference(x, pack(conv), conv.bias, keep), expected)
        torch.testing.assert_close(position_conv_reference(x, pack(conv), conv.bias, keep, residual=x), expected + x)


def check_kernel() -> None:
    """The kernel against the reference: fp32 and bf16; 4, 12 and 96 channels a group (one partial block of
    input channels, one, and the release width's three), 31, 7 and 9 taps; lengths shorter than a program's
    positions and not a multiple of them (the taps reach past both ends); rows kept in full, partly or not at
    all; with and without a residual; x read through the strides of a slice. Tolerances: fp32 1e-5 relative;
    bf16 2e-2 relative (one rounding of the output, against an fp32 reference on the same bf16 inputs)."""
    from auk_worker.model.dit.kernels.position_conv import position_conv

    multiply_bf16_tiles_by_value()
    generator = torch.Generator().manual_seed(1)
    for dim, groups, taps in ((32, 8, 31), (96, 8, 7), (192, 2, 9)):
        conv = make_conv(dim, groups, taps, seed=dim + groups)
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            packed, bias = pack(conv).to(dtype), conv.bias.detach().to(dtype)
            for m in (5, 70):
                wide = torch.randn(2, m, dim + 8, generator=generator).to(dtype)
                x = wide[..., 3 : 3 + dim]  # rows and positions strided past d
                residual = torch.randn(2, m, dim, generator=generator).to(dtype)
                keep = torch.arange(m)[None] < torch.tensor([m, m // 2])[:, None]
                keep[1, 0] = False  # a hole at the start of a row
                for mask, res in ((None, None), (keep, None), (keep, residual), (torch.zeros_like(keep), residual)):
                    what = (dim, groups, taps, dtype, m, None if mask is None else mask.sum().item(), res is None)
                    got = position_conv(x, packed, bias, mask, res)
                    assert got.shape == (2, m, dim) and got.dtype == dtype and got.is_contiguous(), what
                    expected = position_conv_reference(x, packed, bias, mask, res)
                    error = ((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()
                    assert error < tolerance, (*what, error)
                    if mask is not None:  # dropped rows exactly zero (plus the residual)
                        dropped = ~mask[..., None].expand_as(got)
                        base = torch.zeros_like(got) if res is None else res
                        assert torch.equal(got[dropped], base[dropped]), what


@needs_triton
def test_kernel_equals_the_reference_in_the_triton_interpreter() -> None:
    run_in_interpreter("tests.test_position_conv_kernel", "check_kernel")


@needs_triton
def test_the_op_traces_on_fake_tensors() -> None:
    """Inside a compiled region the op is traced on fake tensors: it gives the output's shape without running."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from auk_worker.model.dit.kernels.position_conv import position_conv

    with FakeTensorMode():
        packed, bias = torch.randn(31, 16, 4, 16), torch.randn(64)  # pack's layout for 64 channels in 16 groups
        out = position_conv(torch.randn(2, 9, 64), packed, bias, torch.ones(2, 9, dtype=torch.bool))
    assert out.shape == (2, 9, 64)
