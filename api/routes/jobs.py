"""``/v1/jobs``: enqueue one render, read it, list the caller's jobs, cancel one.

A new job goes through ``api/submit.py`` (checked, written, then sent). Another key's job answers 404 exactly like
a job that does not exist.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import JSONResponse

from api.auth import caller
from api.deps import Services, services
from api.errors import require_cancelable
from api.responses import JobOut, JobPage
from api.openapi import BODY_ERRORS, V1_ERRORS, documented, links
from api.submit import MAX_IDEMPOTENCY_KEY, submit_job
from auk_worker.errors import Conflict, InputError, NotFound
from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.records.requests import JobRequest

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["jobs"], responses=V1_ERRORS)


def public(svc: Services, record: JobRecord) -> dict[str, Any]:
    """The record as callers see it; a result carries a freshly presigned URL, a webhook its delivery state."""
    body = record.to_public()
    result = body.get("result")
    if result and result.get("key"):
        expires = svc.settings.presign_seconds
        body["result"] = {**result, "url": svc.storage.presign_get(result["key"], expires, bucket=result.get("bucket"))}
        stamps = result.get("timestamps")  # a long job's subtitles beside its audio
        if stamps and stamps.get("key"):
            body["result"]["timestamps"] = {**stamps, "url": svc.storage.presign_get(stamps["key"], expires)}
    body["webhook"] = svc.notifier.view("job", record.id, record.request.get("webhook_url"))
    return body


def owned_job(svc: Services, job_id: str, owner: str) -> JobRecord:
    """The caller's job; unknown and foreign ids look the same, so that other keys' ids leak nothing."""
    record = svc.store.get(job_id)
    if record is None or record.owner != owner:
        raise NotFound(f"no job {job_id!r}")
    return record


@router.post("/jobs", status_code=202, summary="Enqueue one render",
             **documented(JobOut, *BODY_ERRORS, status=202, description="The job, queued.",
                          follow=links(GetJob=("get_job", "job_id"), CancelJob=("cancel_job", "job_id"),
                                       GetAudio=("get_audio", "job_id")),
                          more={200: {"model": JobOut,
                                      "description": "The job an earlier request with this Idempotency-Key made."}}))
def create_job(
    body: JobRequest,
    owner: str = Depends(caller),
    svc: Services = Depends(services),
    idempotency_key: Annotated[str | None, Header(max_length=MAX_IDEMPOTENCY_KEY)] = None,
) -> JSONResponse:
    record, created = submit_job(svc, owner, body, idempotency_key)
    return JSONResponse(public(svc, record), status_code=202 if created else 200)


@router.get("/jobs/{job_id}", summary="Read one job", **documented(JobOut, 404, 422))
def get_job(job_id: str, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    return public(svc, owned_job(svc, job_id, owner))


@router.get("/jobs", summary="List the caller's jobs, newest first", **documented(JobPage, 422))
def list_jobs(
    owner: str = Depends(caller),
    svc: Services = Depends(services),
    status: JobStatus | None = None,
    batch_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: str | None = None,
) -> dict:
    try:
        records, next_cursor = svc.store.list(owner, status=status, batch_id=batch_id, limit=limit, cursor=cursor)
    except ValueError as exc:
        raise InputError(f"cursor: {exc}", code="invalid_request") from None
    return {"data": [public(svc, record) for record in records], "next_cursor": next_cursor}


@router.post("/jobs/{job_id}/cancel", summary="Cancel a queued or running job",
             **documented(JobOut, 404, 409, 422, description="The job, canceled."))
def cancel_job(job_id: str, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    record = owned_job(svc, job_id, owner)
    require_cancelable(record.status, job_id)
    canceled = svc.store.cancel(job_id, owner)
    if canceled is None:  # it finished between the read and the cancel
        current = owned_job(svc, job_id, owner)
        require_cancelable(current.status, job_id)
        raise Conflict(f"job {job_id!r} could not be canceled; try again")
    log.info("job %s: canceled by its owner", job_id)
    return public(svc, canceled)
