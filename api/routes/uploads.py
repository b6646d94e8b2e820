"""``POST /v1/uploads``: validate and store one audio clip for later jobs.

The clip is decoded with the same code the worker uses (so a clip that uploads is a clip that renders), the
original bytes go to ``uploads/<id>`` in the result bucket, and the upload store
(``auk_worker/service/records/uploads.py``) records its owner and what was decoded, its exact sample count included. Jobs refer to it as
``{"audio": {"upload_id": ...}}``.
"""

from __future__ import annotations

import hashlib
import io
import logging
import uuid

import soundfile as sf
from fastapi import APIRouter, Depends, File, UploadFile

from api.auth import caller
from api.deps import Services, services
from api.errors import too_large
from api.responses import UploadOut
from api.openapi import BODY_ERRORS, V1_ERRORS, documented
from auk_worker.audio import decode_audio
from auk_worker.service.records.objects import upload_key
from auk_worker.service.records.uploads import Upload

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["uploads"], responses=V1_ERRORS)

READ_CHUNK = 1 << 20


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


@router.post("/uploads", status_code=201, summary="Upload an audio clip",
             **documented(UploadOut, *BODY_ERRORS, status=201, description="The clip, stored."))
def create_upload(
    file: UploadFile = File(..., description="an audio file soundfile can decode (WAV, FLAC, OGG...)"),
    owner: str = Depends(caller),
    svc: Services = Depends(services),
) -> dict:
    """Decode and store a clip; answers its id, duration, sample rate and channel count."""
    data = _read_limited(file, svc.settings.max_upload_bytes)
    # AudioError (422) names what is wrong with the file
    clip = decode_audio(data, max_seconds=svc.settings.max_recording_s)
    channels = _channels(data)

    upload_id = uuid.uuid4().hex
    key = upload_key(svc.settings.s3_prefix, upload_id)
    svc.storage.put_bytes(key, data, file.content_type or "application/octet-stream", {"owner": owner})
    upload = Upload(upload_id=upload_id, owner=owner, key=key, duration_s=round(clip.duration_s, 6),
                    sample_rate=clip.sample_rate, samples=len(clip.samples), channels=channels,
                    sha256=hashlib.sha256(data).hexdigest())  # fmt: skip
    svc.uploads.add(upload)
    log.info("upload %s: %d bytes, %.2f s at %d Hz, %d channels", upload_id, len(data), clip.duration_s,
             clip.sample_rate, channels)
    return upload.public()
