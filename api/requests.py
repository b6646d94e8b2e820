"""The API's own request body: the speech request, OpenAI's ``POST /v1/audio/speech`` body, vLLM-Omni's AuK fields
and this service's extras, turned into a ``JobRequest`` (the job's shape shared with the worker,
``auk_worker/service/records/requests.py``) and its resolved clip. The answers' shapes are in ``responses.py``.

Fields, by origin:

- OpenAI: ``model``, ``input``, ``voice``, ``instructions``, ``response_format``, ``speed`` (1.0 only: AuK has no
  speed control; a speed edit is an instruction), ``stream_format`` (``audio`` is not offered: the whole clip
  renders at once).
- vLLM-Omni's AuK serving: ``task_type`` (``Base``, ``CustomVoice``), ``ref_audio``, ``duration_seconds``,
  ``extra_params`` (``num_inference_steps``, ``guidance_scale``, ``sway``), ``seed``, ``stream`` (false only),
  ``sample_rate`` (24000 only).
- This service: ``variant``, ``num_inference_steps``, ``guidance_scale``, ``sway``, ``audio`` (``{"upload_id"}`` or
  ``{"key"}``, as on jobs), ``custom_id``.

The instruction is chosen as vLLM-Omni's AuK adapter chooses it: a non-blank ``instructions`` is the whole AuK
instruction (``input`` is then ignored); otherwise ``task_type`` ``Base`` makes ``Say the following with the same
voice: "<input>"`` and ``CustomVoice`` makes ``Say the following: "<input>"`` (unless ``input`` already starts with
one of those); otherwise ``input`` is the text to speak, as OpenAI means it (up to 4 096 characters; an input that
is already one of AuK's speaking instructions stays the whole instruction): the service writes the instruction
(zero-shot with a clip, a described voice without) and splits a long text into segments (``auk_worker/longform``).
Without ``duration_seconds`` the length is estimated from the text.

The clip is at most one of ``voice`` (a ``voice_id``), ``ref_audio`` (base64, a ``data:`` URL, or an ``http(s)``
URL fetched only from hosts ``AUK_FETCH_ALLOW`` lists, through ``urlguard.py``) and ``audio``. An inline clip is
stored once per owner and content (``clips/<owner>/<sha256>``) so that the job's record points at a durable copy.

``ref_text`` (vLLM-Omni's: the clip's transcript) and ``language`` size the estimated length (``longform/duration.py``)
and pick the instruction's wording. Other fields of OpenAI's or vLLM-Omni's shapes (``speaker_embedding``...) are
refused by name as unknown fields: this model cannot honour them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.deps import Services
from api.submit import ClipResolver
from auk_worker import formats, rules
from auk_worker.audio import decode_audio
from auk_worker.errors import InputError, TooLarge
from auk_worker.longform.instructions import speaks
from auk_worker.longform.text import MAX_SPEECH_TEXT_CHARS, clean_text
from auk_worker.service.records.requests import AudioRef, JobRequest
from auk_worker.service.records.objects import clip_key
from auk_worker.types import SAMPLE_RATE
from auk_worker.urlguard import UrlGuard, UrlPolicy, pinned_request

# Names a caller may give as ``model``, and the variant each means (None: the request's ``variant``, else base).
MODELS: dict[str, str | None] = {
    "auk": None, "tencent/AuK": "base", "AuK": "base", "auk-base": "base",
    "tencent/AuK-Flash": "flash", "AuK-Flash": "flash", "auk-flash": "flash",
    "tts-1": None, "tts-1-hd": None, "gpt-4o-mini-tts": None,  # OpenAI's names, for SDK defaults
}  # fmt: skip
TASK_TEMPLATES = {"Base": "Say the following with the same voice: ", "CustomVoice": "Say the following: "}
EXTRA_PARAMS = ("num_inference_steps", "guidance_scale", "sway")
FETCH_TIMEOUT_S = 10.0


class SpeechRequest(BaseModel):
    """The body of ``POST /v1/audio/speech``; unknown fields are refused by name."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "auk", "input": "The last train leaves at midnight.", "voice": "voice_3f9a1c2b",
         "task_type": "Base", "response_format": "mp3"},
        {"model": "auk", "input": "Welcome back.", "instructions": "A calm narrator: \"Welcome back.\"",
         "duration_seconds": 3.0, "response_format": "wav", "seed": 7},
    ]})  # fmt: skip

    model: str | None = None
    input: str = Field(default="", max_length=MAX_SPEECH_TEXT_CHARS)
    voice: str | dict[str, str] | None = None
    instructions: str | None = Field(default=None, max_length=rules.MAX_INSTRUCTION_CHARS)
    response_format: str = formats.DEFAULT_FORMAT
    speed: float | None = None
    stream: bool | None = None
    stream_format: str | None = None
    sample_rate: int | None = None
    task_type: Literal["Base", "CustomVoice", "VoiceDesign"] | None = None
    ref_audio: str | list[str] | None = None
    duration_seconds: float | None = Field(default=None, allow_inf_nan=False)
    extra_params: dict[str, Any] | None = None
    seed: int | None = None
    variant: Literal["base", "flash"] | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    sway: float | None = None
    audio: AudioRef | None = None
    custom_id: str | None = Field(default=None, max_length=256)
    ref_text: str | None = Field(default=None, min_length=1, max_length=rules.MAX_INSTRUCTION_CHARS)
    language: str | None = Field(default=None, min_length=2, max_length=16)

    @field_validator("voice", mode="before")
    @classmethod
    def _voice(cls, voice: object) -> object:
        """OpenAI's newer SDKs send ``{"id": ...}`` for a custom voice; an empty string is no voice."""
        if isinstance(voice, dict):
            if set(voice) != {"id"}:
                raise ValueError("a voice object holds exactly one field, 'id'")
            voice = voice["id"]
        return voice or None


def _refuse(field: str, message: str) -> InputError:
    return InputError(f"{field}: {message}", code="unsupported_field")


def instruction_of(body: SpeechRequest) -> str:
    """The AuK instruction, chosen as vLLM-Omni's AuK adapter chooses it (see the module docstring)."""
    if body.instructions and body.instructions.strip():
        return body.instructions.strip()
    text = body.input.strip()
    if not text:
        raise InputError("input: give the text (or the whole AuK instruction in instructions)")
    if body.task_type in TASK_TEMPLATES and not text.startswith(tuple(TASK_TEMPLATES.values())):
        return TASK_TEMPLATES[body.task_type] + json.dumps(text, ensure_ascii=False)
    return text


def is_plain_text(body: SpeechRequest) -> bool:
    """``input`` is the text to speak (OpenAI's meaning) unless ``instructions`` or ``task_type`` is given (vLLM-Omni's
    adapter) or ``input`` is already one of AuK's speaking instructions."""
    has_instructions = bool(body.instructions and body.instructions.strip())
    return not has_instructions and body.task_type is None and not speaks(body.input.strip())


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
    if body.speed is not None and body.speed != 1.0:
        raise _refuse("speed", f"only 1.0 is supported, got {body.speed!r} (ask for a speed edit in the instruction)")
    if body.stream:
        raise _refuse("stream", "streaming is not offered: the whole clip renders at once; send stream=false")
    if body.stream_format is not None:
        raise _refuse("stream_format", f"{body.stream_format!r} is not offered: the answer is the whole file")
    if body.sample_rate is not None and body.sample_rate != SAMPLE_RATE:
        raise _refuse("sample_rate", f"the audio is rendered at {SAMPLE_RATE} Hz only, got {body.sample_rate!r}")
    if body.task_type == "VoiceDesign":
        raise _refuse("task_type", "'VoiceDesign' is not an AuK task; describe the voice in the instruction")
    if isinstance(body.ref_audio, list):
        raise _refuse("ref_audio", "one reference clip per request")
    given = [name for name in ("voice", "ref_audio", "audio") if getattr(body, name) is not None]
    if len(given) > 1:
        raise _refuse(given[1], f"give one clip: {' and '.join(given)} were both given")
    try:
        formats.get_format(body.response_format)
    except InputError as exc:
        raise InputError(f"response_format: {exc.message}", code=exc.code) from None


def to_job(body: SpeechRequest) -> JobRequest:
    """The ``JobRequest`` the speech request stands for (its inline ``ref_audio`` is resolved separately)."""
    check_unsupported(body)
    fields: dict[str, Any] = {
        "variant": _variant(body),
        "response_format": body.response_format,
        "priority": "interactive",
        **_knobs(body),
    }
    if is_plain_text(body):  # OpenAI's shape: the text to speak; the service writes the instruction and splits it
        fields["text"] = clean_text(body.input, "input", MAX_SPEECH_TEXT_CHARS)
    else:
        fields["instruction"] = instruction_of(body)
    for name, value in (("gen_seconds", body.duration_seconds), ("seed", body.seed), ("custom_id", body.custom_id),
                        ("voice", body.voice), ("audio", body.audio), ("ref_text", body.ref_text),
                        ("language", body.language)):  # fmt: skip
        if value is not None:
            fields[name] = value
    return JobRequest.model_validate(fields, context={"has_clip": body.ref_audio is not None})


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


def resolve_clip(svc: Services, owner: str, body: SpeechRequest, request: JobRequest) -> dict[str, Any] | None:
    """The clip the job will read: an inline ``ref_audio`` decoded, checked and stored (content-addressed), or the
    voice or upload as any job resolves it."""
    if body.ref_audio is None:
        return ClipResolver(svc, owner).resolve(request)
    data = ref_audio_bytes(svc, body.ref_audio)
    # AudioError (422) names what is wrong with the clip
    clip = decode_audio(data, max_seconds=svc.settings.max_recording_s)
    digest = hashlib.sha256(data).hexdigest()
    key = clip_key(svc.settings.s3_prefix, owner, digest)
    svc.storage.put_bytes(key, data, "application/octet-stream", {"owner": owner})
    return {"bucket": svc.storage.bucket, "key": key, "duration_s": round(clip.duration_s, 6),
            "sample_rate": clip.sample_rate, "samples": len(clip.samples), "sha256": digest}  # fmt: skip
