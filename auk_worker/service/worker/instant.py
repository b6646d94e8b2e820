"""The instant pipeline: a hand-written fake with the real pipeline's interface and no model.

Selected with ``AUK_PIPELINE=instant``. It returns a silent waveform of exactly the length the real pipeline
would render (``ceil(50 * gen_seconds) * 480`` samples, or the clip's whole frames), calls ``on_step`` once
per step, and imports no torch. It refuses, resolves and reports a request as the real one does: the same
``rules.py`` calls against the same deploy config's defaults (Flash pins its recipe). ``render_batch`` mirrors the
real one: requests with the same step count share one loop of steps (so a group costs one request's delay), and a
request that fails validation gets its error in its slot while the others go on. Its uses: the queue-overhead
benchmark (the whole job path minus the model) and the service tests' fault scenarios.

Test knob: ``AUK_INSTANT_STEP_DELAY`` (seconds, default 0) sleeps that long in every step, so a test can hold
a job in the middle of its render long enough to kill the worker or stop storage.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from auk_worker import rules
from auk_worker.deploy import DeployConfig, load_deploy_config
from auk_worker.errors import AuKError, InputError
from auk_worker.rules import Knobs
from auk_worker.service.connect.settings import Settings
from auk_worker.types import HOP, RenderRequest, RenderResult
from auk_worker.voice_cache import VoiceCache


class InstantPipeline:
    """Renders silence of the right length at once; same ``variant``, ``deploy``, ``model_hashes`` and ``render`` as
    the real one."""

    def __init__(self, variant: str, deploy: DeployConfig, step_delay_s: float = 0.0) -> None:
        self.variant = variant
        self.deploy = deploy
        self.step_delay_s = step_delay_s
        self.model_hashes = {"dit": "instant", "vae": "instant"}
        self.startup = {"load": 0.0, "warm_up": 0.0}  # seconds: nothing to load
        self.voice_cache: VoiceCache | None = None  # nothing prepared to keep; set by the worker like the real one's

    @classmethod
    def from_env(
        cls, variant: str, environ: dict[str, str] | None = None, deploy: DeployConfig | None = None
    ) -> InstantPipeline:
        """The step delay from ``AUK_INSTANT_STEP_DELAY``; the deploy config given, or the one ``AUK_DEPLOY_CONFIG``
        names (the file a real worker would load)."""
        settings = Settings.from_env(os.environ if environ is None else environ)
        delay = settings.instant_step_delay_s
        deploy = deploy or load_deploy_config(settings.deploy_config)
        return cls(variant, deploy, delay)

    def render(self, request: RenderRequest, on_step: Callable[[int, int], None] | None = None) -> RenderResult:
        knobs, frames = self._plan(request)
        self._run_steps(knobs.num_inference_steps, on_step)
        return self._silence(knobs, frames)

    def render_batch(
        self, requests: list[RenderRequest], on_step: Callable[[int, int], None] | None = None
    ) -> list[RenderResult | AuKError]:
        results: list[RenderResult | AuKError | None] = [None] * len(requests)
        by_steps: dict[int, list[tuple[int, Knobs, int]]] = {}  # steps -> [(index, knobs, frames)]
        for index, request in enumerate(requests):
            try:
                knobs, frames = self._plan(request)
            except InputError as exc:
                results[index] = exc
                continue
            by_steps.setdefault(knobs.num_inference_steps, []).append((index, knobs, frames))
        for steps, members in by_steps.items():
            self._run_steps(steps, on_step)
            for index, knobs, frames in members:
                results[index] = self._silence(knobs, frames)
        return results  # type: ignore[return-value]

    def _plan(self, request: RenderRequest) -> tuple[Knobs, int]:
        """The knobs and target frames the real pipeline would use; InputError for what it would refuse."""
        rules.check_instruction(request.instruction)
        knobs = rules.request_knobs(self.variant, self.deploy.defaults, request)
        return knobs, rules.request_frames(request)

    def _run_steps(self, steps: int, on_step: Callable[[int, int], None] | None) -> None:
        for step in range(1, steps + 1):
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            if on_step is not None:
                on_step(step, steps)

    @staticmethod
    def _silence(knobs: Knobs, frames: int) -> RenderResult:
        return RenderResult(
            waveform=np.zeros(frames * HOP, dtype=np.float32),
            seed=knobs.seed,
            num_inference_steps=knobs.num_inference_steps,
            guidance_scale=knobs.guidance_scale,
        )
