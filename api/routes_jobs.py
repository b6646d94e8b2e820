"""``/v1/jobs``: enqueue one render, read it, list the caller's jobs, cancel one.

Everything is checked before anything is enqueued: the body against ``JobRequest`` (unknown fields refused),
the clip (an upload of this key, or an object in the input bucket that decodes), and clip plus target at most
30 s. Then the record is written, and only then is ``auk.render`` sent by name to ``auk.{variant}.{priority}``.
Another key's job answers 404 exactly like a job that does not exist.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from botocore.exceptions import BotoCoreError, ClientError
from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import JSONResponse

from api.app import Services, services
from api.auth import caller
from api.errors import ApiError, not_found, require_cancelable
from api.routes_uploads import load_upload
from auk_worker.audio import decode_audio
from auk_worker.errors import InfraError, InputError
from auk_worker.service.celery_app import RENDER_TASK, queue_name
from auk_worker.service.jobs import JobRecord, JobStatus
from auk_worker.service.schema import JobRequest, check_total_length
from auk_worker.service.storage import error_code

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["jobs"])

MAX_IDEMPOTENCY_KEY = 255


class ClipResolver:
    """Turns a request's audio reference into the clip a worker will read, checking it exists and decodes.

    One resolver serves a whole batch, so a clip named on many lines is fetched and decoded once, and so is a
    key that is missing, too large or undecodable: its error is kept and raised again for every later line.
    """

    def __init__(self, svc: Services, owner: str) -> None:
        self.svc = svc
        self.owner = owner
        self._by_key: dict[str, dict[str, Any]] = {}
        self._failed: dict[str, InputError | ApiError] = {}

    def resolve(self, request: JobRequest) -> dict[str, Any] | None:
        """``{"bucket", "key", "duration_s", "sample_rate"}`` for the clip, or None without audio.

        Raises ``ApiError`` (422) for an upload that is not the caller's, ``InputError`` for a missing key
        or a file that does not decode, ``InfraError`` when storage does not answer.
        """
        audio = request.audio
        if audio is None:
            return None
        if audio.upload_id is not None:
            upload = load_upload(self.svc, audio.upload_id, self.owner)
            if upload is None:
                message = f"audio.upload_id: no upload {audio.upload_id!r} for this API key"
                raise ApiError(422, "unknown_upload", message)
            return {"bucket": self.svc.storage.bucket, "key": upload.key, "duration_s": upload.duration_s,
                    "sample_rate": upload.sample_rate}
        key = audio.key
        if key in self._failed:
            raise self._failed[key].with_traceback(None)  # the same error, without a traceback grown per line
        if key not in self._by_key:
            try:
                self._by_key[key] = self._inspect(key)
            except (InputError, ApiError) as exc:  # the caller's errors (422): storage faults are InfraError
                self._failed[key] = exc
                raise
        return dict(self._by_key[key])

    def _inspect(self, key: str) -> dict[str, Any]:
        bucket = self.svc.storage.input_bucket
        size = self._input_size(bucket, key)
        limit = self.svc.settings.max_upload_bytes
        if size > limit:
            raise ApiError(422, "too_large", f"audio.key {key!r} is {size} bytes; the limit is {limit}")
        clip = decode_audio(self.svc.storage.get_bytes(bucket, key))
        return {"bucket": bucket, "key": key, "duration_s": round(clip.duration_s, 6), "sample_rate": clip.sample_rate}


    def _input_size(self, bucket: str, key: str) -> int:
        """HEAD the input object: its size, before anything is downloaded; a missing key is the caller's error."""
        try:
            head = self.svc.storage.client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            code = error_code(exc)
            if code in ("404", "NoSuchKey", "NotFound"):
                raise InputError(f"audio.key: no object {key!r} in the input bucket", code="audio_not_found") from None
            if code in ("400", "InvalidArgument", "KeyTooLongError"):  # the key itself, not the storage
                raise InputError(f"audio.key: the storage refuses the key {key!r} ({code})", code="invalid_key") from None
            raise InfraError(f"storage head {bucket}/{key} failed: {exc}") from exc
        except BotoCoreError as exc:
            raise InfraError(f"storage head {bucket}/{key} failed: {exc}") from exc
        return int(head.get("ContentLength", 0))


def prepare(request: JobRequest, resolver: ClipResolver) -> dict[str, Any]:
    """The record's ``request``: the validated body, the resolved clip and the target length in seconds."""
    clip = resolver.resolve(request)
    target = check_total_length(request, clip["duration_s"] if clip else None)
    return {**request.model_dump(mode="json"), "clip": clip, "target_seconds": target}


def send_render(svc: Services, record: JobRecord) -> None:
    """Send the task for a written record; when the broker refuses, the record fails instead of idling forever."""
    try:
        svc.celery.send_task(RENDER_TASK, args=[record.id], queue=record.queue)
    except Exception as exc:  # the broker's connection errors vary by transport; the boundary is here
        message = f"the job could not be enqueued: {exc}"
        svc.store.fail(record.id, InfraError.code, message)
        raise InfraError(message) from exc


def public(svc: Services, record: JobRecord) -> dict[str, Any]:
    """The record as callers see it; a result carries a freshly presigned URL."""
    body = record.to_public()
    result = body.get("result")
    if result and result.get("key"):
        expires = svc.settings.presign_seconds
        body["result"] = {**result, "url": svc.storage.presign_get(result["key"], expires, bucket=result.get("bucket"))}
    return body


def owned_job(svc: Services, job_id: str, owner: str) -> JobRecord:
    record = svc.store.get(job_id)
    if record is None or record.owner != owner:
        raise not_found("job", job_id)
    return record


@router.post("/jobs", status_code=202, summary="Enqueue one render",
             responses={200: {"description": "the job an earlier request with this Idempotency-Key made"}})
def create_job(
    body: JobRequest,
    owner: str = Depends(caller),
    svc: Services = Depends(services),
    idempotency_key: Annotated[str | None, Header(max_length=MAX_IDEMPOTENCY_KEY)] = None,
) -> JSONResponse:
    if idempotency_key is not None:
        earlier = svc.store.redis.get(svc.store.idem_key(owner, idempotency_key))
        existing = svc.store.get(earlier) if earlier else None
        if existing is not None:
            return _repeated(svc, existing, body, idempotency_key)
    request = prepare(body, ClipResolver(svc, owner))
    record = JobRecord.new(owner, request, queue=queue_name(body.variant, body.priority), custom_id=body.custom_id)
    record, created = svc.store.create(record, idempotency_key=idempotency_key)
    if not created:  # another request with the same key got there first
        return _repeated(svc, record, body, idempotency_key)
    send_render(svc, record)
    log.info("job %s: queued on %s for owner %s", record.id, record.queue, owner)
    return JSONResponse(public(svc, record), status_code=202)


def _repeated(svc: Services, existing: JobRecord, body: JobRequest, idempotency_key: str | None) -> JSONResponse:
    """The job an earlier request with this Idempotency-Key made (200), if this request is the same one; a
    different request under a used key is refused, so that a caller never takes another job for its own."""
    sent = body.model_dump(mode="json")
    if any(existing.request.get(field) != value for field, value in sent.items()):
        raise ApiError(422, "idempotency_key_reused", f"Idempotency-Key {idempotency_key!r} was used for job "
                       f"{existing.id} with a different request; use a new key for a new job")
    return JSONResponse(public(svc, existing), status_code=200)


@router.get("/jobs/{job_id}", summary="Read one job")
def get_job(job_id: str, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    return public(svc, owned_job(svc, job_id, owner))


@router.get("/jobs", summary="List the caller's jobs, newest first")
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
        raise ApiError(422, "invalid_request", f"cursor: {exc}") from None
    return {"data": [public(svc, record) for record in records], "next_cursor": next_cursor}


@router.post("/jobs/{job_id}/cancel", summary="Cancel a queued or running job")
def cancel_job(job_id: str, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    record = owned_job(svc, job_id, owner)
    require_cancelable(record.status, job_id)
    canceled = svc.store.cancel(job_id, owner)
    if canceled is None:  # it finished between the read and the cancel
        current = owned_job(svc, job_id, owner)
        require_cancelable(current.status, job_id)
        raise ApiError(409, "conflict", f"job {job_id!r} could not be canceled; try again")
    log.info("job %s: canceled by its owner", job_id)
    return public(svc, canceled)
