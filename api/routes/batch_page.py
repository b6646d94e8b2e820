"""``GET /batches/{id}``: the page to listen to a batch, and ``GET /batches/{id}/audio/{job id}``, its players' source.

Both are reached with a signed link (``?exp=...&sig=...``, ``api/batch_page_links.py``) that only the batch's owner can
make; the page may also be opened with the owner's bearer key, and then signs its own audio sources. The audio route
streams the stored object through the API (same origin as the page, so players and scripts read it without
cross-origin rules), passing a ``Range`` header on to storage so that players can seek.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Annotated

from botocore.exceptions import BotoCoreError, ClientError
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from api.deps import Services, services
from api.batch_page_links import LinkSigner
from api.openapi import AUDIO_CONTENT, documented
from api.batch_page_html import render_page
from auk_worker.errors import InfraError, NotFound
from auk_worker.service.records.jobs import JobRecord, JobStatus

router = APIRouter(tags=["batch page"])

CHUNK = 64 * 1024
_RANGE = re.compile(r"^bytes=\d*-\d*$")


def _signer(request: Request) -> LinkSigner:
    return request.app.state.links


def _authorize(request: Request, svc: Services, batch_id: str, exp: str | None,
               sig: str | None) -> tuple[dict, int, str]:
    """The batch, and the ``(exp, sig)`` its audio sources carry: the valid link's own, or minted for the owner's
    bearer key. Another key's batch answers 404 like a missing one."""
    signer = _signer(request)
    if exp is None and sig is None and request.headers.get("authorization"):
        owner = request.app.state.keyring.owner_for(request.headers["authorization"])
        batch = svc.batches.owned(batch_id, owner)
        if batch is None:
            raise NotFound(f"no batch {batch_id!r}")
        return (batch, *signer.sign(batch_id))
    signer.verify(batch_id, exp, sig)
    batch = svc.batches.get(batch_id)
    if batch is None:
        raise NotFound(f"no batch {batch_id!r}")
    return batch, int(exp), sig


@router.get("/batches/{batch_id}", response_class=HTMLResponse, summary="Listen to a batch (signed link)",
            **documented(None, 401, 404, 422, 500, 503, description="The listening page.",
                         content={"text/html": {"schema": {"type": "string"}}}))
def batch_page(
    batch_id: str,
    request: Request,
    svc: Services = Depends(services),
    exp: str | None = None,
    sig: str | None = None,
    failed_first: Annotated[bool, Query()] = False,
) -> HTMLResponse:
    batch, exp_s, sig = _authorize(request, svc, batch_id, exp, sig)
    records = svc.store.batch_records(batch_id)
    expires = datetime.fromtimestamp(exp_s, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    def audio_src(record: JobRecord) -> str:
        return f"/batches/{batch_id}/audio/{record.id}?exp={exp_s}&sig={sig}"

    html = render_page(batch, records, audio_src, failed_first, expires)
    return HTMLResponse(html, headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer",
                                       "X-Content-Type-Options": "nosniff"})  # fmt: skip


@router.get("/batches/{batch_id}/audio/{job_id}", summary="A batch line's audio (signed link)",
            response_class=StreamingResponse,
            **documented(None, 401, 404, 422, 500, 503, description="The line's audio.", content=AUDIO_CONTENT,
                         more={206: {"description": "The requested byte range of the line's audio.",
                                     "content": AUDIO_CONTENT}}))
def batch_audio(
    batch_id: str, job_id: str, request: Request, svc: Services = Depends(services), exp: str | None = None,
    sig: str | None = None,
) -> StreamingResponse:
    _signer(request).verify(batch_id, exp, sig)
    record = svc.store.get(job_id)
    if record is None or record.batch_id != batch_id or record.status != JobStatus.SUCCEEDED or not record.result:
        raise NotFound(f"no audio for line {job_id!r} of batch {batch_id!r}")
    result = record.result
    extra = {}
    wanted = request.headers.get("range", "")
    if _RANGE.match(wanted) and wanted != "bytes=-":
        extra["Range"] = wanted
    try:
        obj = svc.storage.client.get_object(Bucket=result.get("bucket") or svc.storage.bucket, Key=result["key"],
                                            **extra)  # fmt: skip
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404", "NotFound"):
            raise NotFound(f"the audio of line {job_id!r} is no longer stored") from None
        raise InfraError(f"storage get {result['key']} failed: {code}") from exc
    except BotoCoreError as exc:
        raise InfraError(f"storage get {result['key']} failed: {exc}") from exc
    headers = {"Accept-Ranges": "bytes", "Content-Length": str(obj["ContentLength"]), "Cache-Control": "private"}
    if obj.get("ContentRange"):
        headers["Content-Range"] = obj["ContentRange"]
    body = obj["Body"]

    def chunks():
        try:
            yield from iter(lambda: body.read(CHUNK), b"")
        finally:
            body.close()

    return StreamingResponse(chunks(), status_code=206 if obj.get("ContentRange") else 200, headers=headers,
                             media_type=obj.get("ContentType") or "application/octet-stream")  # fmt: skip
