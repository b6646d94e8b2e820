"""The causal upsampler as a product and an overlap-add kernel against torch's transposed convolution, alone and
inside a decoder. The kernel runs in Triton's CPU interpreter here (a process of its own) and compiled in
tests/test_gpu.py."""

from __future__ import annotations

import torch

from auk_worker.model.vae.kernels.upsample import BLOCK_Q, causal_upsample
from auk_worker.model.vae.vae import UpsampleConv, use_upsample_kernel
from tests.test_conv_kernel import small_decoder
from tests.triton_interpreter import needs_triton, run_in_interpreter


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def check_causal_upsample() -> None:
    """Every release stride; lengths of one input, shorter than a program's block and past it (not a multiple);
    a batch of two; an input read through the strides of a slice."""
    torch.manual_seed(0)
    with torch.inference_mode():
        for stride in (2, 3, 4, 5):
            up = UpsampleConv(12, 7, 2 * stride, stride, causal=True)
            for n in (1, 37, BLOCK_Q + 5):
                x = torch.randn(2, 12, n + 2)[..., 1:-1]
                expected = up(x)
                got = causal_upsample(x, up.weight, up.bias, stride)
                assert got.shape == expected.shape == (2, 7, n * stride)
                assert relative(got, expected) < 1e-5, (stride, n, relative(got, expected))


def check_decoder_with_kernel_upsamplers() -> None:
    """A small decoder whose six upsamplers run on the kernel decodes what torch's transposed convolutions decode,
    and hands them back."""
    vae, latents = small_decoder()
    with torch.inference_mode():
        expected = vae.decode(latents)
        assert use_upsample_kernel(vae, causal_upsample) == 6
        got = vae.decode(latents)
        assert use_upsample_kernel(vae, None) == 0
        assert torch.equal(vae.decode(latents), expected)  # handed back
    assert relative(got, expected) < 1e-5, relative(got, expected)


def test_only_causal_fp32_upsamplers_go_to_the_kernel():
    causal = UpsampleConv(8, 4, 6, 3, causal=True)
    centred = UpsampleConv(8, 4, 6, 3, causal=False)
    half = UpsampleConv(8, 4, 6, 3, causal=True).to(torch.bfloat16)
    assert use_upsample_kernel(torch.nn.ModuleList([causal, centred, half]), causal_upsample) == 1
    assert (causal.kernel, centred.kernel, half.kernel) == (causal_upsample, None, None)


@needs_triton
def test_causal_upsample_equals_conv_transpose1d_in_the_triton_interpreter():
    run_in_interpreter("tests.test_upsample_kernel", "check_causal_upsample")


@needs_triton
def test_decoder_with_kernel_upsamplers_equals_the_torch_decoder_in_the_triton_interpreter():
    run_in_interpreter("tests.test_upsample_kernel", "check_decoder_with_kernel_upsamplers")
