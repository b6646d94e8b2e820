"""The narrow causal convolution kernel against torch's conv1d, alone and inside a decoder. The kernel runs in
Triton's CPU interpreter here (a process of its own: the interpreter is chosen when the kernels are defined) and
compiled in tests/test_gpu.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from auk_worker.model.vae import AuKVAE, VAEConfig
from auk_worker.model.vae.kernels.narrow_conv import causal_conv, tap_major
from auk_worker.model.vae.vae import use_conv_kernel
from tests.triton_interpreter import needs_triton, run_in_interpreter


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def check_causal_conv() -> None:
    """Widths below, at and past one block of input or output channels; every release kernel size and dilation;
    lengths shorter than a program's tile and not a multiple of it; a batch of two; with and without a residual
    read through the strides of a slice."""
    generator = torch.Generator().manual_seed(0)
    for channels in (5, 24, 48, 96):
        for kernel, dilation in ((3, 1), (7, 3), (11, 5)):
            weight = torch.randn(channels, channels, kernel, generator=generator) / (channels * kernel) ** 0.5
            bias = torch.randn(channels, generator=generator)
            for t in (1, 50, 300):
                reach = dilation * (kernel - 1)
                x = F.pad(torch.randn(2, channels, t, generator=generator), (reach, 0))
                expected = F.conv1d(x, weight, bias, dilation=dilation)
                got = causal_conv(x, tap_major(weight), bias, dilation)
                assert got.shape == expected.shape == (2, channels, t)
                assert relative(got, expected) < 1e-5, (channels, kernel, dilation, t, relative(got, expected))
                residual = torch.randn(2, channels, t + 3, generator=generator)[..., :t]
                got = causal_conv(x, tap_major(weight), bias, dilation, residual)
                assert relative(got, residual + expected) < 1e-5, (channels, kernel, t)


def small_decoder() -> tuple[AuKVAE, torch.Tensor]:
    """A decoder with every release stride but 128 channels at its widest (64 down to 2 in its stages), random
    weights, and a batch of two short latent clips for it."""
    config = VAEConfig(upsample_rates=(4, 3, 2, 2, 2, 5), upsample_kernel_sizes=(8, 6, 4, 4, 4, 10),
                       upsample_initial_channel=128)  # fmt: skip
    torch.manual_seed(0)
    return AuKVAE(config).eval().requires_grad_(False), torch.randn(2, 5, config.latent_dim)


def check_decoder_with_kernel_convs() -> None:
    """A small decoder with every AMP conv handed to the kernel decodes what torch's convolutions decode."""
    vae, latents = small_decoder()
    with torch.inference_mode():
        expected = vae.decode(latents)
        assert use_conv_kernel(vae, causal_conv, max_width=32) == 5 * 18  # stages 64, 32, ... 2 wide; 18 convs each
        got = vae.decode(latents)
        assert use_conv_kernel(vae, causal_conv, max_width=0) == 0
        assert torch.equal(vae.decode(latents), expected)  # handed back
    assert relative(got, expected) < 1e-5, relative(got, expected)


@needs_triton
def test_causal_conv_equals_conv1d_in_the_triton_interpreter():
    run_in_interpreter("tests.test_conv_kernel", "check_causal_conv")


@needs_triton
def test_decoder_with_kernel_convs_equals_the_torch_decoder_in_the_triton_interpreter():
    run_in_interpreter("tests.test_conv_kernel", "check_decoder_with_kernel_convs")
