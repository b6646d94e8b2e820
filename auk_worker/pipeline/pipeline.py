"""The render pipeline: both stages loaded once, then request after request with no further I/O.

    instruction (+ clip) ── stage 0: thinker + layer fusion ──▶ condition [1, nt, 2048]
    clip @24 kHz ── VAE encode ──▶ reference latents [1, np, 64]
    noise [1, n, 64] ── stage 1: Euler over the DiT (CFG for base) ──▶ latents ── VAE decode ──▶ waveform [n * 480]

Precision: ``exact`` keeps every weight in fp32 (the released export) and runs fp32 math; ``fast`` holds the DiT and
the thinker in bf16 while the VAE, the noise and the ODE state stay fp32. ``fp8`` (opt-in) is ``fast`` with the DiT's
block linears in E4M3 (``model/fp8.py``). The deploy config's ``dtype: auto`` picks ``fast`` on CUDA and ``exact``
on the CPU; ``float8`` picks ``fp8``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from auk_worker.accel import (
    DecodeGraphs,
    EncodeGraphs,
    EncoderGraphs,
    LogMelGraphs,
    StepGraphs,
    cublas_without_workspace,
)
from auk_worker import rules
from auk_worker.audio import THINKER_SAMPLE_RATE, checked_clip, resample, resampled_length
from auk_worker.checkpoint import Release, file_digest, load_strict, read_release, read_safetensors, split_dit_weights
from auk_worker.deploy import DeployConfig, load_deploy_config
from auk_worker.errors import AuKError, ConfigError, InputError, ModelError, OutOfMemory
from auk_worker.model.alias_free_kernel import use_fast_activations
from auk_worker.model.audio_tower import AudioTowerGraphs, AudioTowerRunner
from auk_worker.model.conv_kernel import use_fast_convs
from auk_worker.model.dit import AuKDiT
from auk_worker.model.encoder import ThinkerEncoder
from auk_worker.model.fp8 import fp8_supported, use_fp8_block_linears
from auk_worker.model.streams import beside
from auk_worker.model.sampling import (
    FLASH_T_GRID,
    euler_sample,
    guided_velocity,
    initial_noise,
    make_generator,
    needs_uncond,
    time_grid,
)
from auk_worker.model.upsample_kernel import use_fast_upsamplers
from auk_worker.model.vae import AuKVAE, load_vae, plan_tiles
from auk_worker.rules import MAX_SEED, MAX_TOTAL_FRAMES, MAX_TOTAL_SECONDS
from auk_worker.types import (
    FRAME_RATE,
    HOP,
    SAMPLE_RATE,
    AudioClip,
    RenderRequest,
    RenderResult,
)

log = logging.getLogger(__name__)

Precision = Literal["exact", "fast", "fp8"]
StepCallback = Callable[[int, int], None]

# Graph path buckets: padded (and masked) sizes, so that a handful of graph shapes serve every request.
TARGET_BUCKET = 25  # latent frames (0.5 s)
TEXT_BUCKET = 32  # prompt tokens
REF_BUCKET = 25  # reference frames

VAE_SEED_OFFSET = 0x5EED0A0C  # the posterior draw uses its own generator so it never moves the noise
WARM_UP_INSTRUCTION = (
    'Generate speech based on the following description: "A clear, natural voice." '
    'The content to speak is: "The quick brown fox jumps over the lazy dog."'
)


@dataclass(frozen=True)
class Schedule:
    """The resolved sampling knobs of one render."""

    grid: torch.Tensor  # [steps + 1] fp32 time points from 0 (noise) to 1 (data)
    guidance_scale: float
    seed: int

    @property
    def num_steps(self) -> int:
        return len(self.grid) - 1

    @property
    def key(self) -> tuple:
        """Jobs with equal keys can share a DiT pass."""
        return (tuple(self.grid.tolist()), self.guidance_scale)


def resolve_device(devices: str) -> torch.device:
    """The deploy config's first device index on CUDA, or the CPU where there is no CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(devices.split(",")[0]))
    return torch.device("cpu")


def precision_dtype(precision: Precision) -> torch.dtype:
    """The dtype the DiT and the thinker are held in (``fp8`` converts some DiT linears further, in the pipeline)."""
    return torch.float32 if precision == "exact" else torch.bfloat16


def resolve_precision(setting: str, device: torch.device) -> Precision:
    if setting == "float32":
        return "exact"
    if setting == "bfloat16":
        return "fast"
    if setting == "float8":
        return "fp8"
    return "fast" if device.type == "cuda" else "exact"


class AuKPipeline:
    """Both stages of AuK on one device. ``load`` once per process, then ``render`` many times."""

    def __init__(
        self,
        release: Release,
        deploy: DeployConfig,
        encoder: ThinkerEncoder,
        dit: AuKDiT,
        vae: AuKVAE,
        device: torch.device,
        precision: Precision,
        model_hashes: dict[str, str],
        compile_blocks: bool = True,
        vae_fast_paths: bool = True,
    ) -> None:
        self.release = release
        self.deploy = deploy
        self.encoder = encoder
        self.dit = dit
        self.vae = vae
        self.device = device
        self.precision = precision
        self.model_hashes = model_hashes
        if precision == "fp8":
            if not fp8_supported(device):
                what = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
                raise ConfigError(f"fp8 precision needs a GPU of compute capability 8.9 or later (Ada, Hopper), "
                                  f"not {what}")  # fmt: skip
            log.info("dit: %d block linears in fp8", use_fp8_block_linears(dit))
        self.startup: dict[str, float] = {"load": 0.0, "warm_up": 0.0}  # seconds
        model_config = deploy.dit.model_config
        self.vae_tile_frames = model_config.auk_vae_tile_frames or max(model_config.auk_vae_compile_shapes)
        # The reference clip's VAE encode runs on this stream, beside the thinker (None off CUDA).
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Resamples a reference clip for the thinker while the render's own thread prepares the VAE's copy.
        self._resampler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="auk-resample")
        self.step_graphs: StepGraphs | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.encode_graphs: EncodeGraphs | None = None
        if device.type == "cuda" and not deploy.dit.enforce_eager:
            log.info("cuBLAS: %s", cublas_without_workspace())
            self.step_graphs = StepGraphs(dit, model_config.max_dit_graphs, compile_blocks=compile_blocks)
            if vae_fast_paths:
                # Each anti-aliased activation runs as one fused kernel, and the reference encode replays a graph
                # per whole-second bucket (both exact to rounding; figures in bench/RESULTS.md).
                log.info("vae activations: %s", use_fast_activations(vae, device))
                if precision != "exact":  # the kernel's products are TF32, as cuDNN's are unless told otherwise
                    log.info("vae: %d narrow convolutions on the Triton kernel", use_fast_convs(vae, device))
                log.info("vae: %d upsamplers as a product and an overlap-add", use_fast_upsamplers(vae, device))
                self.encode_graphs = EncodeGraphs(vae, SAMPLE_RATE)
            self.decode_graphs = DecodeGraphs(vae, model_config.auk_vae_max_graphs)
        encoder.max_rows = deploy.encoder.max_num_seqs  # prompts per thinker pass (render_batch)
        if device.type == "cuda" and not deploy.encoder.enforce_eager:
            compilation = deploy.encoder.compilation_config
            if compilation.mode > 0 and encoder.compile_layers():
                log.info("thinker: decoder layer compiled (compilation_config.mode %d)", compilation.mode)
            sizes = compilation.cudagraph_capture_sizes
            if compilation.cudagraph_mode != "NONE" and sizes:
                encoder.graphs = EncoderGraphs(encoder, sizes)
                # The audio tower replays one graph per chunk count of the reference clip (all captured at warm-up).
                audio_runner = AudioTowerRunner(encoder.trunk.audio_tower)
                if compilation.mode > 0:
                    audio_runner.compile_layers()
                    log.info("audio tower: encoder layer compiled (compilation_config.mode %d)", compilation.mode)
                encoder.trunk.audio_runner = AudioTowerGraphs(audio_runner)
                encoder.processor.log_mel_graphs = LogMelGraphs(encoder.processor, encoder.device, THINKER_SAMPLE_RATE)

    @property
    def variant(self) -> str:
        return self.release.variant

    def sharing_weights(self, **changes: object) -> AuKPipeline:
        """A second pipeline over the same loaded modules with some attributes replaced, e.g.
        ``release=`` (the Flash recipe on these weights) or ``step_graphs=None, decode_graphs=None`` (eager)."""
        unknown = sorted(set(changes) - set(vars(self)))
        if unknown:
            raise TypeError(f"AuKPipeline has no attribute(s) {unknown}")
        twin = object.__new__(type(self))
        vars(twin).update(vars(self), **changes)
        return twin

    @classmethod
    def load(
        cls,
        checkpoint: str | Path,
        deploy: DeployConfig | None = None,
        *,
        precision: Precision | None = None,
        device: torch.device | str | None = None,
        qwen_path: str | Path | None = None,
    ) -> AuKPipeline:
        deploy = deploy or load_deploy_config()
        release = read_release(checkpoint, qwen_path=qwen_path)
        device = torch.device(device) if device is not None else resolve_device(deploy.dit.devices)
        precision = precision or resolve_precision(deploy.dit.dtype, device)
        model_dtype = precision_dtype(precision)
        if device.type == "cuda":
            _apply_memory_fraction(deploy, device)
        if precision == "exact":
            # fp32 means fp32: TF32 matmuls and convolutions move results by ~5e-4 relative.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        started = time.perf_counter()

        dit_state, fusion = split_dit_weights(read_safetensors(release.weights_path, device), str(release.weights_path))
        with torch.device("meta"):
            dit = AuKDiT(release.dit)
        # Weights take the serving dtype one tensor at a time; the rotary frequencies always stay fp32.
        dit_state = {k: v.float() if k == "rotary_embed.inv_freq" else v.to(model_dtype) for k, v in dit_state.items()}
        load_strict(dit, dit_state, str(release.weights_path), prefix="transformer.")
        dit.eval().requires_grad_(False)
        del dit_state

        vae = load_vae(read_safetensors(release.vae_path, device), release.vae, device)
        vae.eval().requires_grad_(False)

        encoder = ThinkerEncoder.load(
            release.qwen_dir, fusion["layer_weights"].float(), fusion["layer_scale"].float(), device, model_dtype
        )
        hashes = {
            "dit": file_digest(release.weights_path),
            "vae": file_digest(release.vae_path),
        }
        pipe = cls(release, deploy, encoder, dit, vae, device, precision, hashes)
        pipe.startup["load"] = time.perf_counter() - started
        pipe.warm_up()
        log.info(
            "pipeline: %s (%s) on %s, %s precision: loaded in %.1f s, warmed up in %.1f s",
            release.name, release.root, device, precision, pipe.startup["load"], pipe.startup["warm_up"],
        )
        return pipe

    def warm_up(self) -> None:
        """On the graph path, capture the common shapes now rather than on the first jobs: the thinker's prompt
        sizes, the log-mel buckets and the audio tower's chunk counts, the deploy config's warm-up target lengths
        (text-only and with a reference), every reference-clip bucket of the VAE encode and the VAE decode buckets."""
        started = time.perf_counter()
        if self.encoder.graphs is not None:
            self.encoder.graphs.capture_all()
        longest_clip = int(THINKER_SAMPLE_RATE * MAX_TOTAL_SECONDS)  # samples of a 30 s clip at 16 kHz
        if self.encoder.processor.log_mel_graphs is not None:
            self.encoder.processor.log_mel_graphs.capture_up_to(longest_clip)
        audio_graphs = self.encoder.trunk.audio_runner
        if isinstance(audio_graphs, AudioTowerGraphs):
            mel_hop = self.encoder.processor.feature_extractor.hop_length
            audio_graphs.capture_up_to(audio_graphs.runner.plan(longest_clip // mel_hop).chunks)
        if self.step_graphs is not None:
            model_config = self.deploy.dit.model_config
            clip = AudioClip(samples=np.zeros(3 * SAMPLE_RATE, dtype=np.float32), sample_rate=SAMPLE_RATE)
            for frames in model_config.auk_dit_warmup_frames:
                for audio in (None, clip):
                    if frames + (0 if audio is None else 150) > MAX_TOTAL_FRAMES:
                        continue
                    self.render(RenderRequest(WARM_UP_INSTRUCTION, audio=audio, gen_seconds=frames / FRAME_RATE))
            latent_dim = self.release.dit.latent_dim
            with torch.inference_mode():
                if self.encode_graphs is not None:  # every clip length the 30 s rule allows
                    self.encode_graphs.capture_up_to(MAX_TOTAL_FRAMES * HOP)
                for frames in model_config.auk_vae_compile_shapes:
                    self._decode(torch.zeros(1, frames, latent_dim, device=self.device))
                if self.encode_graphs is not None and self.deploy.dit.max_num_seqs > 1:
                    # Equal-length jobs of a pass decode together. Where Triton is missing, the activations are
                    # compiled by inductor, which specialises b = 1: compile the batched case now, not on a job.
                    self._decode(torch.zeros(2, min(model_config.auk_vae_compile_shapes), latent_dim, device=self.device))
        self.startup["warm_up"] = time.perf_counter() - started

    # ------------------------------------------------------------------ request resolution

    def schedule(self, request: RenderRequest) -> Schedule:
        """The request's knobs resolved against the deploy config's defaults (``rules.resolve_knobs``; Flash pins
        its recipe), as a time grid."""
        knobs = rules.request_knobs(self.variant, self.deploy.defaults, request)
        if knobs.fixed_grid:
            grid = torch.tensor(FLASH_T_GRID, dtype=torch.float32)
        else:
            grid = time_grid(knobs.num_inference_steps, knobs.sway)
        return Schedule(grid=grid, guidance_scale=knobs.guidance_scale, seed=knobs.seed)

    @staticmethod
    def target_frames(request: RenderRequest, clip_samples_24k: int) -> int:
        """ceil(50 * gen_seconds), or the clip's whole frames; clip plus target at most 30 s (``rules.py``)."""
        clip = None if request.audio is None else rules.clip_frames(clip_samples_24k, SAMPLE_RATE)
        return rules.target_frames(request.gen_seconds, clip)

    # ------------------------------------------------------------------ rendering

    def render(self, request: RenderRequest, on_step: StepCallback | None = None) -> RenderResult:
        """Render one request; bad input raises an InputError, a model failure a ModelError."""
        (job,) = self._encode_prompts([self._conditioned(request)])
        if isinstance(job, Exception):
            raise job
        (result,) = self._render_group([job], on_step)
        if isinstance(result, Exception):
            raise result
        return result

    def render_batch(
        self, requests: list[RenderRequest], on_step: StepCallback | None = None
    ) -> list[RenderResult | AuKError]:
        """Render compatible requests in shared passes; each keeps its own seed, output and failure.

        The prompts go through the thinker up to the deploy config's stage 0 ``max_num_seqs`` at a time. Requests
        are then grouped by schedule (grid and guidance) and, within a group, packed longest first while
        ``rows x longest row's positions`` stays within the position budget and stage 1's ``max_num_seqs``.
        A request that fails validation or conditioning gets its error in its slot; its neighbours go on.
        """
        results: list[RenderResult | AuKError | None] = [None] * len(requests)
        jobs: list[_Job] = []
        for index, request in enumerate(requests):
            try:
                jobs.append(self._conditioned(request, index))
            except (InputError, ModelError) as exc:
                results[index] = exc
        encoded: list[_Job] = []
        for job, outcome in zip(jobs, self._encode_prompts(jobs)):
            if isinstance(outcome, Exception):
                results[job.index] = outcome
            else:
                encoded.append(outcome)
        for group in self._pack(encoded):
            for job, result in zip(group, self._render_group(group, on_step)):
                results[job.index] = result
        return results  # type: ignore[return-value]

    def _pack(self, jobs: list[_Job]) -> list[list[_Job]]:
        limit = self.deploy.dit.max_num_seqs
        budget = self.deploy.dit.model_config.auk_dit_batch_position_budget
        by_schedule: dict[tuple, list[_Job]] = {}
        for job in jobs:
            by_schedule.setdefault(job.schedule.key, []).append(job)
        groups = []
        for same in by_schedule.values():
            same.sort(key=lambda job: job.positions, reverse=True)
            group: list[_Job] = []
            for job in same:
                if group and (len(group) >= limit or (len(group) + 1) * group[0].positions > budget):
                    groups.append(group)
                    group = []
                group.append(job)
            groups.append(group)
        return groups

    def _conditioned(self, request: RenderRequest, index: int = 0) -> _Job:
        """Validate a request and run what is per request: the prompt's embeddings (processor, audio tower), the
        reference encode, the noise draw. The thinker's text model runs after, for several jobs at once."""
        rules.check_instruction(request.instruction)
        schedule = self.schedule(request)
        clip_24k = pending_16k = None
        if request.audio is not None:
            # The same rules as an uploaded file (length, finite samples), for clips handed over in memory; a clip
            # decode_audio made (a worker's job) was checked then.
            checked_clip(request.audio)
            # The thinker hears the ORIGINAL clip at 16 kHz, not the 24 kHz copy the VAE encodes. soxr lets go of
            # the GIL, so that copy is made on a host thread while this one makes the other and launches its encode.
            pending_16k = self._resampler.submit(
                resample, request.audio.samples, request.audio.sample_rate, THINKER_SAMPLE_RATE
            )
            clip_24k = resample(request.audio.samples, request.audio.sample_rate, SAMPLE_RATE)
        frames = self.target_frames(request, 0 if clip_24k is None else len(clip_24k))
        timings: dict[str, list[_Span]] = {"vae_encode": []}
        with torch.inference_mode(), _oom_as_model_error(frames):
            # The reference encode goes first, on its own stream where there is one: the GPU runs it while the
            # host prepares the prompt, and beside the audio tower after that.
            ref, ref_valid, ref_ready = None, 0, None
            if clip_24k is not None:
                with beside(self.side_stream):
                    started = self._mark()
                    wav = torch.from_numpy(clip_24k).to(self.device, non_blocking=True)[None]  # [1, t]
                    vae_gen = None
                    if request.vae_sample:
                        vae_gen = make_generator((schedule.seed + VAE_SEED_OFFSET) % MAX_SEED, self.device)
                    encode = self.encode_graphs.encode if self.encode_graphs is not None else self.vae.encode
                    ref = encode(wav, sample=request.vae_sample, generator=vae_gen)[0]  # [np, l]
                    encoded = self._mark()
                timings["vae_encode"].append(_Span(started, encoded))
                if self.side_stream is not None:  # the DiT's stream waits for this before it reads ``ref``
                    ref_ready = encoded
                ref_valid = self.vae.valid_frames(len(clip_24k))

            # Drawn here, while the resampling thread may still be at work.
            noise = initial_noise(frames, self.release.dit.latent_dim, make_generator(schedule.seed, self.device))
            started = self._mark()
            # The prompt's tokens need only the clip's length at 16 kHz: the host makes them while it waits.
            samples_16k = None
            if request.audio is not None:
                clip = request.audio
                samples_16k = resampled_length(len(clip.samples), clip.sample_rate, THINKER_SAMPLE_RATE)
            input_ids = self.encoder.processor.input_ids(request.instruction, samples_16k)
            audio_16k = None if pending_16k is None else pending_16k.result()
            embeds = self.encoder.embed(request.instruction, audio_16k, input_ids)  # [nt, dt]
            timings["encode"] = [_Span(started, self._mark())]
        return _Job(
            index=index,
            schedule=schedule,
            embeds=embeds,
            ref=ref,
            ref_valid=ref_valid,
            ref_ready=ref_ready,
            noise=noise[0],
            timings=timings,
        )

    def _encode_prompts(self, jobs: list[_Job]) -> list[_Job | ModelError]:
        """The thinker's text model over the jobs' prompt embeddings, ``encoder.max_rows`` jobs a pass: each job
        with its fused condition set, or the ModelError it met. A pass that fails is retried one job at a time,
        so a failure stays with the job that caused it. Each job is charged an equal share of its pass."""
        outcomes: list[_Job | ModelError] = []
        rows = self.encoder.max_rows
        for start in range(0, len(jobs), rows):
            chunk = jobs[start : start + rows]
            try:
                outcomes.extend(self._encode_pass(chunk))
            except ModelError as exc:
                if len(chunk) == 1:
                    outcomes.append(exc)
                    continue
                for job in chunk:
                    try:
                        outcomes.extend(self._encode_pass([job]))
                    except ModelError as alone:
                        outcomes.append(alone)
        return outcomes

    def _encode_pass(self, jobs: list[_Job]) -> list[_Job]:
        started = self._mark()
        with torch.inference_mode(), _oom_as_model_error(max(job.frames for job in jobs)):
            conditions = self.encoder.conditions([job.embeds for job in jobs])  # [nt_i, dt] fp32 each
        span = _Span(started, self._mark(), share=1 / len(jobs))
        for job, condition in zip(jobs, conditions):
            job.text = condition
            job.timings["encode"].append(span)
        return jobs

    def _render_group(self, group: list[_Job], on_step: StepCallback | None) -> list[RenderResult | AuKError]:
        """One DiT pass over the group (padded and masked to a common shape), then decodes by length."""
        schedule = group[0].schedule
        started = self._mark()
        try:
            with torch.inference_mode(), _oom_as_model_error(max(job.frames for job in group)):
                latents = self._sample(group, schedule, on_step)  # [b, n, l] fp32
        except ModelError as exc:
            return [exc for _ in group]
        dit = _Span(started, self._mark(), share=1 / len(group))
        # Decode equal-length latents together: padding a shorter clip would change its last samples.
        results: list[RenderResult | AuKError | None] = [None] * len(group)
        by_length: dict[int, list[int]] = {}
        for row, job in enumerate(group):
            by_length.setdefault(job.frames, []).append(row)
        for frames, rows in by_length.items():
            started = self._mark()
            try:
                with torch.inference_mode(), _oom_as_model_error(frames * len(rows)):
                    picked = latents.index_select(0, torch.tensor(rows).to(latents.device, non_blocking=True))
                    decoded = self._decode(picked[:, :frames]).float()  # [r, frames * 480]
                    decode = _Span(started, self._mark(), share=1 / len(rows))
                    waves = decoded.cpu().numpy()  # the render's one wait for the GPU
            except ModelError as exc:
                for row in rows:
                    results[row] = exc
                continue
            for wave, row in zip(waves, rows):
                results[row] = self._result(group[row], wave, dit, decode)
        return results  # type: ignore[return-value]

    def _sample(self, group: list[_Job], schedule: Schedule, on_step: StepCallback | None) -> torch.Tensor:
        dev = self.device
        rows = len(group)
        frames = [job.frames for job in group]
        text_lens = [job.text.shape[0] for job in group]
        ref_lens = [0 if job.ref is None else job.ref.shape[0] for job in group]
        n, nt, np_ = max(frames), max(text_lens), max(ref_lens)
        if self.step_graphs is not None:  # graphs are per shape: pad to buckets so few shapes recur
            n, nt = _round_up(n, TARGET_BUCKET), _round_up(nt, TEXT_BUCKET)
            np_ = _round_up(np_, REF_BUCKET) if np_ else 0
        latent_dim = self.release.dit.latent_dim
        text = torch.zeros(rows, nt, group[0].text.shape[-1], device=dev)
        x0 = torch.zeros(rows, n, latent_dim, device=dev)  # padded target frames start (and stay masked) at zero
        ref = torch.zeros(rows, np_, latent_dim, device=dev) if np_ else None
        for job in group:  # the reference encodes ran on the side stream
            if job.ref_ready is not None:
                torch.cuda.current_stream(dev).wait_event(job.ref_ready)
        for row, job in enumerate(group):
            text[row, : text_lens[row]] = job.text
            x0[row, : job.frames] = job.noise
            if job.ref is not None:
                ref[row, : ref_lens[row]] = job.ref
        padded = rows > 1 or self.step_graphs is not None
        # The lengths stay on the host: prepare reads them there without a GPU sync.
        ctx = self.dit.prepare(
            text=text,
            text_lens=torch.tensor(text_lens),
            ref=ref,
            ref_lens=torch.tensor(ref_lens) if np_ else None,
            ref_valid_lens=torch.tensor([job.ref_valid for job in group]) if np_ else None,
            target_len=n,
            target_lens=torch.tensor(frames) if padded else None,
            cfg=needs_uncond(schedule.guidance_scale),
        )
        grid = schedule.grid  # on the host
        if self.step_graphs is not None:
            return self.step_graphs.sample(ctx, x0, grid, schedule.guidance_scale, on_step)
        velocity = guided_velocity(self.dit, ctx, schedule.guidance_scale)
        return euler_sample(velocity, x0, grid, on_step=on_step)

    @staticmethod
    def _result(job: _Job, waveform: np.ndarray, dit: _Span, decode: _Span) -> RenderResult | ModelError:
        if not np.isfinite(waveform).all():
            return ModelError("the model produced non-finite audio")
        spans = dict(job.timings, dit=[dit], decode=[decode])
        timings = {stage: sum(span.seconds() for span in stage_spans) for stage, stage_spans in spans.items()}
        timings["total"] = sum(timings.values())
        return RenderResult(
            waveform=waveform,
            seed=job.schedule.seed,
            num_inference_steps=job.schedule.num_steps,
            guidance_scale=job.schedule.guidance_scale,
            timings=timings,
        )

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        decode = self.decode_graphs.decode if self.decode_graphs is not None else self.vae.decode
        frames = latents.shape[1]
        if frames <= self.vae_tile_frames:
            return decode(latents)
        left, right = self.vae.receptive_field()
        sizes = self.deploy.dit.model_config.auk_vae_compile_shapes
        pieces = []
        for start, length, emit_start, emit_end in plan_tiles(frames, self.vae_tile_frames, left, right, sizes):
            window = decode(latents[:, start : start + length])  # [1, length * 480]
            pieces.append(window[:, (emit_start - start) * HOP : (emit_end - start) * HOP])
        return torch.cat(pieces, dim=1)

    def _mark(self) -> torch.cuda.Event | float:
        """A point in time for a stage's :class:`_Span`: on CUDA an event recorded on the current stream (timing
        never waits for the GPU), elsewhere the wall clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


@dataclass(frozen=True)
class _Span:
    """A stage's time for one job: from ``start`` to ``end`` (CUDA events, or wall-clock seconds), times the job's
    ``share`` of a pass that served several jobs. Read it once the GPU has finished the stage."""

    start: torch.cuda.Event | float
    end: torch.cuda.Event | float
    share: float = 1.0

    def seconds(self) -> float:
        if isinstance(self.start, float):
            return (self.end - self.start) * self.share
        return self.start.elapsed_time(self.end) / 1000 * self.share


@dataclass
class _Job:
    """One request after the per-request work, ready for a DiT pass."""

    index: int
    schedule: Schedule
    embeds: torch.Tensor  # [nt, dt] the prompt's input embeddings (processor, audio tower, token lookup)
    ref: torch.Tensor | None  # [np, l] normalised reference latents
    ref_valid: int  # reference frames attention may see (<= np)
    ref_ready: torch.cuda.Event | None  # recorded once the side stream has made ``ref``; None: made in order
    noise: torch.Tensor  # [n, l] fp32, from the job's own generator
    timings: dict[str, list[_Span]]  # per stage
    text: torch.Tensor | None = None  # [nt, dt] fused condition, set by AuKPipeline._encode_prompts

    @property
    def frames(self) -> int:
        return self.noise.shape[0]

    @property
    def positions(self) -> int:
        return self.embeds.shape[0] + (0 if self.ref is None else self.ref.shape[0]) + self.frames


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


@contextmanager
def _oom_as_model_error(frames: int) -> Iterator[None]:
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        raise OutOfMemory(f"the GPU ran out of memory rendering {frames / FRAME_RATE:.2f} s: {exc}") from None


def _apply_memory_fraction(deploy: DeployConfig, device: torch.device) -> None:
    """Cap this process's allocator at the stages' combined share of the device."""
    fraction = deploy.dit.gpu_memory_utilization
    if deploy.encoder.devices == deploy.dit.devices:
        fraction += deploy.encoder.gpu_memory_utilization
    torch.cuda.set_per_process_memory_fraction(min(fraction, 1.0), device)
