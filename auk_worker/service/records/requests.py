"""The request shape shared by the API (which validates it) and the worker (which reads it back from the record).

Pydantic v2 models that refuse unknown fields, their bounds and rules taken from ``rules.py``. The one rule that
needs the clip (clip plus target at most 30 s, in latent frames) is applied once the clip is resolved: by the API's
submit path on the clip's sample count and rate, by the worker on the decoded clip.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from auk_worker import formats, rules
from auk_worker.longform import instructions as longform_instructions
from auk_worker.longform.duration import SPEED_MAX, SPEED_MIN, language_code
from auk_worker.longform.text import MAX_JOB_TEXT_CHARS

Variant = Literal["base", "flash"]
Priority = Literal["interactive", "bulk"]
Task = Literal[tuple(longform_instructions.TASKS)]  # type: ignore[valid-type]
MAX_LONG_SECONDS = 36_000.0  # a given length for a text: ten hours


class AudioRef(BaseModel):
    """The job's single clip (a voice is the other way to give one): an upload made through the API (by id, this
    key's own) or an object key relative to the operator's input location (``AUK_S3_INPUT_BUCKET`` +
    ``AUK_S3_INPUT_PREFIX``)."""

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

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"instruction": "Say the following with the same voice: \"The last train leaves at midnight.\"",
         "audio": {"upload_id": "9f1c2e4b7a8d4c0e9b6a5f3d2c1b0a99"}, "num_inference_steps": 32, "seed": 7,
         "response_format": "flac"},
        {"instruction": "A calm narrator: \"Welcome back.\"", "gen_seconds": 3.5, "variant": "base",
         "custom_id": "welcome-1"},
        {"input": "Good morning, and welcome aboard.", "voice": "nova", "instructions": "Speak cheerfully.",
         "response_format": "mp3", "custom_id": "greeting-1"},
    ]})  # fmt: skip

    # Numbers are strict: "2" or true is refused rather than read as 2 or 1, and NaN and infinities by name.
    # Either AuK's whole ``instruction``, or its parts, from which the service writes it (``longform/``): the
    # ``text`` to speak (up to 100 000 characters: split into segments), a voice ``description`` (or a clip) and an
    # extra ``style``, or a recording ``task`` (denoise, enhance...). Without ``gen_seconds`` the length is estimated.
    instruction: str | None = Field(default=None, min_length=1, max_length=rules.MAX_INSTRUCTION_CHARS)
    text: str | None = Field(default=None, max_length=MAX_JOB_TEXT_CHARS)
    task: Task | None = None
    description: str | None = Field(default=None, min_length=1, max_length=1000)
    style: str | None = Field(default=None, min_length=1, max_length=1000)
    ref_text: str | None = Field(default=None, min_length=1, max_length=rules.MAX_INSTRUCTION_CHARS)
    language: str | None = Field(default=None, min_length=2, max_length=16)
    speed: float | None = Field(default=None, ge=SPEED_MIN, le=SPEED_MAX, strict=True, allow_inf_nan=False)
    timestamps: Literal["json", "srt", "vtt"] | None = None
    # OpenAI's shape (speech, and jobs and batch lines alike): ``input`` is the text to speak in ``voice`` (a built-in
    # name, a voice's id or name; none: ``default``) or the clip, ``instructions`` a speaking style; at submit they
    # become the parts above (``api/voicing.py``).
    input: str | None = Field(default=None, min_length=1, max_length=MAX_JOB_TEXT_CHARS)
    instructions: str | None = Field(default=None, max_length=rules.MAX_INSTRUCTION_CHARS)
    audio: AudioRef | None = None
    gen_seconds: float | None = Field(default=None, gt=0, le=MAX_LONG_SECONDS, strict=True,
                                      allow_inf_nan=False)  # fmt: skip
    variant: Variant = "base"
    num_inference_steps: int | None = Field(default=None, ge=rules.STEPS.low, le=rules.STEPS.high, strict=True)
    guidance_scale: float | None = Field(default=None, ge=rules.GUIDANCE.low, le=rules.GUIDANCE.high, strict=True,
                                         allow_inf_nan=False)  # fmt: skip
    sway: float | None = Field(default=None, ge=rules.SWAY.low, le=rules.SWAY.high, strict=True, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=rules.SEED.low, lt=rules.SEED.high, strict=True)
    # ``format`` and the older ``output_format`` (``pcm16``, ``float32``) are accepted for the same field.
    response_format: str = Field(default=formats.DEFAULT_FORMAT, max_length=32,
                                 validation_alias=AliasChoices("response_format", "format", "output_format"))
    voice: str | None = Field(default=None, min_length=1, max_length=128)
    custom_id: str | None = Field(default=None, max_length=256)
    priority: Priority = "interactive"
    # Called when the job ends (checked by urlguard at submit and again at each send; see notify.py).
    webhook_url: str | None = Field(default=None, min_length=1, max_length=2048)

    @field_validator("response_format")
    @classmethod
    def _format(cls, name: str) -> str:
        """The format's canonical name (``formats.py``); an older ``output_format`` value maps to its format."""
        name = name.strip().lower()
        return formats.get_format(formats.LEGACY_NAMES.get(name, name)).name

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> JobRequest:
        """The rules that need no clip (an InputError is a ValueError: pydantic reports it as a validation error):
        AuK's whole instruction or its parts, not both. The length is no longer required here: without it the API
        estimates one once the clip is resolved (``longform/plan.py``). The validation context (``has_clip``, a
        speech request's inline clip) is accepted for the callers that pass it."""
        if self.input is not None:
            if self.text is not None or self.instruction is not None:
                raise ValueError("input is the text to speak: give input, text or instruction, one of them")
            if self.language is not None:
                language_code(self.language)
            if self.audio is not None and self.voice is not None:
                raise ValueError("give audio or voice, not both: a job takes one clip")
            return self
        parts = [name for name in ("text", "task", "description", "style") if getattr(self, name) is not None]
        if self.instruction is None and not parts:
            raise ValueError("instruction (the whole AuK instruction) or input or text (the text to speak) is required")
        if self.instructions is not None:
            raise ValueError("instructions: a speaking style goes with input (the text to speak)")
        if self.instruction is None and self.text is None and self.task is None:
            raise ValueError(f"text (or a task) is required with {' and '.join(parts)}: they describe how to say it")
        if self.instruction is not None and self.ref_text is not None:
            raise ValueError("ref_text: a transcript sizes a text's segments; send the text as text, not inside a "
                             "raw instruction")  # fmt: skip
        if self.instruction is not None:
            if parts:
                raise ValueError(f"instruction: give the whole instruction or its parts ({', '.join(parts)}), "
                                 "not both")  # fmt: skip
            rules.check_instruction(self.instruction)
            if self.gen_seconds is not None and self.gen_seconds > rules.MAX_TOTAL_SECONDS:
                raise ValueError(f"gen_seconds is {self.gen_seconds:g}; a raw instruction renders in one pass of "
                                 f"at most {rules.MAX_TOTAL_SECONDS:g} s (send text to have it split)")  # fmt: skip
        if self.audio is not None and self.voice is not None:
            raise ValueError("give audio or voice, not both: a job takes one clip")
        return self
