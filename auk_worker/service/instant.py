"""The instant pipeline: a hand-written fake with the real pipeline's interface and no model.

Selected with ``AUK_PIPELINE=instant``. It returns a silent waveform of exactly the length the real pipeline
would render (``ceil(50 * gen_seconds) * 480`` samples, or the clip's whole frames), calls ``on_step`` once
per step, and imports no torch. ``render_batch`` mirrors the real one: requests with the same step count share
one loop of steps (so a group costs one request's delay), and a request that fails validation gets its error in
its slot while the others go on. Its uses: the queue-overhead benchmark (the whole job path minus the model)
and the service tests' fault scenarios.

Test knob: ``AUK_INSTANT_STEP_DELAY`` (seconds, default 0) sleeps that long in every step, so a test can hold
a job in the middle of its render long enough to kill the worker or stop storage.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from auk_worker.errors import AuKError, ConfigError, InputError
from auk_worker.types import (
    HOP,
    MAX_TOTAL_FRAMES,
    SAMPLE_RATE,
    RenderRequest,
    RenderResult,
    frames_for_seconds,
)

DEFAULT_STEPS = {"base": 32, "flash": 4}


class InstantPipeline:
    """Renders silence of the right length at once; same ``variant``, ``model_hashes`` and ``render`` as the real one."""

    def __init__(self, variant: str, step_delay_s: float = 0.0) -> None:
        self.variant = variant
        self.step_delay_s = step_delay_s
        self.model_hashes = {"dit": "instant", "vae": "instant"}

    @classmethod
    def from_env(cls, variant: str, environ: dict[str, str] | None = None) -> InstantPipeline:
        env = os.environ if environ is None else environ
        raw = env.get("AUK_INSTANT_STEP_DELAY", "0") or "0"
        try:
            delay = float(raw)
        except ValueError:
            raise ConfigError(f"AUK_INSTANT_STEP_DELAY must be a number of seconds, got {raw!r}") from None
        return cls(variant, delay)

    def render(self, request: RenderRequest, on_step: Callable[[int, int], None] | None = None) -> RenderResult:
        frames = self._frames(request)
        steps = self._steps(request)
        self._run_steps(steps, on_step)
        return self._silence(request, frames, steps)

    def render_batch(
        self, requests: list[RenderRequest], on_step: Callable[[int, int], None] | None = None
    ) -> list[RenderResult | AuKError]:
        results: list[RenderResult | AuKError | None] = [None] * len(requests)
        by_steps: dict[int, list[tuple[int, int]]] = {}  # steps -> [(index, frames)]
        for index, request in enumerate(requests):
            try:
                by_steps.setdefault(self._steps(request), []).append((index, self._frames(request)))
            except InputError as exc:
                results[index] = exc
        for steps, members in by_steps.items():
            self._run_steps(steps, on_step)
            for index, frames in members:
                results[index] = self._silence(requests[index], frames, steps)
        return results  # type: ignore[return-value]

    def _frames(self, request: RenderRequest) -> int:
        """Target frames as the real pipeline counts them; InputError for what it would refuse."""
        if not request.instruction.strip():
            raise InputError("instruction must be a non-empty string")
        clip_frames = 0
        if request.audio is not None:
            clip_24k = -(-len(request.audio.samples) * SAMPLE_RATE // request.audio.sample_rate)
            clip_frames = clip_24k // HOP
        if request.gen_seconds is not None:
            frames = frames_for_seconds(request.gen_seconds)
        elif request.audio is not None:
            frames = clip_frames
        else:
            raise InputError("gen_seconds is required when no audio is given")
        if frames + clip_frames > MAX_TOTAL_FRAMES:
            raise InputError("clip plus target exceeds 30 s")
        return frames

    def _steps(self, request: RenderRequest) -> int:
        return DEFAULT_STEPS[self.variant] if self.variant == "flash" else (request.num_inference_steps or 32)

    def _run_steps(self, steps: int, on_step: Callable[[int, int], None] | None) -> None:
        for step in range(1, steps + 1):
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            if on_step is not None:
                on_step(step, steps)

    def _silence(self, request: RenderRequest, frames: int, steps: int) -> RenderResult:
        return RenderResult(
            waveform=np.zeros(frames * HOP, dtype=np.float32),
            seed=request.seed or 0,
            num_inference_steps=steps,
            guidance_scale=0.0 if self.variant == "flash" else (request.guidance_scale or 2.0),
        )
