"""Plain data that crosses the engine's boundary: what a render asks for and what it returns.

No torch here: the service and the API import these to validate requests without loading the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from auk_worker.errors import InputError

SAMPLE_RATE = 24_000  # the VAE's output rate
HOP = 480  # waveform samples per latent frame
FRAME_RATE = SAMPLE_RATE // HOP  # 50 latent frames per second
MAX_TOTAL_SECONDS = 30.0  # clip plus target, the length the model was trained on
MAX_TOTAL_FRAMES = int(MAX_TOTAL_SECONDS * FRAME_RATE)
MIN_CLIP_SAMPLES_24K = HOP  # a clip must hold at least one latent frame


def frames_for_seconds(seconds: float) -> int:
    """Target latent frames for a requested duration: ceil(50 * s), at least one."""
    return max(1, math.ceil(seconds * FRAME_RATE))


def check_total_frames(target_frames: int, clip_frames: int) -> None:
    """The one length rule, in latent frames: clip (its whole frames) plus target at most 30 s."""
    total = target_frames + clip_frames
    if total > MAX_TOTAL_FRAMES:
        raise InputError(
            f"clip ({clip_frames / FRAME_RATE:.2f} s) plus target ({target_frames / FRAME_RATE:.2f} s) is "
            f"{total / FRAME_RATE:.2f} s; the model renders at most {MAX_TOTAL_SECONDS:g} s in total"
        )


@dataclass(frozen=True)
class AudioClip:
    """A decoded clip: mono float32 samples at ``sample_rate`` (the clip's own rate)."""

    samples: np.ndarray  # [t] float32
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


@dataclass(frozen=True)
class RenderRequest:
    """One job for the engine. ``None`` knobs take the deploy config's defaults (Flash pins its own)."""

    instruction: str
    audio: AudioClip | None = None
    gen_seconds: float | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    sway: float | None = None
    seed: int | None = None
    vae_sample: bool = False  # sample the VAE posterior of the clip (seeded) instead of taking its mean


@dataclass
class RenderResult:
    """A rendered waveform: float32 mono at 24 kHz, exactly ``ceil(50 * gen_seconds) * 480`` samples."""

    waveform: np.ndarray  # [samples] float32
    seed: int
    num_inference_steps: int
    guidance_scale: float
    sample_rate: int = SAMPLE_RATE
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage: encode, dit, decode, total

    @property
    def duration_s(self) -> float:
        return len(self.waveform) / self.sample_rate
