"""The per-render machinery behind ``AuKPipeline``: a request after its per-request work (``Job``), a stage's time
(``Span``), the thinker's passes over the jobs' prompts, packing jobs into DiT passes, one pass's Euler solve,
and decoding in tiles.

Shapes: b rows of a pass, n target frames (padded), nt text tokens, np reference frames, l latent channels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from auk_worker.errors import ModelError, OutOfMemory
from auk_worker.model.dit import AuKDiT
from auk_worker.model.sampling import euler_sample, guided_velocity, needs_uncond
from auk_worker.model.thinker import ThinkerEncoder
from auk_worker.model.vae import AuKVAE, plan_tiles
from auk_worker.pipeline.cfg_parallel import CfgPair
from auk_worker.pipeline.graphs import StepGraphs
from auk_worker.types import FRAME_RATE, HOP, RenderResult

StepCallback = Callable[[int, int], None]

# Graph path buckets: padded (and masked) sizes, so that a handful of graph shapes serve every request.
TARGET_BUCKET = 25  # latent frames (0.5 s)
TEXT_BUCKET = 32  # prompt tokens
REF_BUCKET = 25  # reference frames


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


@dataclass(frozen=True)
class Span:
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
class Job:
    """One request after the per-request work, ready for a DiT pass."""

    index: int
    schedule: Schedule
    embeds: torch.Tensor  # [nt, dt] the prompt's input embeddings (processor, audio tower, token lookup)
    ref: torch.Tensor | None  # [np, l] normalised reference latents
    ref_valid: int  # reference frames attention may see (<= np)
    ref_ready: torch.cuda.Event | None  # recorded once the side stream has made ``ref``; None: made in order
    noise: torch.Tensor  # [n, l] fp32, from the job's own generator
    timings: dict[str, list[Span]]  # per stage
    text: torch.Tensor | None = None  # [nt, dt] fused condition, set by encode_prompts

    @property
    def frames(self) -> int:
        return self.noise.shape[0]

    @property
    def positions(self) -> int:
        return self.embeds.shape[0] + (0 if self.ref is None else self.ref.shape[0]) + self.frames


def round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def mark(device: torch.device) -> torch.cuda.Event | float:
    """A point in time for a stage's :class:`Span`: on CUDA an event recorded on the current stream (timing never
    waits for the GPU), elsewhere the wall clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def pack(jobs: list[Job], limit: int, budget: int) -> list[list[Job]]:
    """Jobs in DiT passes: grouped by schedule, then packed longest first while a pass holds at most ``limit``
    rows and ``rows x longest row's positions`` stays within ``budget``."""
    by_schedule: dict[tuple, list[Job]] = {}
    for job in jobs:
        by_schedule.setdefault(job.schedule.key, []).append(job)
    groups = []
    for same in by_schedule.values():
        same.sort(key=lambda job: job.positions, reverse=True)
        group: list[Job] = []
        for job in same:
            if group and (len(group) >= limit or (len(group) + 1) * group[0].positions > budget):
                groups.append(group)
                group = []
            group.append(job)
        groups.append(group)
    return groups


def encode_prompts(encoder: ThinkerEncoder, jobs: list[Job], device: torch.device) -> list[Job | ModelError]:
    """The thinker's text model over the jobs' prompt embeddings, ``encoder.max_rows`` jobs a pass: each job
    with its fused condition set, or the ModelError it met. A pass that fails is retried one job at a time,
    so a failure stays with the job that caused it. Each job is charged an equal share of its pass."""
    outcomes: list[Job | ModelError] = []
    rows = encoder.max_rows
    for start in range(0, len(jobs), rows):
        chunk = jobs[start : start + rows]
        try:
            outcomes.extend(_encode_pass(encoder, chunk, device))
        except ModelError as exc:
            if len(chunk) == 1:
                outcomes.append(exc)
                continue
            for job in chunk:
                try:
                    outcomes.extend(_encode_pass(encoder, [job], device))
                except ModelError as alone:
                    outcomes.append(alone)
    return outcomes


def _encode_pass(encoder: ThinkerEncoder, jobs: list[Job], device: torch.device) -> list[Job]:
    started = mark(device)
    with torch.inference_mode(), oom_as_model_error(max(job.frames for job in jobs)):
        conditions = encoder.conditions([job.embeds for job in jobs])  # [nt_i, dt] fp32 each
    span = Span(started, mark(device), share=1 / len(jobs))
    for job, condition in zip(jobs, conditions):
        job.text = condition
        job.timings["encode"].append(span)
    return jobs


def sample(
    dit: AuKDiT, step_graphs: StepGraphs | None, group: list[Job], schedule: Schedule, device: torch.device,
    on_step: StepCallback | None, pair: CfgPair | None = None,
) -> torch.Tensor:
    """One DiT pass over the group's rows, padded and masked to a common shape (on the graph path, to buckets):
    the Euler solve of ``schedule`` from each job's noise. Returns the latents [b, n, l] fp32. With a CFG
    ``pair``, a guided pass runs its unconditional half on the pair's other device (eager: no step graphs)."""
    dev = device
    rows = len(group)
    frames = [job.frames for job in group]
    text_lens = [job.text.shape[0] for job in group]
    ref_lens = [0 if job.ref is None else job.ref.shape[0] for job in group]
    n, nt, np_ = max(frames), max(text_lens), max(ref_lens)
    if step_graphs is not None:  # graphs are per shape: pad to buckets so few shapes recur
        n, nt = round_up(n, TARGET_BUCKET), round_up(nt, TEXT_BUCKET)
        np_ = round_up(np_, REF_BUCKET) if np_ else 0
    latent_dim = dit.config.latent_dim
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
    padded = rows > 1 or step_graphs is not None
    # The lengths stay on the host: prepare reads them there without a GPU sync.
    inputs = dict(
        text=text,
        text_lens=torch.tensor(text_lens),
        ref=ref,
        ref_lens=torch.tensor(ref_lens) if np_ else None,
        ref_valid_lens=torch.tensor([job.ref_valid for job in group]) if np_ else None,
        target_len=n,
        target_lens=torch.tensor(frames) if padded else None,
    )
    grid = schedule.grid  # on the host
    if pair is not None and needs_uncond(schedule.guidance_scale):
        return pair.lead(dit, inputs, x0, grid, schedule.guidance_scale, on_step)
    ctx = dit.prepare(**inputs, cfg=needs_uncond(schedule.guidance_scale))
    if step_graphs is not None:
        return step_graphs.sample(ctx, x0, grid, schedule.guidance_scale, on_step)
    velocity = guided_velocity(dit, ctx, schedule.guidance_scale)
    return euler_sample(velocity, x0, grid, on_step=on_step)


def job_result(job: Job, waveform: np.ndarray, dit: Span, decode: Span) -> RenderResult | ModelError:
    """The job's waveform [n * 480] with its schedule and its stages' times, or a ModelError for non-finite audio."""
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


def decode_in_tiles(
    latents: torch.Tensor, decode: Callable[[torch.Tensor], torch.Tensor], vae: AuKVAE, tile_frames: int,
    sizes: tuple[int, ...],
) -> torch.Tensor:
    """``decode`` of latents [b, n, l] -> [b, n * 480]: whole up to ``tile_frames``, else in overlapping windows of
    the VAE's receptive field (``plan_tiles``; the last window shrinks to one of ``sizes``)."""
    frames = latents.shape[1]
    if frames <= tile_frames:
        return decode(latents)
    left, right = vae.receptive_field()
    pieces = []
    for start, length, emit_start, emit_end in plan_tiles(frames, tile_frames, left, right, sizes):
        window = decode(latents[:, start : start + length])  # [1, length * 480]
        pieces.append(window[:, (emit_start - start) * HOP : (emit_end - start) * HOP])
    return torch.cat(pieces, dim=1)


@contextmanager
def oom_as_model_error(frames: int) -> Iterator[None]:
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        raise OutOfMemory(f"the GPU ran out of memory rendering {frames / FRAME_RATE:.2f} s: {exc}") from None
