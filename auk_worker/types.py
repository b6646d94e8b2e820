"""Plain data that crosses the engine's boundary: what a render asks for and what it returns.

No torch here: the service and the API import these without loading the model. The limits a request must keep
are in ``rules.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SAMPLE_RATE = 24_000  # the VAE's output rate
HOP = 480  # waveform samples per latent frame
FRAME_RATE = SAMPLE_RATE // HOP  # 50 latent frames per second


@dataclass(frozen=True)
class AudioClip:
    """A decoded clip: mono float32 samples at ``sample_rate`` (the clip's own rate)."""

    samples: np.ndarray  # [t] float32
    sample_rate: int
    key: str | None = None  # the content key (SHA-256 of the encoded bytes) the voice cache files it under

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
