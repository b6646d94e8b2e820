"""``GET /v1/jobs/{job_id}/audio``: a finished job's audio streamed through the API, under the caller's key.

For clients that cannot reach the storage at all (the presigned URL in ``result.url`` is the direct way). Another
key's job is 404 like an unknown one; a job that has not succeeded is 409; a result that retention has removed is
404 ``result_expired``. A ``Range: bytes=...`` header is passed to the store, which answers 206 with the part.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Annotated

from botocore.exceptions import ClientError
from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.auth import caller
from api.deps import Services, services
from api.openapi import AUDIO_CONTENT, V1_ERRORS, documented
from api.routes.jobs import owned_job
from auk_worker.errors import Conflict, NotFound
from auk_worker.service.records.jobs import JobStatus

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["jobs"], responses=V1_ERRORS)

CHUNK = 64 * 1024


@router.get("/jobs/{job_id}/audio", summary="Download a finished job's audio through the API",
            response_class=StreamingResponse,
            **documented(None, 404, 409, 416, 422, description="The rendered audio, in the job's format.",
                         content=AUDIO_CONTENT,
                         more={206: {"content": AUDIO_CONTENT, "description": "The requested byte range."}}))
def get_audio(
    job_id: str,
    owner: str = Depends(caller),
    svc: Services = Depends(services),
    range_: Annotated[str | None, Header(alias="Range")] = None,
) -> Response:
    record = owned_job(svc, job_id, owner)
    if record.status != JobStatus.SUCCEEDED or not record.result:
        raise Conflict(f"job {job_id!r} is {record.status.value}; its audio exists once it has succeeded",
                       code="not_finished")  # fmt: skip
    byte_range = range_.strip() if range_ and range_.strip().lower().startswith("bytes=") else None
    try:
        obj = svc.storage.open(record.result["key"], byte_range)
    except ClientError:  # InvalidRange: past the end of the object
        return JSONResponse({"error": {"code": "range_not_satisfiable", "message": f"the range {byte_range!r} lies "
                                       "past the end of the audio"}}, status_code=416,
                            headers={"Content-Range": "bytes */*"})  # fmt: skip
    if obj is None:
        raise NotFound(f"job {job_id!r}: its audio has been removed (results are kept for a limited time)",
                       code="result_expired")  # fmt: skip
    headers = {name: str(obj[key]) for name, key in
               (("Content-Length", "ContentLength"), ("Content-Range", "ContentRange"), ("ETag", "ETag"))
               if obj.get(key) is not None}  # fmt: skip
    headers["Accept-Ranges"] = "bytes"
    extension = record.result.get("format") or "wav"
    headers["Content-Disposition"] = f'attachment; filename="{job_id}.{extension}"'
    body = obj["Body"]

    def chunks() -> Iterator[bytes]:
        try:
            yield from body.iter_chunks(CHUNK)
        finally:
            body.close()

    status = 206 if obj.get("ContentRange") else 200
    return StreamingResponse(chunks(), status_code=status, media_type=obj.get("ContentType") or "audio/wav",
                             headers=headers)  # fmt: skip
