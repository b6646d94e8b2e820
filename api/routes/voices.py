"""``/v1/voices``: reusable voices, named by ``voice_id`` (or ``name``) in jobs and speech requests, beside the built-in
voices of ``config/voices.yaml``.

``POST /v1/voices`` takes a multipart ``file`` (and an optional ``name``), JSON ``{"upload_id", "name"}`` for an
upload made earlier, or JSON ``{"description", "name", "seed"?}`` for a voice made from a written description (AuK's
instruct TTS, as the built-in voices are; without a seed one is drawn once and kept, so the voice keeps its timbre).
``GET /v1/voices`` lists the caller's voices, newest first (``limit``, 1 to 500), and the built-in ones. The clip
is decoded as an upload is (a clip that makes a voice is a clip that renders) and
copied to the voice's own object, so the voice outlives its upload. A voice belongs to the key that made it:
another key's voice answers 404 like one that does not exist. ``DELETE`` removes the record and the object; a job
already queued with that voice then fails with ``audio_not_found``.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from api.auth import caller
from api.deps import Services, services
from api.errors import too_large
from api.responses import VoiceDeleted, VoiceList, VoiceOut
from api.openapi import BODY_ERRORS, V1_ERRORS, documented, links
from api.routes.uploads import _channels
from auk_worker import rules
from auk_worker.audio import decode_audio
from auk_worker.errors import InputError, NotFound, UnsupportedMediaType
from auk_worker.service.records.jobs import utc_now
from auk_worker.service.records.objects import voice_key
from auk_worker.service.records.voices import Voice, new_voice_id
from auk_worker.voice_catalogue import MAX_DESCRIPTION_CHARS

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["voices"], responses=V1_ERRORS)

MAX_NAME = 200

_VOICE_BODY_DOC = {
    "requestBody": {
        "required": True,
        "description": "A multipart `file` (and optional `name`), JSON `{\"upload_id\", \"name\"}`, or JSON "
                       "`{\"description\", \"name\", \"seed\"}`.",
        "content": {
            "multipart/form-data": {
                "schema": {"type": "object", "required": ["file"],
                           "properties": {"file": {"type": "string", "format": "binary"}, "name": {"type": "string"}}},
            },
            "application/json": {
                "schema": {"oneOf": [
                    {"type": "object", "required": ["upload_id"], "additionalProperties": False,
                     "properties": {"upload_id": {"type": "string"},
                                    "name": {"type": "string", "maxLength": MAX_NAME}}},
                    {"type": "object", "required": ["description"], "additionalProperties": False,
                     "properties": {"description": {"type": "string", "minLength": 1,
                                                    "maxLength": MAX_DESCRIPTION_CHARS},
                                    "name": {"type": "string", "maxLength": MAX_NAME},
                                    "seed": {"type": "integer", "minimum": 0, "maximum": rules.SEED.high - 1}}},
                ]},
                "examples": {
                    "clip": {"value": {"upload_id": "9f1c2e4b7a8d4c0e9b6a5f3d2c1b0a99", "name": "narrator"}},
                    "description": {"value": {"description": "A warm, low female voice, calm and unhurried.",
                                              "name": "night-narrator"}},
                },
            },
        },
    }
}


def _name(value: object) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise InputError(f"name: a string of at most {MAX_NAME} characters")
    return value


async def _source(request: Request, svc: Services, owner: str) -> tuple[bytes | dict, str, str]:
    """(the clip's bytes, its content type, the voice's name) from a multipart file or an upload id; or the JSON
    body of a described voice."""
    limit = svc.settings.max_upload_bytes
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=4, max_part_size=limit)
        part = form.get("file")
        if not isinstance(part, UploadFile):
            raise InputError("file: a voice needs its clip in a multipart field named 'file'", code="invalid_request")
        data = await part.read(limit + 1)
        if len(data) > limit:
            raise too_large("the voice upload", limit)
        return data, part.content_type or "application/octet-stream", _name(form.get("name"))
    if content_type == "application/json":
        try:
            body = await request.json()
        except ValueError:
            raise InputError("the request body is not valid JSON", code="malformed_json") from None
        if isinstance(body, dict) and "description" in body:
            return body, "", ""
        if not isinstance(body, dict) or not isinstance(body.get("upload_id"), str):
            raise InputError("upload_id: field required (or description, or send the clip as a multipart file)")
        unknown = sorted(set(body) - {"upload_id", "name"})
        if unknown:
            raise InputError(f"{', '.join(unknown)}: unknown field")
        upload = svc.uploads.get(body["upload_id"], owner)
        if upload is None:
            raise InputError(f"upload_id: no upload {body['upload_id']!r} for this API key", code="unknown_upload")
        data = await run_in_threadpool(svc.storage.get_bytes, svc.storage.bucket, upload.key)
        return data, "application/octet-stream", _name(body.get("name"))
    raise UnsupportedMediaType(f"a voice is a multipart file or JSON with an upload_id, not {content_type!r}")


@router.post("/voices", status_code=201, summary="Make a reusable voice from a clip or a description",
             openapi_extra=_VOICE_BODY_DOC,
             **documented(VoiceOut, *BODY_ERRORS, status=201, description="The voice.",
                          follow=links("voice_id", GetVoice=("get_voice", "voice_id"),
                                       DeleteVoice=("delete_voice", "voice_id"))))
async def create_voice(request: Request, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    data, content_type, name = await _source(request, svc, owner)
    if isinstance(data, dict):
        return await run_in_threadpool(_describe_voice, svc, owner, data)
    return await run_in_threadpool(_store_voice, svc, owner, data, content_type, name)


def _describe_voice(svc: Services, owner: str, body: dict) -> dict:
    """A voice made from a written description and a seed (drawn once when not given)."""
    unknown = sorted(set(body) - {"description", "name", "seed"})
    if unknown:
        raise InputError(f"{', '.join(unknown)}: unknown field")
    description = body["description"]
    if not isinstance(description, str) or not description.strip() or len(description) > MAX_DESCRIPTION_CHARS:
        raise InputError(f"description: a string of 1 to {MAX_DESCRIPTION_CHARS} characters")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(rules.SEED.high)
    elif rules.SEED.problem(seed) is not None:
        raise InputError(f"seed {rules.SEED.problem(seed)}, got {seed!r}")
    name = _name(body.get("name"))
    if svc.catalogue.get(name) is not None:
        raise InputError(f"name: {name!r} is a built-in voice's name; choose another")
    voice = Voice(voice_id=new_voice_id(), owner=owner, name=name, key="", sha256="", duration_s=0.0,
                  sample_rate=0, samples=0, channels=0, created_at=utc_now(), description=description.strip(),
                  seed=int(seed))  # fmt: skip
    svc.voices.add(voice)
    log.info("voice %s: described, seed %d, for owner %s", voice.voice_id, voice.seed, owner)
    return voice.public()


def _store_voice(svc: Services, owner: str, data: bytes, content_type: str, name: str) -> dict:
    clip = decode_audio(data)  # AudioError (422) names what is wrong with the file
    voice_id = new_voice_id()
    key = voice_key(svc.settings.s3_prefix, voice_id)
    svc.storage.put_bytes(key, data, content_type, {"owner": owner, "voice-id": voice_id})
    voice = Voice(voice_id=voice_id, owner=owner, name=name, key=key, sha256=hashlib.sha256(data).hexdigest(),
                  duration_s=round(clip.duration_s, 6), sample_rate=clip.sample_rate, samples=len(clip.samples),
                  channels=_channels(data), created_at=utc_now())  # fmt: skip
    svc.voices.add(voice)
    log.info("voice %s: %.2f s at %d Hz for owner %s", voice_id, clip.duration_s, clip.sample_rate, owner)
    return voice.public()


@router.get("/voices", summary="List the caller's voices, newest first, and the built-in voices",
            **documented(VoiceList, 422))
def list_voices(owner: str = Depends(caller), svc: Services = Depends(services),
                limit: Annotated[int, Query(ge=1, le=500)] = 100) -> dict:  # fmt: skip
    return {"object": "list", "data": [voice.public() for voice in svc.voices.list(owner, limit=limit)],
            "builtin": [voice.public() for voice in svc.catalogue.voices.values()]}  # fmt: skip


@router.get("/voices/{voice_id}", summary="Read one voice", **documented(VoiceOut, 404, 422))
def get_voice(voice_id: str, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    voice = svc.voices.get(voice_id, owner)
    if voice is None:
        raise NotFound(f"no voice {voice_id!r}")
    return voice.public()


@router.delete("/voices/{voice_id}", summary="Delete a voice and its clip", **documented(VoiceDeleted, 404, 422))
def delete_voice(voice_id: str, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    voice = svc.voices.delete(voice_id, owner)
    if voice is None:
        raise NotFound(f"no voice {voice_id!r}")
    if voice.key:  # a described voice has no clip
        svc.storage.delete(voice.key)
    log.info("voice %s: deleted by its owner", voice_id)
    return {"voice_id": voice_id, "object": "voice", "deleted": True}
