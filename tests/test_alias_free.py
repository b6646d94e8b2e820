"""The alias-free activation's polyphase form and its Triton kernel against the convolution form.

The polyphase form must reproduce the convolutions' edges exactly (replicate padding, the crop of 15, causal or
centred decimation, odd and tiny lengths) and read its taps from the checkpoint's filter buffers. Compiled (the
pipeline's fallback where Triton is missing), one compilation must serve every width and length: one activation
goes through inductor here, the decoder through dynamo's tracing alone. The kernel runs in Triton's CPU
interpreter here and compiled in tests/test_gpu.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from auk_worker.model.vae.alias_free import (
    PHASE_PAD,
    PHASE_TAPS,
    TAPS,
    AliasFreeActivation,
    activation_span,
    compile_fused_activations,
    use_fused_activations,
)
from auk_worker.model.vae import AuKVAE, VAEConfig
from tests.test_vae import TINY, latents, random_vae
from tests.triton_interpreter import needs_triton, run_in_interpreter

LENGTHS = [*range(1, 34), 64, 101, 256]
# The decoder's structure (stages of a transposed conv and AMP blocks, activation_post, conv_post) at a size that
# traces in seconds: 2 stages of one k3 block with dilations 1 and 3.
MINI = VAEConfig(
    downsample_rate=4,
    upsample_rates=(2, 2),
    upsample_kernel_sizes=(4, 4),
    upsample_initial_channel=8,
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1, 3),),
    downsample_rates=(2, 2),
    downsample_channels=(12, 12, 12),
)


def activation(causal: bool, logscale: bool, channels: int = 3, seed: int = 0) -> AliasFreeActivation:
    torch.manual_seed(seed)
    act = AliasFreeActivation(channels, logscale, causal)
    with torch.no_grad():
        if logscale:
            act.act.alpha.normal_(std=0.5)
            act.act.beta.normal_(std=0.5)
        else:
            act.act.alpha.uniform_(0.5, 2.0)
            act.act.beta.uniform_(0.5, 2.0)
    return act.eval().requires_grad_(False)


def both_paths(act: AliasFreeActivation, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(convolution path, polyphase path) of the same module on ``x``."""
    act.fused = False
    reference = act(x)
    act.fused = True
    fused = act(x)
    act.fused = False
    return reference, fused


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ----------------------------------------------------------------------------------------------- polyphase


def test_phase_table_splits_the_taps_between_two_phases():
    even, odd = PHASE_TAPS
    assert [k for k, _ in even] == [1, 3, 5, 7, 9, 11] and [k for k, _ in odd] == [0, 2, 4, 6, 8, 10]
    assert [o for _, o in even] == [2, 1, 0, -1, -2, -3] and [o for _, o in odd] == [3, 2, 1, 0, -1, -2]
    assert PHASE_PAD == (3, 3)


@pytest.mark.parametrize("logscale", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_polyphase_equals_the_convolutions(causal: bool, logscale: bool):
    act = activation(causal, logscale)
    generator = torch.Generator().manual_seed(1)
    for t in LENGTHS:
        x = torch.randn(2, 3, t, generator=generator)
        reference, fused = both_paths(act, x)
        assert fused.shape == reference.shape == (2, 3, t)
        assert relative(fused, reference) < 1e-6, t


def test_polyphase_edges_with_a_step_and_a_constant():
    """Replicate padding: a constant passes through the linear parts unchanged; a step's edges stay exact."""
    act = activation(causal=True, logscale=True)
    constant = torch.full((1, 3, 7), 0.7)
    reference, fused = both_paths(act, constant)
    assert relative(fused, reference) < 1e-6
    torch.testing.assert_close(fused, act.act(constant), rtol=1e-6, atol=1e-6)  # DC gain 1 both ways
    step = torch.cat([torch.full((1, 3, 4), -1.0), torch.full((1, 3, 5), 2.0)], dim=-1)
    for causal in (True, False):
        reference, fused = both_paths(activation(causal, logscale=True), step)
        assert relative(fused, reference) < 1e-6


def test_polyphase_reads_the_filter_buffers():
    """Changed taps change both paths alike: the polyphase form bakes in no copy of the filter."""
    act = activation(causal=True, logscale=True)
    x = torch.randn(2, 3, 23, generator=torch.Generator().manual_seed(2))
    before = both_paths(act, x)[1]
    with torch.no_grad():
        act.upsample.filter.mul_(torch.linspace(0.8, 1.2, TAPS))
        act.downsample.lowpass.filter.mul_(torch.linspace(1.2, 0.8, TAPS))  # the taps are symmetric
    reference, fused = both_paths(act, x)
    assert relative(fused, reference) < 1e-6
    assert relative(fused, before) > 1e-3


@pytest.mark.parametrize("causal", [True, False])
def test_activation_span_is_what_the_polyphase_form_reads(causal: bool):
    """Perturbing input j moves output u exactly when j lies in activation_span(u, u)."""
    act = activation(causal, logscale=True, channels=1)
    act.fused = True
    t, u = 40, 20
    x = torch.randn(1, 1, t, generator=torch.Generator().manual_seed(3))
    base = act(x)[0, 0, u]
    moved = []
    for j in range(t):
        bumped = x.clone()
        bumped[..., j] += 0.5
        if act(bumped)[0, 0, u] != base:
            moved.append(j)
    lo, hi = activation_span(u, u, causal)
    assert moved == list(range(lo, hi + 1))


def test_switch_defaults_off_and_keeps_the_checkpoint_keys():
    model = AuKVAE(TINY)
    activations = [m for m in model.modules() if isinstance(m, AliasFreeActivation)]
    assert not any(m.fused for m in activations)
    keys = set(model.state_dict())
    assert use_fused_activations(model) == len(activations) == 18 * 6 + 1
    assert all(m.fused for m in activations)
    assert set(model.state_dict()) == keys
    assert "resblocks.3.activations.2.upsample.filter" in keys
    assert "activation_post.downsample.lowpass.filter" in keys
    use_fused_activations(model, False)
    assert not any(m.fused for m in activations)


def test_fused_decoder_equals_the_convolution_decoder():
    vae = random_vae()
    z = latents(6)
    reference = vae.decode(z)
    use_fused_activations(vae)
    fused = vae.decode(z)
    assert relative(fused, reference) < 1e-5


# ----------------------------------------------------------------------------------------------- compiled


def mini_vae() -> AuKVAE:
    torch.manual_seed(0)
    model = AuKVAE(MINI)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".alpha", ".beta")):
                param.normal_(std=0.2)
    return model.eval().requires_grad_(False)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_fuses_the_activation_without_recompiling():
    torch._dynamo.reset()
    act = activation(causal=True, logscale=True, channels=4)
    x, y = torch.randn(1, 4, 50), torch.randn(1, 4, 77)
    expected = act(x), act(y)
    act.fused = True
    compiled = torch.compile(act, dynamic=True, fullgraph=True)
    first = compiled(x)
    with torch.compiler.set_stance("fail_on_recompile"):
        second = compiled(y)
    assert relative(first, expected[0]) < 1e-6 and relative(second, expected[1]) < 1e-6


def test_compiled_activations_serve_every_width_and_length_with_one_compilation():
    """Dynamo's tracing only (backend "eager"): the start-up-friendly alternative to compiling the whole decoder.
    One compilation serves activations of every width (more widths than dynamo's recompile limit of 8) and
    length; the release decoder has six widths, 768 down to 24."""
    torch._dynamo.reset()
    vae = mini_vae()
    short, long = latents(9), latents(14, seed=2)
    expected = vae.decode(short), vae.decode(long)
    assert compile_fused_activations(vae, backend="eager") == sum(
        isinstance(m, AliasFreeActivation) for m in vae.modules()
    )
    first = vae.decode(short)
    widths = [activation(causal=True, logscale=True, channels=c, seed=c) for c in (2, 3, 5, 7, 11, 13, 17, 19, 23)]
    inputs = [torch.randn(1, act.act.alpha.numel(), 20 + i) for i, act in enumerate(widths)]
    eager = [act(x) for act, x in zip(widths, inputs)]
    with torch.compiler.set_stance("fail_on_recompile"):
        second = vae.decode(long)
        use_fused_activations(torch.nn.ModuleList(widths), True, vae.activation_post.polyphase_fn)  # the same compiled fn
        compiled = [act(x) for act, x in zip(widths, inputs)]
    assert relative(first, expected[0]) < 1e-5 and relative(second, expected[1]) < 1e-5
    assert all(relative(c, e) < 1e-6 for c, e in zip(compiled, eager))


def check_fused_kernel() -> None:
    """The one-kernel activation against the convolution path: edges, short and odd lengths, both decimator
    alignments, log-scale and plain parameters; rows long enough for blocks inside them (813: the second and
    third of four blocks), which skip the edge handling and give the same bits as with it. Run in a process with
    TRITON_INTERPRET=1 (see below)."""
    from auk_worker.model.vae.kernels.triton_activation import fused_activation

    for causal in (True, False):
        for logscale in (True, False):
            act = activation(causal, logscale, channels=3, seed=4)
            lowpass = act.downsample.lowpass
            for t in (1, 2, 3, 7, 13, 300, 257 + 256, 3 * 256 + 45):
                x = torch.randn(2, 3, t, generator=torch.Generator().manual_seed(t))
                reference = act(x)
                args = (x, act.act.alpha, act.act.beta, act.upsample.filter, lowpass.filter, logscale, lowpass.pad)
                out = fused_activation(*args)
                assert out.shape == reference.shape
                assert relative(out, reference) < 1e-6, (causal, logscale, t, relative(out, reference))
                assert torch.equal(out, fused_activation(*args, interior=False)), (causal, logscale, t)
    # A slice along time (the causal upsampler's trimmed output) read in place, and the zeros a causal conv reads
    # written in front of the output.
    act = activation(True, True, channels=3, seed=5)
    lowpass = act.downsample.lowpass
    untrimmed = torch.randn(2, 3, 300 + 4, generator=torch.Generator().manual_seed(1))
    x = untrimmed[..., :300]
    for left_pad in (0, 2, 50):
        fused = fused_activation(
            x, act.act.alpha, act.act.beta, act.upsample.filter, lowpass.filter, True, lowpass.pad, left_pad
        )
        reference = act(x.contiguous(), left_pad)
        assert fused.shape == reference.shape == (2, 3, left_pad + 300)
        assert torch.equal(fused[..., :left_pad], torch.zeros(2, 3, left_pad))
        assert relative(fused, reference) < 1e-6, (left_pad, relative(fused, reference))
    # The CUDA kernel's entry point hands what it does not take (here: tensors off the GPU) to this kernel.
    from auk_worker.model.vae.kernels import cuda_activation

    args = (x, act.act.alpha, act.act.beta, act.upsample.filter, lowpass.filter, True, lowpass.pad, 2)
    assert torch.equal(cuda_activation.fused_activation(*args, min_blocks=0), fused_activation(*args))


@needs_triton
def test_fused_kernel_equals_the_convolutions_in_the_triton_interpreter():
    """``alias_free_kernel`` run by Triton's CPU interpreter, which is chosen when the kernels are defined: so in
    a process of its own. tests/test_gpu.py runs the compiled kernel on a GPU."""
    run_in_interpreter("tests.test_alias_free", "check_fused_kernel")
