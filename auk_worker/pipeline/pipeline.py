"""The render pipeline: both stages loaded once, then request after request with no further I/O.

    instruction (+ clip) ── stage 0: thinker + layer fusion ──▶ condition [1, nt, 2048]
    clip @24 kHz ── VAE encode ──▶ reference latents [1, np, 64]
    noise [1, n, 64] ── stage 1: Euler over the DiT (CFG for base) ──▶ latents ── VAE decode ──▶ waveform [n * 480]

Precision: ``exact`` keeps every weight in fp32 (the released export) and runs fp32 math; ``fast`` holds the DiT and
the thinker in bf16 while the VAE, the noise and the ODE state stay fp32. ``fp8`` (opt-in) is ``fast`` with the DiT's
block linears in E4M3 (``model/fp8.py``). The deploy config's ``dtype: auto`` picks ``fast`` on CUDA and ``exact``
on the CPU; ``float8`` picks ``fp8``.

Fast paths (kernels, compiled code, CUDA graphs and streams) are resolved once at load into a ``FastPaths`` and
applied by ``wiring.wire``; the pipeline holds the graph runners that returns (``accelerated``). The per-render
machinery (jobs, packing, a pass's Euler solve, tiled decoding) is in ``render.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from auk_worker import rules
from auk_worker.audio import THINKER_SAMPLE_RATE, checked_clip, resample, resampled_length
from auk_worker.checkpoint import Release, file_digest, read_release, read_safetensors
from auk_worker.deploy import DeployConfig, load_deploy_config
from auk_worker.errors import AuKError, ConfigError, InputError, ModelError
from auk_worker.model.dit import AuKDiT
from auk_worker.checkpoint import load_dit
from auk_worker.model.sampling import FLASH_T_GRID, initial_noise, make_generator, time_grid
from auk_worker.model.streams import beside
from auk_worker.model.thinker import ThinkerEncoder
from auk_worker.model.vae import AuKVAE, load_vae
from auk_worker.pipeline.cfg_parallel import CfgPair, start_pair
from auk_worker.pipeline.fastpaths import FastPaths, Precision, precision_dtype, resolve_device, resolve_precision
from auk_worker.pipeline.render import (
    Job,
    Schedule,
    Span,
    StepCallback,
    decode_in_tiles,
    encode_prompts,
    job_result,
    mark,
    oom_as_model_error,
    pack,
    sample,
)
from auk_worker.pipeline.thinker_graphs import AudioTowerGraphs
from auk_worker.pipeline.voices import PIECE as VOICE_PIECE
from auk_worker.pipeline.voices import PreparedVoice, audio_embeds, cached_voice, embed_with_audio
from auk_worker.pipeline.wiring import wire
from auk_worker.rules import MAX_SEED, MAX_TOTAL_FRAMES, MAX_TOTAL_SECONDS
from auk_worker.voice_cache import VoiceCache
from auk_worker.types import (
    FRAME_RATE,
    HOP,
    SAMPLE_RATE,
    AudioClip,
    RenderRequest,
    RenderResult,
)

log = logging.getLogger(__name__)

VAE_SEED_OFFSET = 0x5EED0A0C  # the posterior draw uses its own generator so it never moves the noise
WARM_UP_INSTRUCTION = (
    'Generate speech based on the following description: "A clear, natural voice." '
    'The content to speak is: "The quick brown fox jumps over the lazy dog."'
)



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
        fast_paths: FastPaths,
    ) -> None:
        self.release = release
        self.deploy = deploy
        self.encoder = encoder
        self.dit = dit
        self.vae = vae
        self.device = device
        self.precision = precision
        self.model_hashes = model_hashes
        self.fast_paths = fast_paths
        self.startup: dict[str, float] = {"load": 0.0, "warm_up": 0.0}  # seconds
        # Prepared reference clips by content key (auk_worker/voice_cache.py); set by the worker, None: off.
        self.voice_cache: VoiceCache | None = None
        model_config = deploy.dit.model_config
        self.vae_tile_frames = model_config.auk_vae_tile_frames or max(model_config.auk_vae_compile_shapes)
        # Resamples a reference clip for the thinker while the render's own thread prepares the VAE's copy.
        self._resampler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="auk-resample")
        encoder.max_rows = deploy.encoder.max_num_seqs  # prompts per thinker pass (render_batch)
        self.accelerated = wire(fast_paths, deploy, encoder, dit, vae, device)
        self.cfg_pair: CfgPair | None = None  # the other device of a guided step (``cfg_parallel_size: 2``)


    @property
    def variant(self) -> str:
        return self.release.variant

    def sharing_weights(self, **changes: object) -> AuKPipeline:
        """A second pipeline over the same loaded modules with some attributes replaced, e.g.
        ``release=`` (the Flash recipe on these weights) or ``accelerated=`` without graph runners (eager)."""
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
        fast_paths: FastPaths | None = None,
    ) -> AuKPipeline:
        """Load a release onto ``device`` at ``precision`` (both from ``deploy`` when None) and warm it up.
        ``fast_paths``: None resolves them from the deploy config, the device and the precision."""
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

        dit, fusion = load_dit(release, device, model_dtype)
        vae = load_vae(read_safetensors(release.vae_path, device), release.vae, device)
        vae.eval().requires_grad_(False)

        encoder = ThinkerEncoder.load(
            release.qwen_dir, fusion["layer_weights"].float(), fusion["layer_scale"].float(), device, model_dtype
        )
        hashes = {
            "dit": file_digest(release.weights_path),
            "vae": file_digest(release.vae_path),
        }
        fast_paths = fast_paths or FastPaths.resolve(deploy, device, precision, release.dit.dim_head)
        pair = None
        if deploy.dit.cfg_parallel_size == 2:
            if release.variant != "base":
                raise ConfigError(f"cfg_parallel_size 2 needs guided (base) renders; {release.name} is {release.variant}")
            fast_paths = dataclasses.replace(fast_paths, step_graphs=False)  # a pair's steps run eager
            pair = start_pair(release.root, deploy, device, precision, qwen_path)
        pipe = cls(release, deploy, encoder, dit, vae, device, precision, hashes, fast_paths)
        pipe.cfg_pair = pair
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
        if self.accelerated.step_graphs is not None:
            model_config = self.deploy.dit.model_config
            clip = AudioClip(samples=np.zeros(3 * SAMPLE_RATE, dtype=np.float32), sample_rate=SAMPLE_RATE)
            for frames in model_config.auk_dit_warmup_frames:
                for audio in (None, clip):
                    if frames + (0 if audio is None else 150) > MAX_TOTAL_FRAMES:
                        continue
                    self.render(RenderRequest(WARM_UP_INSTRUCTION, audio=audio, gen_seconds=frames / FRAME_RATE))
            latent_dim = self.release.dit.latent_dim
            with torch.inference_mode():
                if self.accelerated.encode_graphs is not None:  # every clip length the 30 s rule allows
                    self.accelerated.encode_graphs.capture_up_to(MAX_TOTAL_FRAMES * HOP)
                for frames in model_config.auk_vae_compile_shapes:
                    self._decode(torch.zeros(1, frames, latent_dim, device=self.device))
                if self.accelerated.encode_graphs is not None and self.deploy.dit.max_num_seqs > 1:
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
        (job,) = encode_prompts(self.encoder, [self._conditioned(request)], self.device)
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
        jobs: list[Job] = []
        for index, request in enumerate(requests):
            try:
                jobs.append(self._conditioned(request, index))
            except (InputError, ModelError) as exc:
                results[index] = exc
        encoded: list[Job] = []
        for job, outcome in zip(jobs, encode_prompts(self.encoder, jobs, self.device)):
            if isinstance(outcome, Exception):
                results[job.index] = outcome
            else:
                encoded.append(outcome)
        dit = self.deploy.dit
        for group in pack(encoded, dit.max_num_seqs, dit.model_config.auk_dit_batch_position_budget):
            for job, result in zip(group, self._render_group(group, on_step)):
                results[job.index] = result
        return results  # type: ignore[return-value]

    def _conditioned(self, request: RenderRequest, index: int = 0) -> Job:
        """Validate a request and run what is per request: the prompt's embeddings (processor, audio tower), the
        reference encode, the noise draw. The thinker's text model runs after, for several jobs at once."""
        rules.check_instruction(request.instruction)
        schedule = self.schedule(request)
        clip_24k = pending_16k = None
        voice = cached_voice(self.voice_cache, request.audio)  # a clip prepared before, or None
        if voice is not None:
            clip_24k = voice.clip_24k
        elif request.audio is not None:
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
        timings: dict[str, list[Span]] = {"vae_encode": []}
        with torch.inference_mode(), oom_as_model_error(frames):
            # The reference encode goes first, on its own stream where there is one: the GPU runs it while the
            # host prepares the prompt, and beside the audio tower after that.
            ref, ref_valid, ref_ready = None, 0, None
            if voice is not None and voice.ref is not None and not request.vae_sample:
                ref, ref_valid = voice.ref, voice.ref_valid  # the posterior mean, encoded by an earlier render
            elif clip_24k is not None:
                with beside(self.accelerated.encode_stream):
                    started = self._mark()
                    wav = torch.from_numpy(clip_24k).to(self.device, non_blocking=True)[None]  # [1, t]
                    vae_gen = None
                    if request.vae_sample:
                        vae_gen = make_generator((schedule.seed + VAE_SEED_OFFSET) % MAX_SEED, self.device)
                    graphs = self.accelerated.encode_graphs
                    encode = graphs.encode if graphs is not None else self.vae.encode
                    ref = encode(wav, sample=request.vae_sample, generator=vae_gen)[0]  # [np, l]
                    encoded = self._mark()
                timings["vae_encode"].append(Span(started, encoded))
                if self.accelerated.encode_stream is not None:  # the DiT's stream waits for it before it reads ``ref``
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
            if voice is not None:
                embeds = embed_with_audio(self.encoder, input_ids, voice.audio_embeds)  # [nt, dt]
            elif self.voice_cache is not None and request.audio is not None and request.audio.key is not None:
                audio_16k = pending_16k.result()
                tower = audio_embeds(self.encoder, request.instruction, audio_16k, input_ids)  # [na, dt]
                embeds = embed_with_audio(self.encoder, input_ids, tower)
                self.voice_cache.put(request.audio.key, VOICE_PIECE, PreparedVoice(
                    clip_24k, audio_16k, tower, None if request.vae_sample else ref, ref_valid))  # fmt: skip
            else:
                audio_16k = None if pending_16k is None else pending_16k.result()
                embeds = self.encoder.embed(request.instruction, audio_16k, input_ids)  # [nt, dt]
            timings["encode"] = [Span(started, self._mark())]
        return Job(
            index=index,
            schedule=schedule,
            embeds=embeds,
            ref=ref,
            ref_valid=ref_valid,
            ref_ready=ref_ready,
            noise=noise[0],
            timings=timings,
        )

    def _render_group(self, group: list[Job], on_step: StepCallback | None) -> list[RenderResult | AuKError]:
        """One DiT pass over the group (padded and masked to a common shape), then decodes by length."""
        schedule = group[0].schedule
        started = self._mark()
        try:
            with torch.inference_mode(), oom_as_model_error(max(job.frames for job in group)):
                latents = sample(self.dit, self.accelerated.step_graphs, group, schedule, self.device, on_step,
                                 self.cfg_pair)  # fmt: skip
        except ModelError as exc:
            return [exc for _ in group]
        dit = Span(started, self._mark(), share=1 / len(group))
        # Decode equal-length latents together: padding a shorter clip would change its last samples.
        results: list[RenderResult | AuKError | None] = [None] * len(group)
        by_length: dict[int, list[int]] = {}
        for row, job in enumerate(group):
            by_length.setdefault(job.frames, []).append(row)
        for frames, rows in by_length.items():
            started = self._mark()
            try:
                with torch.inference_mode(), oom_as_model_error(frames * len(rows)):
                    picked = latents.index_select(0, torch.tensor(rows).to(latents.device, non_blocking=True))
                    decoded = self._decode(picked[:, :frames]).float()  # [r, frames * 480]
                    decode = Span(started, self._mark(), share=1 / len(rows))
                    waves = decoded.cpu().numpy()  # the render's one wait for the GPU
            except ModelError as exc:
                for row in rows:
                    results[row] = exc
                continue
            for wave, row in zip(waves, rows):
                results[row] = job_result(group[row], wave, dit, decode)
        return results  # type: ignore[return-value]

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:  # [b, n, l] -> [b, n * 480]
        graphs = self.accelerated.decode_graphs
        decode = graphs.decode if graphs is not None else self.vae.decode
        sizes = self.deploy.dit.model_config.auk_vae_compile_shapes
        return decode_in_tiles(latents, decode, self.vae, self.vae_tile_frames, sizes)

    def _mark(self) -> torch.cuda.Event | float:
        return mark(self.device)

def _apply_memory_fraction(deploy: DeployConfig, device: torch.device) -> None:
    """Cap this process's allocator at the stages' combined share of the device."""
    fraction = deploy.dit.gpu_memory_utilization
    if deploy.encoder.devices == deploy.dit.devices:
        fraction += deploy.encoder.gpu_memory_utilization
    torch.cuda.set_per_process_memory_fraction(min(fraction, 1.0), device)

