"""``POST /v1/uploads``: validate and store one audio clip for later jobs.

The clip is decoded with the same code the worker uses (so a clip that uploads is a clip that renders), the
original bytes go to ``uploads/<id>`` in the result bucket, and ``auk:upload:<id>`` in Redis records its owner
and what was decoded. Jobs refer to it as ``{"audio": {"upload_id": ...}}``.
"""

from __future__ import annotations

import io
import logging
import uuid
from dataclasses import dataclass

import soundfile as sf
from fastapi import APIRouter, Depends, File, UploadFile

from api.app import Services, services
from api.auth import caller
from api.errors import too_large
from auk_worker.audio import decode_audio
from auk_worker.service.storage import upload_key

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["uploads"])

READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class UploadInfo:
    upload_id: str
    owner: str
    key: str
    duration_s: float
    sample_rate: int
    channels: int

    def public(self) -> dict:
        return {"upload_id": self.upload_id, "duration_s": self.duration_s,
                "sample_rate": self.sample_rate, "channels": self.channels}


def _redis_key(upload_id: str) -> str:
    return f"auk:upload:{upload_id}"


def load_upload(svc: Services, upload_id: str, owner: str) -> UploadInfo | None:
    """The caller's upload, or None when it does not exist or belongs to another key."""
    fields = svc.redis.hgetall(_redis_key(upload_id))
    if not fields or fields.get("owner") != owner:
        return None
    return UploadInfo(
        upload_id=upload_id, owner=owner, key=fields["key"], duration_s=float(fields["duration_s"]),
        sample_rate=int(fields["sample_rate"]), channels=int(fields["channels"]),
    )


def _read_limited(file: UploadFile, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := file.file.read(READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise too_large("the upload", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _channels(data: bytes) -> int:
    return sf.info(io.BytesIO(data)).channels


@router.post("/uploads", status_code=201, summary="Upload an audio clip")
def create_upload(
    file: UploadFile = File(..., description="an audio file soundfile can decode (WAV, FLAC, OGG...)"),
    owner: str = Depends(caller),
    svc: Services = Depends(services),
) -> dict:
    """Decode and store a clip; answers its id, duration, sample rate and channel count."""
    data = _read_limited(file, svc.settings.max_upload_bytes)
    clip = decode_audio(data)  # AudioError (422) names what is wrong with the file
    channels = _channels(data)

    upload_id = uuid.uuid4().hex
    key = upload_key(svc.settings.s3_prefix, upload_id)
    svc.storage.put_bytes(key, data, file.content_type or "application/octet-stream", {"owner": owner})
    info = UploadInfo(upload_id=upload_id, owner=owner, key=key, duration_s=round(clip.duration_s, 6),
                      sample_rate=clip.sample_rate, channels=channels)
    svc.redis.hset(_redis_key(upload_id), mapping={
        "owner": owner, "key": key, "duration_s": repr(info.duration_s),
        "sample_rate": str(info.sample_rate), "channels": str(info.channels),
    })
    log.info("upload %s: %d bytes, %.2f s at %d Hz, %d channels", upload_id, len(data), clip.duration_s,
             clip.sample_rate, channels)
    return info.public()
