"""The deploy configuration (config/auk.yaml): a typed, strict loader and the fields the engine honours.

The YAML follows the two-stage layout the service was specified with (stage 0: the thinker encoder,
stage 1: DiT + VAE). Every field is parsed into a frozen dataclass; an unknown key or a bad value is a
ConfigError naming the field's path (``stages[1].model_config.max_dit_graphs``). Architecture never
lives here: layer counts come from the checkpoint's own config.yaml.

The sampling defaults live here and nowhere else: stage 1's ``default_sampling_params`` must state the seed, the
step count and the guidance scale (the loader names a missing one), and every request's unset knob takes them
(``rules.resolve_knobs``). Their bounds are the requests' own, from ``rules.py``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from auk_worker import rules
from auk_worker.errors import ConfigError

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "auk.yaml"

# The fast paths a deploy config can turn off by name (``disabled_fast_paths``): the fields of
# ``auk_worker.pipeline.fastpaths.FastPaths``, which says what each one is. Listed here, without torch, so that
# the config is checked where it is read.
FAST_PATHS = (
    "varlen_attention", "attention_kernel", "attention_inputs", "modulated_norm", "position_conv",
    "compiled_blocks", "step_graphs", "text_stream", "fp8",
    "cuda_activation", "triton_activation", "compiled_activation", "narrow_conv", "upsampler",
    "decode_graphs", "encode_graphs", "branch_streams", "encode_stream",
    "thinker_graphs", "thinker_compile", "audio_tower_graphs", "log_mel_graphs",
)  # fmt: skip


@dataclass(frozen=True)
class CompilationConfig:
    mode: int = 0  # 0: the thinker's layers run as written; 1-3: torch.compile of its decoder layer (CUDA)
    cudagraph_mode: Literal["NONE", "FULL", "PIECEWISE", "FULL_AND_PIECEWISE"] = "FULL"
    cudagraph_capture_sizes: tuple[int, ...] = (64, 128, 192, 256, 384, 512)  # prompt tokens


@dataclass(frozen=True)
class EncoderSampling:
    temperature: float = 0.0
    max_tokens: int = 1
    detokenize: bool = False
    seed: int = 0


@dataclass(frozen=True)
class EncoderStage:
    stage_id: int = 0
    devices: str = "0"
    max_num_seqs: int = 1
    gpu_memory_utilization: float = 0.45
    enforce_eager: bool = False
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    max_num_batched_tokens: int = 32768
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"audio": 1})
    default_sampling_params: EncoderSampling = field(default_factory=EncoderSampling)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"


@dataclass(frozen=True)
class DiTModelConfig:
    auk_vae_compile_shapes: tuple[int, ...] = (128, 256, 512)  # VAE decode buckets, latent frames
    auk_vae_tile_frames: int | None = None  # None: the largest bucket
    auk_vae_max_graphs: int = 32
    max_dit_graphs: int = 32  # DiT step graphs cached; a full cache is retired whole before a new capture
    auk_dit_warmup_frames: tuple[int, ...] = (150, 300, 600)  # target lengths captured at start-up
    auk_dit_batch_position_budget: int = 2048  # bulk batching: rows x longest row's positions


@dataclass(frozen=True)
class DiTSampling:
    """What a request's unset knobs take. The three the specified config states are required; sway, which it does
    not state, is the one field with a default: -1.0, the model's own sampler default (auk-model.md section 4), so a
    config copied from the specification renders the upstream recipe without gaining a field the specification lacks.
    """

    seed: int
    num_inference_steps: int
    guidance_scale: float
    sway: float = -1.0


# Stage 1 weights: auto (bf16 on CUDA, fp32 on the CPU), float32, bfloat16, or float8 (bf16 with E4M3 block linears).
DiTDtype = Literal["auto", "float32", "bfloat16", "float8"]


@dataclass(frozen=True)
class DiTStage:
    stage_id: int = 1
    devices: str = "0"
    max_num_seqs: int = 1  # jobs rendered together in one DiT pass (bulk queue)
    # 2: each guided step's conditional and unconditional halves on the two GPUs that ``devices`` names
    # (pipeline/cfg_parallel.py); 1: one GPU. Base (guided) renders only.
    cfg_parallel_size: int = 1
    gpu_memory_utilization: float = 0.35
    enforce_eager: bool = False
    model_config: DiTModelConfig = field(default_factory=DiTModelConfig)
    dtype: DiTDtype = "auto"
    default_sampling_params: DiTSampling = field(kw_only=True)  # required: the sampling defaults live here alone


@dataclass(frozen=True)
class DeployConfig:
    stages: tuple[EncoderStage, DiTStage]
    async_chunk: bool = False
    trust_remote_code: bool = True
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = False
    # Fast paths turned off by name (FAST_PATHS): the worker runs the plain form there, e.g. SDPA for attention.
    disabled_fast_paths: tuple[str, ...] = ()
    source: str = "<defaults>"

    @property
    def encoder(self) -> EncoderStage:
        return self.stages[0]

    @property
    def dit(self) -> DiTStage:
        return self.stages[1]

    @property
    def defaults(self) -> DiTSampling:
        return self.dit.default_sampling_params


# Pipeline-wide switches that must stay off, each with the reason the worker gives.
_MUST_BE_FALSE = {
    "enable_prefix_caching": "a prefix-cache hit skips prompt positions, and the fused [tokens, 2048] "
    "condition needs the hidden states of every position",
    "enable_chunked_prefill": "chunked prefill gains no wall time for a few-percent stage and breaks "
    "bit-exact reproducibility",
    "async_chunk": "the ODE runs over the whole target, so there is nothing to stream between the stages",
}


def load_deploy_config(path: str | Path | None = None) -> DeployConfig:
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read deploy config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"deploy config {path} is not valid YAML: {exc}") from None
    return parse_deploy_config(raw, source=str(path))


def parse_deploy_config(raw: Any, source: str = "<memory>") -> DeployConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the deploy config must be a mapping")
    raw = dict(raw)
    stages = raw.pop("stages", None)
    if not isinstance(stages, list) or len(stages) != 2:
        raise ConfigError(f"{source}: 'stages' must list exactly two stages (0: encoder, 1: DiT + VAE)")
    by_id = {}
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict) or stage.get("stage_id") not in (0, 1):
            raise ConfigError(f"{source}: stages[{i}].stage_id must be 0 or 1")
        by_id[stage["stage_id"]] = (i, stage)
    if set(by_id) != {0, 1}:
        raise ConfigError(f"{source}: stages must have stage_id 0 and 1 once each")
    encoder = _build(EncoderStage, by_id[0][1], f"stages[{by_id[0][0]}]")
    dit = _build(DiTStage, by_id[1][1], f"stages[{by_id[1][0]}]")
    top = _build_fields(DeployConfig, raw, "", skip={"stages", "source"})
    config = DeployConfig(stages=(encoder, dit), source=source, **top)
    _check(config)
    return config


def _check(config: DeployConfig) -> None:
    for name, reason in _MUST_BE_FALSE.items():
        if getattr(config, name):
            raise ConfigError(f"{name}: must be false ({reason})")
    unknown = sorted(set(config.disabled_fast_paths) - set(FAST_PATHS))
    if unknown:
        raise ConfigError(f"disabled_fast_paths: unknown fast path(s) {', '.join(unknown)} "
                          f"(known: {', '.join(FAST_PATHS)})")  # fmt: skip
    if config.encoder.limit_mm_per_prompt != {"audio": 1}:
        raise ConfigError("stages[0].limit_mm_per_prompt: AuK takes at most one audio clip: use {audio: 1}")
    for stage, where in ((config.encoder, "stages[0]"), (config.dit, "stages[1]")):
        if not 0.0 < stage.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"{where}.gpu_memory_utilization: must be in (0, 1], got {stage.gpu_memory_utilization}")
        if stage.max_num_seqs < 1:
            raise ConfigError(f"{where}.max_num_seqs: must be at least 1")
        if not all(part.strip().isdigit() for part in stage.devices.split(",")):
            raise ConfigError(f"{where}.devices: expected CUDA device indices like \"0\", got {stage.devices!r}")
    if config.dit.cfg_parallel_size not in (1, 2):
        raise ConfigError(f"stages[1].cfg_parallel_size: 1 or 2, got {config.dit.cfg_parallel_size}")
    dit_devices = [part.strip() for part in config.dit.devices.split(",")]
    if config.dit.cfg_parallel_size == 2 and (len(dit_devices) != 2 or dit_devices[0] == dit_devices[1]):
        raise ConfigError(f"stages[1].devices: cfg_parallel_size 2 needs two distinct GPUs like \"0,1\", "
                          f"got {config.dit.devices!r}")  # fmt: skip
    if config.encoder.devices == config.dit.devices:
        shared = config.encoder.gpu_memory_utilization + config.dit.gpu_memory_utilization
        if shared > 1.0:
            raise ConfigError(f"gpu_memory_utilization: stages sharing device {config.dit.devices} ask for {shared:.2f} > 1")
    if config.encoder.compilation_config.mode not in (0, 1, 2, 3):
        raise ConfigError(
            f"stages[0].compilation_config.mode: 0 (no compilation) or 1-3 (compile the thinker's decoder layer), "
            f"got {config.encoder.compilation_config.mode}"
        )
    sizes = config.encoder.compilation_config.cudagraph_capture_sizes
    if any(s <= 0 for s in sizes) or list(sizes) != sorted(set(sizes)):
        raise ConfigError("stages[0].compilation_config.cudagraph_capture_sizes: must be increasing positive sizes")
    mc = config.dit.model_config
    if not mc.auk_vae_compile_shapes or list(mc.auk_vae_compile_shapes) != sorted(set(mc.auk_vae_compile_shapes)):
        raise ConfigError("stages[1].model_config.auk_vae_compile_shapes: must be increasing positive frame counts")
    if any(s <= 0 for s in mc.auk_vae_compile_shapes):
        raise ConfigError("stages[1].model_config.auk_vae_compile_shapes: frame counts must be positive")
    if mc.max_dit_graphs < 1 or mc.auk_vae_max_graphs < 1:
        raise ConfigError("stages[1].model_config: max_dit_graphs and auk_vae_max_graphs must be at least 1")
    tile = mc.auk_vae_tile_frames
    if tile is not None and tile < 128:
        raise ConfigError(f"stages[1].model_config.auk_vae_tile_frames: {tile} leaves no room for the 62-frame halo")
    if config.encoder.default_sampling_params.max_tokens != 1:
        raise ConfigError("stages[0].default_sampling_params.max_tokens: must be 1 (the encoder runs one prefill forward)")
    for bound in (rules.SEED, rules.STEPS, rules.GUIDANCE, rules.SWAY):
        problem = bound.problem(getattr(config.defaults, bound.name))
        if problem is not None:
            raise ConfigError(f"stages[1].default_sampling_params.{bound.name}: {problem}")


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    return cls(**_build_fields(cls, raw, where))


def _build_fields(cls: type, raw: dict, where: str, skip: set[str] = frozenset()) -> dict:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip]
    known = {f.name for f in fields}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{_join(where, unknown[0])}: unknown field (known: {', '.join(sorted(known))})")
    for f in fields:
        if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{_join(where, f.name)}: required field missing")
    return {name: _coerce(hints[name], value, _join(where, name)) for name, value in raw.items()}


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: must be one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): _coerce(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported field type {hint}")


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
