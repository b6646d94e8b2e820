"""The one place a ``FastPaths`` is applied to loaded modules.

``wire`` gives the DiT its kernel table, sets the VAE modules' kernel slots, swaps the fp8 linears, compiles the
blocks and the thinker's layers, creates the CUDA streams and the graph runners, and returns what the pipeline
holds (``Accelerated``). Each slot is set whether its path is on or off; what it cannot take back (fp8 linears,
compiled code) it only ever switches on.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from auk_worker.deploy import DeployConfig
from auk_worker.model.dit import AuKDiT, DiTKernels
from auk_worker.model.dit.blocks import PLAIN_PHASES
from auk_worker.model.dit.kernels import attention_inputs, modulated_norm, position_conv, varlen_attention
from auk_worker.model.fp8 import use_fp8_block_linears
from auk_worker.model.thinker import ThinkerEncoder
from auk_worker.model.thinker.audio_tower import AudioTowerRunner
from auk_worker.model.thinker.prompt import SAMPLE_RATE as THINKER_SAMPLE_RATE
from auk_worker.model.vae import AuKVAE
from auk_worker.model.vae.alias_free import compile_fused_activations, use_fused_activations
from auk_worker.model.vae.kernels import cuda_activation, narrow_conv, triton_activation, upsample
from auk_worker.model.vae.vae import use_conv_kernel, use_upsample_kernel
from auk_worker.pipeline.fastpaths import FastPaths
from auk_worker.pipeline.graphs import DecodeGraphs, EncodeGraphs, StepGraphs
from auk_worker.pipeline.thinker_graphs import AudioTowerGraphs, EncoderGraphs, LogMelGraphs
from auk_worker.types import SAMPLE_RATE

log = logging.getLogger(__name__)

# cuBLAS handles without a workspace. With one, cuBLAS picks for some of the DiT's shapes (the single blocks'
# feed-forward input at 12 s zero-shot, every block linear of a bulk pass) a persistent kernel that needs a zeroed
# 4-byte counter: a memset node before each such product in the step graph, with idle GPU around it. Without a
# workspace it runs the same tiles statically scheduled, no memset. torch reads both variables once, at the
# process's first matrix product on a GPU.
CUBLAS_WITHOUT_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
# Compilations a block phase may hold. Dynamo compiles a phase again for each layout the graph path meets: padded
# audio, text or keys present or not, one row or several, the precision's module types, the kernels a layout runs.
# These multiply past dynamo's default of 8, and with ``fullgraph`` the ninth raises inside a job instead of
# falling back.
BLOCK_COMPILATIONS = 64


@dataclass(frozen=True)
class Accelerated:
    """What the pipeline holds of its fast paths: the graph runners (None: that stage runs eager) and the stream a
    reference clip's VAE encode runs on (None: the current stream)."""

    step_graphs: StepGraphs | None = None
    decode_graphs: DecodeGraphs | None = None
    encode_graphs: EncodeGraphs | None = None
    encode_stream: torch.cuda.Stream | None = None


def cublas_without_workspace() -> dict[str, str]:
    """Ask for cuBLAS handles without a workspace where the environment does not say otherwise; returns the two
    settings now in the environment. Call before the process's first matrix product on the GPU (``wire`` does):
    torch keeps the workspace size it read then."""
    for name, value in CUBLAS_WITHOUT_WORKSPACE.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in CUBLAS_WITHOUT_WORKSPACE}


def compile_dit_blocks(dit: AuKDiT, dynamic: bool = True, backend: str = "inductor") -> None:
    """Regional ``torch.compile`` of the repeated blocks: each block phase (``BlockPhases``) is compiled once and
    serves every block. Dynamic shapes: one compilation serves every sequence length, so a new shape costs a
    capture, not a recompile."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, BLOCK_COMPILATIONS)
    dit.phases = PLAIN_PHASES.compiled(fullgraph=True, dynamic=dynamic, backend=backend)


def dit_kernels(fast: FastPaths) -> DiTKernels:
    """The DiT's kernel table for ``fast``: each kernel that is on, None (the torch form) where it is off."""
    return DiTKernels(
        varlen_attention=varlen_attention.flash_varlen_attention if fast.varlen_attention else None,
        attention_kernel=varlen_attention.varlen_attention if fast.attention_kernel else None,
        attention_inputs=attention_inputs.attention_inputs if fast.attention_inputs else None,
        modulated_norm=modulated_norm.modulated_norm if fast.modulated_norm else None,
        gated_residual_norm=modulated_norm.gated_residual_norm if fast.modulated_norm else None,
        position_conv=position_conv.position_conv if fast.position_conv else None,
    )


def wire_vae_kernels(vae: AuKVAE, fast: FastPaths) -> str:
    """Set the VAE modules' kernel slots for ``fast``: the activations, narrow convolutions and upsamplers.
    Returns what runs, for the log."""
    if fast.cuda_activation:  # it hands the calls it does not take to the Triton kernel
        use_fused_activations(vae, True, cuda_activation.fused_activation)
        activations = "CUDA kernel (calls of fewer blocks than multiprocessors on the Triton kernel)"
    elif fast.triton_activation:
        use_fused_activations(vae, True, triton_activation.fused_activation)
        activations = "triton kernel"
    elif fast.compiled_activation:
        compile_fused_activations(vae)
        activations = "compiled polyphase"
    else:
        use_fused_activations(vae, False)
        activations = "convolutions"
    convs = use_conv_kernel(vae, narrow_conv.causal_conv if fast.narrow_conv else None, narrow_conv.MAX_WIDTH)
    upsamplers = use_upsample_kernel(vae, upsample.causal_upsample if fast.upsampler else None)
    return (f"activations: {activations}; {convs} narrow convolutions on the Triton kernel; "
            f"{upsamplers} upsamplers as a product and an overlap-add")  # fmt: skip


def wire_dit(fast: FastPaths, deploy: DeployConfig, dit: AuKDiT, device: torch.device) -> StepGraphs | None:
    """Apply ``fast`` to the DiT alone (fp8 linears, kernel table, text stream, compiled blocks); returns its step
    graph runner, or None when steps run eager. A CFG pair's follower wires its DiT with this too."""
    if fast.fp8:
        log.info("dit: %d block linears in fp8", use_fp8_block_linears(dit))
    if fast.step_graphs:
        log.info("cuBLAS: %s", cublas_without_workspace())
    dit.kernels = dit_kernels(fast)
    dit.text_stream = torch.cuda.Stream(device) if fast.text_stream else None  # beside the audio stream
    step_graphs = StepGraphs(dit, deploy.dit.model_config.max_dit_graphs) if fast.step_graphs else None
    if fast.compiled_blocks:
        compile_dit_blocks(dit)
    return step_graphs


def wire(
    fast: FastPaths, deploy: DeployConfig, encoder: ThinkerEncoder, dit: AuKDiT, vae: AuKVAE, device: torch.device
) -> Accelerated:
    """Apply ``fast`` to the loaded modules (in place) and build the graph runners; the graphs are captured later,
    at warm-up or on first use."""
    log.info("fast paths: %s", ", ".join(fast.names_on) or "none (the plain torch path)")
    encode_stream = torch.cuda.Stream(device) if fast.encode_stream else None
    model_config = deploy.dit.model_config
    step_graphs = wire_dit(fast, deploy, dit, device)
    log.info("vae: %s", wire_vae_kernels(vae, fast))
    encode_graphs = EncodeGraphs(vae, SAMPLE_RATE) if fast.encode_graphs else None
    branches = vae.blocks_per_stage - 1  # a stage's AMP blocks side by side, in every captured decode
    vae.branch_streams = [torch.cuda.Stream(device) for _ in range(branches)] if fast.branch_streams else None
    decode_graphs = DecodeGraphs(vae, model_config.auk_vae_max_graphs) if fast.decode_graphs else None
    compilation = deploy.encoder.compilation_config
    if fast.thinker_compile and encoder.compile_layers():
        log.info("thinker: decoder layer compiled (compilation_config.mode %d)", compilation.mode)
    encoder.graphs = EncoderGraphs(encoder, compilation.cudagraph_capture_sizes) if fast.thinker_graphs else None
    encoder.trunk.audio_runner = None
    if fast.audio_tower_graphs:  # one graph per chunk count of the reference clip (all captured at warm-up)
        audio_runner = AudioTowerRunner(encoder.trunk.audio_tower)
        if fast.thinker_compile:
            audio_runner.compile_layers()
            log.info("audio tower: encoder layer compiled (compilation_config.mode %d)", compilation.mode)
        encoder.trunk.audio_runner = AudioTowerGraphs(audio_runner)
    log_mel = LogMelGraphs(encoder.processor, encoder.device, THINKER_SAMPLE_RATE) if fast.log_mel_graphs else None
    encoder.processor.log_mel_graphs = log_mel
    return Accelerated(step_graphs, decode_graphs, encode_graphs, encode_stream)
