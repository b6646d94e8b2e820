"""Every request limit in one torch-free home: its bound, its error text, and how a request's knobs resolve.

The API's request models (``service/records/requests.py``) take their bounds from here and its submit path
(``api/submit.py``) applies the length rule to the resolved clip; the worker (``service/worker/steps.py``), the pipeline
(``AuKPipeline.schedule`` and ``target_frames``), the model-free pipeline (``service/worker/instant.py``) and bulk
grouping call the same functions.
So the API accepts exactly what the worker renders.

Defaults are not here: the deploy config states them (stage 1's ``default_sampling_params``, ``deploy.py``) and
``resolve_knobs`` fills a request's unset knobs from it. What is here is what no config changes: the bounds, and the
Flash recipe (4 steps on its own fixed grid, no guidance), which the distilled model needs whatever is asked.

The length rule counts latent frames (50 a second), as the engine renders them, never seconds:

- the target is ``ceil(50 * gen_seconds)`` frames (at least one), or without ``gen_seconds`` the clip's whole frames;
- the clip counts the whole frames of its 24 kHz copy, whose length is ``ceil(samples * 24000 / rate)`` (what
  ``audio.resample`` returns);
- clip plus target is at most 1500 frames (30 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Protocol

from auk_worker.errors import InputError
from auk_worker.types import FRAME_RATE, HOP, SAMPLE_RATE, RenderRequest

MAX_INSTRUCTION_CHARS = 4000
MAX_TOTAL_SECONDS = 30.0  # clip plus target, the length the model was trained on
MAX_TOTAL_FRAMES = int(MAX_TOTAL_SECONDS * FRAME_RATE)  # 1500
MIN_CLIP_SAMPLES_24K = HOP  # a clip holds at least one latent frame (20 ms)
MAX_STEPS = 1000

# The distilled Flash student has one recipe: 4 fixed steps (model/sampling.py FLASH_T_GRID) without CFG, which
# blows up its amplitude. Whatever a request asks, a Flash render uses and reports these.
FLASH = "flash"
FLASH_STEPS = 4
FLASH_GUIDANCE = 0.0

LENGTH_REQUIRED = "gen_seconds is required when no audio is given"


@dataclass(frozen=True)
class Bound:
    """The interval a sampling knob must lie in, and the sentence that says so."""

    name: str
    low: int | float
    high: int | float
    integer: bool = False
    high_open: bool = False  # [low, high) rather than [low, high]
    high_text: str = ""  # how the error texts write ``high`` ("2^63"); by default the number itself

    @property
    def interval(self) -> str:
        high = self.high_text or f"{self.high:g}"
        return f"[{self.low:g}, {high}{')' if self.high_open else ']'}"

    def problem(self, value: object) -> str | None:
        """None when ``value`` is allowed; else what it must be, e.g. ``must be in [1, 1000] (an integer)``."""
        kind = Integral if self.integer else Real
        if not isinstance(value, bool) and isinstance(value, kind):
            inside = self.low <= value and (value < self.high if self.high_open else value <= self.high)
            if inside and (self.integer or math.isfinite(value)):
                return None
        return f"must be in {self.interval}" + (" (an integer)" if self.integer else "")

    def check(self, value: object) -> object:
        """``value`` unchanged, or an InputError naming the knob, its interval and the value."""
        problem = self.problem(value)
        if problem is not None:
            raise InputError(f"{self.name} {problem}, got {value!r}")
        return value


STEPS = Bound("num_inference_steps", 1, MAX_STEPS, integer=True)
GUIDANCE = Bound("guidance_scale", 0.0, 20.0)
SWAY = Bound("sway", -1.0, 0.0)
SEED = Bound("seed", 0, 2**63, integer=True, high_open=True, high_text="2^63")
MAX_SEED = SEED.high


# ---------------------------------------------------------------------------------------------------- the request


def check_instruction(instruction: object) -> str:
    """The instruction as given, or an InputError: blank, or longer than ``MAX_INSTRUCTION_CHARS``."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise InputError("instruction must be a non-empty string, not blank")
    if len(instruction) > MAX_INSTRUCTION_CHARS:
        raise InputError(f"instruction is {len(instruction)} characters long; at most {MAX_INSTRUCTION_CHARS} "
                         "are accepted")  # fmt: skip
    return instruction


def require_length(gen_seconds: float | None, has_clip: bool) -> None:
    """Without a clip the target length must be given."""
    if gen_seconds is None and not has_clip:
        raise InputError(LENGTH_REQUIRED)


# ---------------------------------------------------------------------------------------------------- the length


def resampled_length(samples: int, from_rate: int, to_rate: int) -> int:
    """How many samples a clip of ``samples`` has at ``to_rate``: ceil(samples * to / from), exactly."""
    return -(-samples * to_rate // from_rate)


def frames_for_seconds(seconds: float) -> int:
    """Target latent frames for a requested duration: ceil(50 * s), at least one."""
    return max(1, math.ceil(seconds * FRAME_RATE))


def clip_frames(samples: int, sample_rate: int) -> int:
    """The whole latent frames of a clip of ``samples`` at ``sample_rate``, counted on its 24 kHz copy."""
    return resampled_length(samples, sample_rate, SAMPLE_RATE) // HOP


def check_total_frames(target: int, clip: int) -> None:
    """Clip (its whole frames) plus target at most ``MAX_TOTAL_FRAMES``."""
    total = target + clip
    if total > MAX_TOTAL_FRAMES:
        raise InputError(
            f"clip ({clip / FRAME_RATE:.2f} s) plus target ({target / FRAME_RATE:.2f} s) is "
            f"{total / FRAME_RATE:.2f} s; the model renders at most {MAX_TOTAL_SECONDS:g} s in total"
        )


def target_frames(gen_seconds: float | None, clip: int | None) -> int:
    """A request's target latent frames, checked: ``ceil(50 * gen_seconds)``, or without ``gen_seconds`` the clip's
    whole frames ``clip`` (None: no clip); clip plus target at most 30 s."""
    if gen_seconds is not None:
        if isinstance(gen_seconds, bool) or not isinstance(gen_seconds, Real) or not (
            math.isfinite(gen_seconds) and gen_seconds > 0
        ):
            raise InputError(f"gen_seconds must be a positive number, got {gen_seconds!r}")
        frames = frames_for_seconds(gen_seconds)
    elif clip is not None:
        frames = clip
    else:
        raise InputError(LENGTH_REQUIRED)
    check_total_frames(frames, clip or 0)
    return frames


def request_frames(request: RenderRequest) -> int:
    """``target_frames`` of an engine request, its clip counted from its samples and rate."""
    audio = request.audio
    clip = None if audio is None else clip_frames(len(audio.samples), audio.sample_rate)
    return target_frames(request.gen_seconds, clip)


# ---------------------------------------------------------------------------------------------------- the knobs


class SamplingDefaults(Protocol):
    """What unset knobs take: the deploy config's stage 1 ``default_sampling_params`` (``deploy.DiTSampling``)."""

    seed: int
    num_inference_steps: int
    guidance_scale: float
    sway: float


@dataclass(frozen=True)
class Knobs:
    """A request's schedule knobs once defaults and the variant's recipe are applied: what a render uses and
    reports."""

    num_inference_steps: int
    guidance_scale: float
    sway: float | None  # None on Flash's fixed grid
    seed: int
    fixed_grid: bool = False  # True: the variant's own grid (Flash), not time_grid(steps, sway)

    @property
    def key(self) -> tuple:
        """Requests with equal keys follow one schedule, so they can share a DiT pass."""
        return (self.num_inference_steps, self.guidance_scale, self.sway, self.fixed_grid)


def resolve_knobs(
    variant: str,
    defaults: SamplingDefaults,
    *,
    num_inference_steps: int | None = None,
    guidance_scale: float | None = None,
    sway: float | None = None,
    seed: int | None = None,
) -> Knobs:
    """Unset knobs take the deploy config's ``defaults``; every knob is checked against its bound; Flash then pins
    its own recipe (the seed stays the request's)."""
    steps = STEPS.check(defaults.num_inference_steps if num_inference_steps is None else num_inference_steps)
    scale = GUIDANCE.check(defaults.guidance_scale if guidance_scale is None else guidance_scale)
    bend = SWAY.check(defaults.sway if sway is None else sway)
    seed = SEED.check(defaults.seed if seed is None else seed)
    if variant == FLASH:
        return Knobs(FLASH_STEPS, FLASH_GUIDANCE, None, int(seed), fixed_grid=True)
    return Knobs(int(steps), float(scale), float(bend), int(seed))


def request_knobs(variant: str, defaults: SamplingDefaults, request: RenderRequest) -> Knobs:
    """``resolve_knobs`` of an engine request."""
    return resolve_knobs(
        variant,
        defaults,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        sway=request.sway,
        seed=request.seed,
    )
