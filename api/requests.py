"""The speech request: OpenAI's ``POST /v1/audio/speech`` body, vLLM-Omni's speech fields (and its AuK serving's), and
this service's extras, turned into a ``JobRequest`` and its resolved clip. ``docs/speech.md`` has the table of every
field and what is done with it.

What the text is:

- With a ``voice`` (a built-in name such as ``alloy``, a voice's id or name) or a ``task_type``, ``input`` is the text
  to speak, made into AuK's instruction by ``api/voicing.py`` (a described voice: instruct TTS, with
  ``instructions`` as a speaking style; a clip: zero-shot TTS). ``task_type`` ``VoiceDesign`` takes the voice's
  description from ``instructions``; ``CustomVoice`` without a voice speaks in ``default``.
- With a blank ``input``, a non-blank ``instructions`` is the whole AuK instruction (vLLM-Omni's AuK shape).
- Without a voice, ``input`` is spoken in the ``default`` voice; an ``input`` that already starts with one of AuK's
  sentences is taken as the whole instruction.

The length is ``duration_seconds``, else estimated (``auk_worker/longform/duration.py``): from the text at
``speed`` (and ``language``, ``ref_text``); for a whole instruction, from the words it quotes, or the clip's
length for a recording task. A text longer than one pass is spoken in segments and joined into one file.

The clip is at most one of a clip ``voice``, ``ref_audio`` (base64, a ``data:`` URL, or an ``http(s)`` URL fetched
only from hosts ``AUK_FETCH_ALLOW`` lists, through ``urlguard.py``) and ``audio``. An inline clip is stored once per
owner and content (``clips/<owner>/<sha256>``) so that the job's record points at a durable copy.

Errors name the fields as this request names them (``duration_seconds``, never the job's ``gen_seconds``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Any, Literal

import httpx
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from api.deps import Services
from api.submit import ClipResolver
from api.voicing import compose
from auk_worker import formats, rules
from auk_worker.audio import decode_audio
from auk_worker.errors import InputError, TooLarge
from auk_worker.longform.duration import SPEED_MAX, SPEED_MIN, language_code
from auk_worker.longform.text import MAX_SPEECH_TEXT_CHARS
from auk_worker.service.records.requests import AudioRef, JobRequest
from auk_worker.service.records.objects import clip_key
from auk_worker.types import SAMPLE_RATE
from auk_worker.urlguard import UrlGuard, UrlPolicy, pinned_request
from auk_worker.voice_catalogue import NamedVoice

# Names a caller may give as ``model``, and the variant each means (None: the request's ``variant``, else base).
MODELS: dict[str, str | None] = {
    "auk": None, "tencent/AuK": "base", "AuK": "base", "auk-base": "base",
    "tencent/AuK-Flash": "flash", "AuK-Flash": "flash", "auk-flash": "flash",
    "tts-1": None, "tts-1-hd": None, "gpt-4o-mini-tts": None, "gpt-4o-mini-tts-2025-12-15": None,  # OpenAI's names
}  # fmt: skip
AUK_SENTENCES = ("Say the following", "Generate speech based on the following description", "请基于下面的描述")
EXTRA_PARAMS = ("num_inference_steps", "guidance_scale", "sway")
FETCH_TIMEOUT_S = 10.0
SPEECH_FORMAT = "mp3"  # OpenAI's default answer on this route (jobs keep formats.DEFAULT_FORMAT, WAV)
# The job's names for what this request calls otherwise: errors from the job's rules are said in the caller's terms.
JOB_NAMES = {"gen_seconds": "duration_seconds"}


class SpeechRequest(BaseModel):
    """The body of ``POST /v1/audio/speech``; unknown fields are refused by name."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "tts-1", "input": "The last train leaves at midnight.", "voice": "alloy"},
        {"model": "auk", "input": "Welcome back.", "voice": "nova", "instructions": "Speak cheerfully.",
         "speed": 1.25, "response_format": "mp3", "stream_format": "audio"},
        {"model": "auk", "input": "", "instructions": "Say the following with the same voice: \"Welcome back.\"",
         "ref_audio": "data:audio/wav;base64,UklGRi...", "duration_seconds": 3.0, "response_format": "wav",
         "seed": 7},
    ]})  # fmt: skip

    # OpenAI's fields
    model: str | None = None
    input: str = Field(default="", max_length=MAX_SPEECH_TEXT_CHARS)  # OpenAI's limit; longer texts split
    voice: str | dict[str, str] | None = Field(default=None, validation_alias=AliasChoices("voice", "speaker"))
    instructions: str | None = Field(default=None, max_length=rules.MAX_INSTRUCTION_CHARS)
    response_format: str = SPEECH_FORMAT
    speed: float | None = Field(default=None, ge=SPEED_MIN, le=SPEED_MAX, strict=True,
                                allow_inf_nan=False)  # fmt: skip
    stream_format: Literal["audio", "sse"] | None = None
    # vLLM-Omni's speech fields
    stream: bool | None = Field(default=None, strict=True)
    task_type: Literal["Base", "CustomVoice", "VoiceDesign"] | None = None
    language: str | None = Field(default=None, max_length=32)
    ref_audio: str | list[str] | None = None
    ref_text: str | None = Field(default=None, max_length=rules.MAX_INSTRUCTION_CHARS)
    x_vector_only_mode: bool | None = Field(default=None, strict=True)
    speaker_embedding: list[float] | None = None
    max_new_tokens: int | None = Field(default=None, ge=1, strict=True)
    initial_codec_chunk_frames: int | None = Field(default=None, ge=0, strict=True)
    # vLLM-Omni's AuK serving's fields
    sample_rate: int | None = Field(default=None, strict=True)
    duration_seconds: float | None = Field(default=None, gt=0, le=rules.MAX_TOTAL_SECONDS, strict=True,
                                           allow_inf_nan=False)  # fmt: skip
    extra_params: dict[str, Any] | None = None
    seed: int | None = Field(default=None, ge=rules.SEED.low, lt=rules.SEED.high, strict=True)
    # this service's
    variant: Literal["base", "flash"] | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    sway: float | None = None
    audio: AudioRef | None = None
    custom_id: str | None = Field(default=None, max_length=256)

    @field_validator("voice", mode="before")
    @classmethod
    def _voice(cls, voice: object) -> object:
        """OpenAI's newer SDKs send ``{"id": ...}`` for a custom voice; an empty string is no voice."""
        if isinstance(voice, dict):
            if set(voice) != {"id"}:
                raise ValueError("a voice object holds exactly one field, 'id'")
            voice = voice["id"]
        return voice or None

    @property
    def streams(self) -> str | None:
        """How the answer goes out: None (one body), ``audio`` (chunked) or ``sse`` (events)."""
        if self.stream_format == "sse":
            return "sse"
        if self.stream or self.stream_format == "audio":
            return "audio"
        return None


def _refuse(field: str, message: str) -> InputError:
    return InputError(f"{field}: {message}", code="unsupported_field")


def _text_fields(body: SpeechRequest) -> dict[str, Any]:
    """The job's fields for the text: a whole ``instruction``, or ``input`` and what goes with it."""
    text = body.input.strip()
    whole = body.instructions.strip() if body.instructions else ""
    if not text:
        if not whole:
            raise InputError("input: give the text to speak (or the whole AuK instruction in instructions)")
        return _whole(body, whole)
    if text.startswith(AUK_SENTENCES):
        return _whole(body, text)
    fields: dict[str, Any] = {"input": text, "language": body.language, "speed": body.speed,
                              "ref_text": body.ref_text}  # fmt: skip
    if body.task_type == "VoiceDesign":
        if not whole:
            raise InputError("instructions: task_type VoiceDesign describes the voice in instructions")
        if body.voice is not None:
            raise InputError("voice: task_type VoiceDesign makes the voice from instructions; give no voice")
        fields["voice"] = None
        fields["design"] = whole
    else:
        fields["instructions"] = whole or None
    return fields


def _whole(body: SpeechRequest, instruction: str) -> dict[str, Any]:
    """A whole AuK instruction: ``language`` and ``ref_text`` have nothing to act on and are let pass (vLLM-Omni's
    clients send them); a speed would be lost, so it is refused."""
    if body.speed is not None and body.speed != 1.0:
        raise _refuse("speed", "scales the length of a text given as input; with a whole instruction, give "
                               "duration_seconds (or ask for the speed in the instruction)")  # fmt: skip
    if body.language is not None:
        language_code(body.language)  # refused by name when it is not a language
    return {"instruction": instruction}


def design_voice(description: str) -> NamedVoice:
    """The voice ``task_type`` ``VoiceDesign`` describes; its seed follows from the description, so the same
    description is the same voice."""
    digest = hashlib.sha256(description.encode()).digest()
    return NamedVoice("design", description, int.from_bytes(digest[:8], "big") % rules.SEED.high)


def _variant(body: SpeechRequest) -> str:
    if body.model is not None and body.model not in MODELS:
        raise _refuse("model", f"unknown model {body.model!r}; use one of {', '.join(MODELS)}")
    implied = MODELS.get(body.model) if body.model is not None else None
    if implied is not None and body.variant is not None and implied != body.variant:
        raise _refuse("variant", f"{body.variant!r} contradicts model {body.model!r}")
    return implied or body.variant or "base"


def _knobs(body: SpeechRequest) -> dict[str, Any]:
    """Sampling knobs from the top level and ``extra_params`` (vLLM-Omni's place for them); the same knob twice
    with two values is refused."""
    extra = dict(body.extra_params or {})
    for key in list(extra):
        if key == "vae_sample" and extra[key] is False:
            extra.pop(key)
        elif key not in EXTRA_PARAMS:
            raise _refuse(f"extra_params.{key}", f"not supported; this service takes {', '.join(EXTRA_PARAMS)}")
    knobs: dict[str, Any] = {}
    for name in EXTRA_PARAMS:
        top, inner = getattr(body, name), extra.get(name)
        if top is not None and inner is not None and top != inner:
            raise _refuse(name, f"given as {top!r} and as extra_params.{name} {inner!r}")
        value = top if top is not None else inner
        if value is not None:
            knobs[name] = value
    return knobs


def check_unsupported(body: SpeechRequest) -> None:
    """Refuse, by name, what this service cannot do."""
    if body.sample_rate is not None and body.sample_rate != SAMPLE_RATE:
        raise _refuse("sample_rate", f"the audio is rendered at {SAMPLE_RATE} Hz only, got {body.sample_rate!r}")
    if body.x_vector_only_mode:
        raise _refuse("x_vector_only_mode", "AuK has no speaker-embedding mode; it reads the whole clip")
    if body.speaker_embedding is not None:
        raise _refuse("speaker_embedding", "AuK takes a clip or a description, not an embedding vector")
    if isinstance(body.ref_audio, list):
        raise _refuse("ref_audio", "one reference clip per request")
    given = [name for name in ("voice", "ref_audio", "audio") if getattr(body, name) is not None]
    if len(given) > 1:
        raise _refuse(given[1], f"give one clip or voice: {' and '.join(given)} were both given")
    try:
        spec = formats.get_format(body.response_format)
    except InputError as exc:
        raise InputError(f"response_format: {exc.message}", code=exc.code) from None
    if body.streams is not None and not spec.streams:
        offered = ", ".join(name for name, fmt in formats.FORMATS.items() if fmt.streams)
        field = "stream_format" if body.stream_format else "stream"
        raise _refuse(field, f"{spec.name} does not stream (its header or index needs the whole file); "
                             f"stream one of {offered}, or ask for the whole file")  # fmt: skip


def to_job(body: SpeechRequest) -> tuple[JobRequest, str | None]:
    """The ``JobRequest`` the speech request stands for, before its text is composed (``compose``), and the voice
    description of a ``VoiceDesign`` request."""
    check_unsupported(body)
    text = _text_fields(body)
    design = text.pop("design", None)
    fields: dict[str, Any] = {
        "variant": _variant(body),
        "response_format": body.response_format,
        "priority": "interactive",
        **_knobs(body),
        **{name: value for name, value in text.items() if value is not None},
    }
    for name, value in (("gen_seconds", body.duration_seconds), ("seed", body.seed), ("custom_id", body.custom_id),
                        ("voice", body.voice), ("audio", body.audio)):  # fmt: skip
        if value is not None and not (name == "voice" and design):
            fields[name] = value
    has_clip = body.ref_audio is not None
    try:
        return JobRequest.model_validate(fields, context={"has_clip": has_clip}), design
    except ValidationError as exc:
        raise in_callers_terms(exc) from None


def in_callers_terms(exc: ValidationError | InputError) -> InputError:
    """A job rule's error said with this request's field names."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            field = ".".join(JOB_NAMES.get(str(p), str(p)) for p in err.get("loc", ()))
            message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            parts.append(f"{field}: {message}" if field else message)
        message, code = "; ".join(parts), "invalid_request"
        for job_name, name in JOB_NAMES.items():
            message = message.replace(job_name, name)
        return InputError(message, code=code)
    message = exc.message
    for job_name, name in JOB_NAMES.items():
        message = message.replace(job_name, name)
    exc.args = (message, *exc.args[1:])  # the same error (class, code, details), said in the caller's terms
    return exc


def design_or_none(design: str | None) -> NamedVoice | None:
    """A ``VoiceDesign`` request's voice: its description, with the default voice's seed."""
    return design_voice(design) if design is not None else None

def ref_audio_bytes(svc: Services, ref: str) -> bytes:
    """The bytes of a ``ref_audio``: base64 (optionally as a ``data:`` URL), or an allowed ``http(s)`` URL."""
    limit = svc.settings.max_upload_bytes
    if ref.startswith(("http://", "https://")):
        guard = UrlGuard(UrlPolicy.parse(svc.settings.fetch_allow, public=False))
        checked = guard.check(ref)  # UrlNotAllowed unless AUK_FETCH_ALLOW names the host
        with httpx.Client(timeout=FETCH_TIMEOUT_S, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            try:
                response = pinned_request(client, "GET", checked, stream=True)
            except httpx.HTTPError as exc:
                raise InputError(f"ref_audio: fetching {ref!r} failed: {exc}", code="fetch_failed") from None
            try:
                if response.status_code != 200:
                    raise InputError(f"ref_audio: {ref!r} answered HTTP {response.status_code}", code="fetch_failed")
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise TooLarge(f"ref_audio: {ref!r} is larger than the limit of {limit} bytes")
                return bytes(data)
            finally:
                response.close()
    if ref.startswith("data:"):
        header, comma, ref = ref.partition(",")
        if not comma or not header.endswith(";base64"):
            raise InputError("ref_audio: a data URL must be base64 (data:audio/wav;base64,...)")
    if len(ref) > limit * 4 // 3 + 4:
        raise TooLarge(f"ref_audio is larger than the limit of {limit} bytes")
    try:
        return base64.b64decode(ref, validate=True)
    except (binascii.Error, ValueError):
        raise InputError("ref_audio: not base64 data, a data: URL or an http(s) URL") from None


def resolve_clip(svc: Services, body: SpeechRequest, request: JobRequest,
                 resolver: ClipResolver) -> dict[str, Any] | None:
    """The clip the job will read: an inline ``ref_audio`` decoded, checked and stored (content-addressed), or the
    voice or upload as any job resolves it."""
    owner = resolver.owner
    if body.ref_audio is None:
        return resolver.resolve(request)
    data = ref_audio_bytes(svc, body.ref_audio)
    clip = decode_audio(data, max_seconds=svc.settings.max_recording_s)  # AudioError (422) names what is wrong
    digest = hashlib.sha256(data).hexdigest()
    key = clip_key(svc.settings.s3_prefix, owner, digest)
    svc.storage.put_bytes(key, data, "application/octet-stream", {"owner": owner})
    return {"bucket": svc.storage.bucket, "key": key, "duration_s": round(clip.duration_s, 6),
            "sample_rate": clip.sample_rate, "samples": len(clip.samples), "sha256": digest}  # fmt: skip
