"""The request shape shared by the API (which validates it) and the worker (which reads it back from the record).

Pydantic v2 models that refuse unknown fields. The one rule that needs the clip's duration (clip plus target at
most 30 s) is ``check_total_length``, called once the clip has been decoded or its duration is known.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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

    @field_validator("key")
    @classmethod
    def _plain_key(cls, key: str | None) -> str | None:
        """An object key as S3 servers accept it: at most 1024 UTF-8 bytes, no control characters, no leading
        ``/`` and no ``.`` or ``..`` segment (refused here by name rather than as the server's bare 400)."""
        if key is None:
            return key
        if len(key.encode()) > 1024:
            raise ValueError("an object key is at most 1024 bytes (UTF-8)")
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
            raise ValueError("an object key must not contain control characters")
        if key.startswith("/") or any(part in (".", "..") for part in key.split("/")):
            raise ValueError(f"{key!r} is not a plain object key (no leading '/', no '.' or '..' segments)")
        return key

    @model_validator(mode="after")
    def _exactly_one(self) -> AudioRef:
        if (self.upload_id is None) == (self.key is None):
            raise ValueError("audio needs exactly one of upload_id or key")
        return self


class JobRequest(BaseModel):
    """One render job as a caller submits it (a REST body or a batch line)."""

    model_config = ConfigDict(extra="forbid")

    # Numbers are strict: "2" or true is refused rather than read as 2 or 1, and NaN and infinities by name.
    instruction: str = Field(min_length=1, max_length=4000)
    audio: AudioRef | None = None
    gen_seconds: float | None = Field(default=None, gt=0, le=MAX_TOTAL_SECONDS, strict=True, allow_inf_nan=False)
    variant: Variant = "base"
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000, strict=True)
    guidance_scale: float | None = Field(default=None, ge=0, le=20, strict=True, allow_inf_nan=False)
    sway: float | None = Field(default=None, ge=-1, le=0, strict=True, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, strict=True)
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
