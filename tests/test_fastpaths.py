"""The fast-path seam: the deploy config names every fast path, the resolver's rules (what a GPU gets, what
``enforce_eager``, the precision and ``disabled_fast_paths`` take away, what needs what), and the wiring's slots.
A GPU is simulated by the resolver's probes; the GPU tests run the real ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from auk_worker.deploy import FAST_PATHS, load_deploy_config, parse_deploy_config
from auk_worker.errors import ConfigError
from auk_worker.model.dit import DiTKernels
from auk_worker.model.dit.kernels import attention_inputs, modulated_norm, position_conv, varlen_attention
from auk_worker.model.vae import AuKVAE, VAEConfig
from auk_worker.model.vae.alias_free import AliasFreeActivation, polyphase_activation
from auk_worker.model.vae.kernels import narrow_conv, triton_activation, upsample
from auk_worker.model.vae.vae import PaddedConv1d, UpsampleConv
from auk_worker.pipeline import FastPaths
from auk_worker.pipeline.wiring import dit_kernels, wire_vae_kernels

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ("varlen_attention", "attention_kernel", "attention_inputs", "modulated_norm", "position_conv",
           "triton_activation", "cuda_activation", "narrow_conv", "upsampler")  # fmt: skip


def deploy(disabled: tuple[str, ...] = (), dit_eager: bool = False, thinker_eager: bool = False, mode: int = 3):
    config = load_deploy_config()
    compilation = dataclasses.replace(config.encoder.compilation_config, mode=mode)
    encoder = dataclasses.replace(config.encoder, enforce_eager=thinker_eager, compilation_config=compilation)
    dit = dataclasses.replace(config.dit, enforce_eager=dit_eager)
    return dataclasses.replace(config, stages=(encoder, dit), disabled_fast_paths=disabled)


def on_a_gpu(config, precision: str = "fast", supported: tuple[str, ...] = KERNELS, asked: list | None = None):
    """The resolver's choice on a simulated GPU where the kernels in ``supported`` run."""
    def probe(name: str):
        return lambda: (asked.append(name) if asked is not None else None) or name in supported

    return FastPaths.choose(config, precision, True, {name: probe(name) for name in KERNELS})


def test_the_deploy_config_names_every_fast_path():
    assert tuple(f.name for f in dataclasses.fields(FastPaths)) == FAST_PATHS


@pytest.mark.parametrize("name", ["auk.yaml", "auk-flash.yaml", "auk-bulk.yaml"])
def test_shipped_configs_disable_nothing(name):
    assert load_deploy_config(ROOT / "config" / name).disabled_fast_paths == ()


def test_a_fast_path_is_turned_off_by_name_and_an_unknown_name_is_refused():
    raw = yaml.safe_load((ROOT / "config" / "auk.yaml").read_text())
    assert parse_deploy_config({**raw, "disabled_fast_paths": ["attention_kernel"]}).disabled_fast_paths == (
        "attention_kernel",
    )
    with pytest.raises(ConfigError, match=r"disabled_fast_paths: unknown fast path\(s\) warp_drive \(known: "
                                          r"varlen_attention, attention_kernel, .*, log_mel_graphs\)"):  # fmt: skip
        parse_deploy_config({**raw, "disabled_fast_paths": ["attention_kernel", "warp_drive"]})


def test_the_cpu_runs_the_plain_torch_path():
    cpu = torch.device("cpu")
    for precision in ("exact", "fast"):
        assert FastPaths.resolve(load_deploy_config(), cpu, precision, 16) == FastPaths.reference() == FastPaths()
    assert FastPaths.resolve(load_deploy_config(), cpu, "fp8", 16) == FastPaths(fp8=True)  # the CPU multiplies E4M3
    assert FastPaths.resolve(deploy(disabled=("fp8",)), cpu, "fp8", 16) == FastPaths.reference()
    assert dit_kernels(FastPaths.reference()) == DiTKernels()


def test_a_gpu_that_runs_every_kernel_gets_every_fast_path():
    fast = on_a_gpu(deploy())
    assert fast.names_on == tuple(name for name in FAST_PATHS if name not in ("fp8", "compiled_activation"))
    assert on_a_gpu(deploy(), "fp8").fp8
    assert not on_a_gpu(deploy(), "exact").narrow_conv  # its products are TF32
    without_triton = on_a_gpu(deploy(), supported=("varlen_attention", "narrow_conv"))
    assert without_triton.compiled_activation and not without_triton.cuda_activation
    assert not without_triton.attention_kernel and without_triton.varlen_attention


def test_a_disabled_path_takes_what_needs_it_along():
    fast = on_a_gpu(deploy(disabled=("varlen_attention", "triton_activation", "step_graphs", "decode_graphs")))
    assert not (fast.varlen_attention or fast.attention_kernel)  # the hand-written kernel serves variable-length calls
    assert not (fast.triton_activation or fast.cuda_activation)  # the CUDA kernel hands small calls to Triton's
    assert fast.compiled_activation  # where no activation kernel runs
    assert not (fast.step_graphs or fast.compiled_blocks or fast.text_stream)
    assert not (fast.decode_graphs or fast.branch_streams)
    assert fast.attention_inputs and fast.encode_graphs and fast.thinker_graphs
    one = on_a_gpu(deploy(disabled=("attention_kernel",)))
    assert one.varlen_attention and not one.attention_kernel  # FlashAttention's kernel in its place
    assert dataclasses.replace(one, attention_kernel=True) == on_a_gpu(deploy())


def test_enforce_eager_and_the_thinkers_compilation_config_keep_their_meaning():
    dit_eager = on_a_gpu(deploy(dit_eager=True))
    assert dit_eager.varlen_attention and dit_eager.modulated_norm and dit_eager.position_conv  # kernels stay
    assert not any(getattr(dit_eager, name) for name in (
        "step_graphs", "compiled_blocks", "text_stream", "triton_activation", "cuda_activation", "compiled_activation",
        "narrow_conv", "upsampler", "decode_graphs", "encode_graphs", "branch_streams"))  # fmt: skip
    assert dit_eager.encode_stream and dit_eager.thinker_graphs
    thinker_eager = on_a_gpu(deploy(thinker_eager=True))
    assert not any(getattr(thinker_eager, name) for name in (
        "thinker_graphs", "thinker_compile", "audio_tower_graphs", "log_mel_graphs"))  # fmt: skip
    assert thinker_eager.step_graphs
    assert not on_a_gpu(deploy(mode=0)).thinker_compile and on_a_gpu(deploy(mode=0)).thinker_graphs
    no_graphs = dataclasses.replace(deploy().encoder.compilation_config, cudagraph_mode="NONE")
    config = deploy()
    config = dataclasses.replace(config, stages=(dataclasses.replace(config.encoder, compilation_config=no_graphs),
                                                 config.dit))  # fmt: skip
    fast = on_a_gpu(config)
    assert fast.thinker_compile and not (fast.thinker_graphs or fast.audio_tower_graphs or fast.log_mel_graphs)


def test_a_kernel_is_probed_only_where_it_is_wanted():
    """The CUDA activation's probe builds the kernel: a deploy config that turns it off, or runs stage 1 eager,
    never asks for it."""
    for config in (deploy(disabled=("cuda_activation",)), deploy(dit_eager=True)):
        asked: list[str] = []
        on_a_gpu(config, asked=asked)
        assert "cuda_activation" not in asked


def test_the_dit_kernel_table_follows_the_fast_paths():
    assert dit_kernels(on_a_gpu(deploy())) == DiTKernels(
        varlen_attention=varlen_attention.flash_varlen_attention,
        attention_kernel=varlen_attention.varlen_attention,
        attention_inputs=attention_inputs.attention_inputs,
        modulated_norm=modulated_norm.modulated_norm,
        gated_residual_norm=modulated_norm.gated_residual_norm,
        position_conv=position_conv.position_conv,
    )
    assert dit_kernels(on_a_gpu(deploy(disabled=("modulated_norm",)))).gated_residual_norm is None


def test_the_vae_kernel_slots_are_set_and_put_back():
    """Wiring sets each slot from the fast paths (no kernel runs here), and the reference puts the torch form
    back: the convolution activations, torch's convolutions and upsamplers."""
    config = VAEConfig(upsample_initial_channel=64, downsample_channels=(12, 12, 12, 12, 16, 16, 16))
    vae = AuKVAE(config).eval()
    activations = [m for m in vae.modules() if isinstance(m, AliasFreeActivation)]
    upsamplers = [m for m in vae.modules() if isinstance(m, UpsampleConv)]
    fast = FastPaths(triton_activation=True, narrow_conv=True, upsampler=True)
    assert wire_vae_kernels(vae, fast) == ("activations: triton kernel; 108 narrow convolutions on the Triton kernel; "
                                           "6 upsamplers as a product and an overlap-add")  # fmt: skip
    assert all(m.fused and m.polyphase_fn is triton_activation.fused_activation for m in activations)
    assert all(m.kernel is upsample.causal_upsample for m in upsamplers)
    on_kernel = [m for m in vae.modules() if isinstance(m, PaddedConv1d) and m.kernel is not None]
    assert len(on_kernel) == 6 * 18 and all(m.kernel is narrow_conv.causal_conv for m in on_kernel)
    assert wire_vae_kernels(vae, FastPaths.reference()).startswith("activations: convolutions; 0 narrow")
    assert not any(m.fused for m in activations) and all(m.polyphase_fn is polyphase_activation for m in activations)
    assert all(m.kernel is None for m in vae.modules() if isinstance(m, (PaddedConv1d, UpsampleConv)))
    assert all(m.fast_weight is None for m in vae.modules() if isinstance(m, PaddedConv1d))
