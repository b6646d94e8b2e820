"""Which fast paths a loaded pipeline runs: one frozen object, resolved once at load time.

Every fast path changes how the pipeline computes, not what: a hand-written kernel in place of a module's torch
form, compiled code, CUDA graph replays, a second CUDA stream. ``FastPaths.resolve`` decides each from the deploy
config (``enforce_eager``, the thinker's ``compilation_config``, ``disabled_fast_paths``), the device and the
precision, asking each kernel module's ``available`` probe; ``FastPaths.reference()`` is the plain torch path
(tests, the CPU). ``wiring.wire`` applies the object to the loaded modules.

The device and the precision themselves are resolved here too: ``resolve_device`` and ``resolve_precision`` read
the deploy config's stage 1 ``devices`` and ``dtype``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from auk_worker.deploy import DeployConfig
from auk_worker.errors import ConfigError
from auk_worker.model.dit.kernels import attention_inputs, modulated_norm, position_conv, varlen_attention
from auk_worker.model.fp8 import fp8_supported
from auk_worker.model.vae.kernels import cuda_activation, narrow_conv, triton_activation, upsample

Precision = Literal["exact", "fast", "fp8"]


def resolve_device(devices: str) -> torch.device:
    """The deploy config's first device index on CUDA, or the CPU where there is no CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(devices.split(",")[0]))
    return torch.device("cpu")


def precision_dtype(precision: Precision) -> torch.dtype:
    """The dtype the DiT and the thinker are held in (``fp8`` converts some DiT linears further, in the wiring)."""
    return torch.float32 if precision == "exact" else torch.bfloat16


def resolve_precision(setting: str, device: torch.device) -> Precision:
    if setting == "float32":
        return "exact"
    if setting == "bfloat16":
        return "fast"
    if setting == "float8":
        return "fp8"
    return "fast" if device.type == "cuda" else "exact"


@dataclass(frozen=True)
class FastPaths:
    """One switch per fast path; the field names are the ones ``disabled_fast_paths`` takes (``deploy.FAST_PATHS``).

    All off is the plain torch path. A path listed as needing another is off without it."""

    # The DiT's kernels (half precision on a GPU, whatever enforce_eager says)
    varlen_attention: bool = False  # masked batches attend over each row's visible keys (FlashAttention's kernel)
    attention_kernel: bool = False  # the hand-written variable-length kernel in its place; needs varlen_attention
    attention_inputs: bool = False  # q, k, v from the qkv projection in one kernel (norms, rotary, key order)
    modulated_norm: bool = False  # the blocks' adaptive norms, with the gated residual before them, as kernels
    position_conv: bool = False  # the audio embedding's position convolutions as kernels
    # The DiT's graph path (CUDA, stage 1 not enforce_eager)
    compiled_blocks: bool = False  # regional torch.compile of the blocks' phases; needs step_graphs
    step_graphs: bool = False  # a guided Euler step replayed from a CUDA graph per shape
    text_stream: bool = False  # the double blocks' text stream on a second CUDA stream; needs step_graphs
    fp8: bool = False  # the block linears in E4M3 (the fp8 precision)
    # The VAE (CUDA, stage 1 not enforce_eager)
    cuda_activation: bool = False  # the anti-aliased activations as the CUDA C++ kernel; needs triton_activation
    triton_activation: bool = False  # ... as the Triton kernel
    compiled_activation: bool = False  # ... as one torch.compile of the polyphase form, where no kernel runs
    narrow_conv: bool = False  # the decoder's narrow causal convolutions as a kernel (TF32: not the exact precision)
    upsampler: bool = False  # the decoder's causal upsamplers as a product and an overlap-add kernel
    decode_graphs: bool = False  # the decoder replayed from a CUDA graph per latent length
    encode_graphs: bool = False  # the reference encode replayed from a CUDA graph per whole second
    branch_streams: bool = False  # a decoder stage's AMP blocks side by side on CUDA streams; needs decode_graphs
    encode_stream: bool = False  # the reference encode on its own CUDA stream, beside the thinker (CUDA)
    # The thinker (CUDA, stage 0 not enforce_eager)
    thinker_graphs: bool = False  # the text model and fusion replayed from CUDA graphs (cudagraph_mode, sizes)
    thinker_compile: bool = False  # torch.compile of the decoder layer and the audio tower's layer (mode 1-3)
    audio_tower_graphs: bool = False  # the audio tower replayed from a CUDA graph per chunk count
    log_mel_graphs: bool = False  # a reference clip's log-mel features replayed from a CUDA graph per second

    @classmethod
    def reference(cls) -> FastPaths:
        """Every fast path off: the plain torch path."""
        return cls()

    @property
    def names_on(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name))

    @classmethod
    def resolve(cls, deploy: DeployConfig, device: torch.device, precision: Precision, dim_head: int) -> FastPaths:
        """Every fast path that ``deploy`` leaves on and that runs on ``device`` at ``precision`` (the DiT's
        attention kernels also depend on its head width ``dim_head``). Raises a ConfigError for the fp8
        precision on a device without FP8 matrix products."""
        dtype = precision_dtype(precision)
        probes = {
            "varlen_attention": lambda: varlen_attention.flash_available(device, dtype, dim_head),
            "attention_kernel": lambda: varlen_attention.available(device, dtype, dim_head),
            "attention_inputs": lambda: attention_inputs.available(device, dtype, dim_head),
            "modulated_norm": lambda: modulated_norm.available(device, dtype),
            "position_conv": lambda: position_conv.available(device, dtype),
            "triton_activation": lambda: triton_activation.available(device),
            "cuda_activation": lambda: cuda_activation.available(device),  # builds the kernel: asked only if wanted
            "narrow_conv": lambda: narrow_conv.available(device),
            "upsampler": lambda: upsample.available(device),
        }
        fast = cls.choose(deploy, precision, device.type == "cuda", probes)
        if fast.fp8 and not fp8_supported(device):
            what = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            raise ConfigError(f"fp8 precision needs a GPU of compute capability 8.9 or later (Ada, Hopper), "
                              f"not {what}")  # fmt: skip
        return fast

    @classmethod
    def choose(
        cls, deploy: DeployConfig, precision: Precision, cuda: bool, probes: Mapping[str, Callable[[], bool]]
    ) -> FastPaths:
        """The rules of :meth:`resolve`, given whether the device is a CUDA GPU and each kernel's probe (called
        only where the kernel is wanted)."""
        off = set(deploy.disabled_fast_paths)

        def wanted(name: str, condition: bool = True) -> bool:
            return condition and name not in off

        def kernel(name: str, condition: bool = True) -> bool:
            return wanted(name, condition) and probes[name]()

        stage1 = cuda and not deploy.dit.enforce_eager
        stage0 = cuda and not deploy.encoder.enforce_eager
        compilation = deploy.encoder.compilation_config
        thinker_graphs = stage0 and compilation.cudagraph_mode != "NONE" and bool(compilation.cudagraph_capture_sizes)
        varlen = kernel("varlen_attention")
        step_graphs = wanted("step_graphs", stage1)
        triton = kernel("triton_activation", stage1)
        decode_graphs = wanted("decode_graphs", stage1)
        return cls(
            varlen_attention=varlen,
            attention_kernel=kernel("attention_kernel", varlen),
            attention_inputs=kernel("attention_inputs"),
            modulated_norm=kernel("modulated_norm"),
            position_conv=kernel("position_conv"),
            compiled_blocks=wanted("compiled_blocks", step_graphs),
            step_graphs=step_graphs,
            text_stream=wanted("text_stream", step_graphs),
            fp8=wanted("fp8", precision == "fp8"),
            cuda_activation=kernel("cuda_activation", triton),
            triton_activation=triton,
            compiled_activation=wanted("compiled_activation", stage1 and not triton),
            narrow_conv=kernel("narrow_conv", stage1 and precision != "exact"),
            upsampler=kernel("upsampler", stage1),
            decode_graphs=decode_graphs,
            encode_graphs=wanted("encode_graphs", stage1),
            branch_streams=wanted("branch_streams", decode_graphs),
            encode_stream=wanted("encode_stream", cuda),
            thinker_graphs=wanted("thinker_graphs", thinker_graphs),
            thinker_compile=wanted("thinker_compile", stage0 and compilation.mode > 0),
            audio_tower_graphs=wanted("audio_tower_graphs", thinker_graphs),
            log_mel_graphs=wanted("log_mel_graphs", thinker_graphs),
        )
