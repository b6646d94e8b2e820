"""The request shape shared by the API (which validates it) and the worker (which reads it back from the record).

Pydantic v2 models that refuse unknown fields. The one rule that needs the clip's duration (clip plus target at
most 30 s) is ``check_total_length``, called once the clip has been decoded or its duration is known.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from auk_worker.errors import InputError
from auk_worker.types import HOP, MAX_TOTAL_SECONDS, SAMPLE_RATE, check_total_frames, frames_for_seconds

Variant = Literal["base", "flash"]
OutputFormat = Literal["pcm16", "float32"]
Priority = Literal["interactive", "bulk"]


class AudioRef(BaseModel):
    """The job's single clip: an upload made through the API or an object key in the input bucket."""

    model_config = ConfigDict(extra="forbid")

    upload_id: str | None = Field(default=None, min_length=1, max_length=128)
    key: str | None = Field(default=None, min_length=1, max_length=1024)

    @model_validator(mode="after")
    def _exactly_one(self) -> AudioRef:
        if (self.upload_id is None) == (self.key is None):
            raise ValueError("audio needs exactly one of upload_id or key")
        return self


class JobRequest(BaseModel):
    """One render job as a caller submits it (a REST body or a batch line)."""

    model_config = ConfigDict(extra="forbid")

    instruction: str = Field(min_length=1, max_length=4000)
    audio: AudioRef | None = None
    gen_seconds: float | None = Field(default=None, gt=0, le=MAX_TOTAL_SECONDS)
    variant: Variant = "base"
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0, le=20)
    sway: float | None = Field(default=None, ge=-1, le=0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    output_format: OutputFormat = "pcm16"
    custom_id: str | None = Field(default=None, max_length=256)
    priority: Priority = "interactive"

    @model_validator(mode="after")
    def _length_given(self) -> JobRequest:
        if not self.instruction.strip():
            raise ValueError("instruction must not be blank")
        if self.audio is None and self.gen_seconds is None:
            raise ValueError("gen_seconds is required when no audio is given")
        return self


def check_total_length(request: JobRequest, clip_seconds: float | None) -> float:
    """Return the target length in seconds; refuse clip plus target over 30 s.

    Without ``gen_seconds`` the target defaults to the clip's own length.
    """
    clip = clip_seconds or 0.0
    target = request.gen_seconds if request.gen_seconds is not None else clip
    if target <= 0:
        raise InputError("gen_seconds is required when no audio is given")
    # The engine's rule, on the same whole frames it will count (the clip's at 24 kHz, the target's rounded up).
    clip_frames = round(clip * SAMPLE_RATE) // HOP
    target_frames = frames_for_seconds(target) if request.gen_seconds is not None else clip_frames
    check_total_frames(target_frames, clip_frames)
    return target
