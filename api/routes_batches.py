"""``/v1/batches``: the overnight path, many jobs from one JSONL body.

Every line is validated first (JSON, ``JobRequest``, a ``custom_id`` unique within the batch, the clip, the
length rule). If any line is bad, the answer is 422 with ``{"line", "message"}`` for each bad line and nothing
is written or enqueued. Otherwise all records and the batch are written in one transaction, then the jobs go to
their variant's bulk queue: as ``auk.render_group`` tasks of compatible jobs (same schedule, similar lengths, at
most the deploy config's stage 1 ``max_num_seqs`` each; ``auk_worker/service/grouping.py``) that a worker renders
in shared DiT passes, or one ``auk.render`` task a job when ``max_num_seqs`` is 1. When the batch's last job
finishes, the worker writes a JSONL manifest next to the WAVs; ``GET /v1/batches/{id}`` links it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from api.app import Services, services
from api.auth import caller
from api.errors import (
    ApiError, batch_state, describe_validation_errors, json_failure, not_found, summarize, too_large,
)
from api.routes_jobs import ClipResolver, prepare, send_render
from auk_worker.errors import InfraError, InputError
from auk_worker.service.celery_app import queue_name
from auk_worker.service.grouping import RENDER_GROUP_TASK, group_limits, plan_groups
from auk_worker.service.jobs import JobRecord
from auk_worker.service.schema import JobRequest

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["batches"])

MAX_BATCH_LINES = 10_000
MAX_BATCH_BYTES = 64 * 1024 * 1024
MAX_REPORTED_LINES = 100  # a 10 000-line file of bad lines answers with the first hundred
JSONL_TYPES = ("application/x-ndjson", "application/jsonl", "application/json-lines", "text/plain", "")

_BATCH_BODY_DOC = {
    "requestBody": {
        "required": True,
        "description": "JSONL: one job request per line, each with a unique custom_id; or a multipart `file`.",
        "content": {
            "application/x-ndjson": {"schema": {"type": "string"}},
            "text/plain": {"schema": {"type": "string"}},
            "multipart/form-data": {
                "schema": {"type": "object", "properties": {"file": {"type": "string", "format": "binary"}},
                           "required": ["file"]},
            },
        },
    }
}


async def _read_body(request: Request) -> bytes:
    """The JSONL text: the raw body, or the ``file`` part of a multipart form, at most ``MAX_BATCH_BYTES``."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=4)
        part = form.get("file")
        if not isinstance(part, UploadFile):
            raise ApiError(422, "invalid_request", "file: a multipart batch needs its JSONL in a field named 'file'")
        data = await part.read(MAX_BATCH_BYTES + 1)
    elif content_type in JSONL_TYPES:
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BATCH_BYTES:
                break
        data = bytes(data)
    else:
        message = f"a batch is JSONL (application/x-ndjson or text/plain) or a multipart file, not {content_type!r}"
        raise ApiError(415, "unsupported_media_type", message)
    if len(data) > MAX_BATCH_BYTES:
        raise too_large("the batch", MAX_BATCH_BYTES)
    return data


def job_lines(text: str) -> list[str]:
    """The batch's lines, ended by "\n" only (a "\r" before it is JSON whitespace): JSON strings may hold U+2028
    and the other breaks that ``str.splitlines`` would split them at."""
    return text.split("\n")


def _parse_line(text: str) -> JobRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    except (RecursionError, ValueError) as exc:
        reason = json_failure(exc)
        if reason is None:
            raise
        raise InputError(f"not valid JSON: {reason}") from None
    if not isinstance(obj, dict):
        raise InputError(f"a line must be a JSON object, got {type(obj).__name__}")
    return JobRequest.model_validate(obj)


def validate_lines(text: str, resolver: ClipResolver) -> tuple[list[tuple[JobRequest, dict[str, Any]]], list[dict]]:
    """Every non-blank line checked; returns the good ones (request, record request) and the bad ones."""
    good: list[tuple[JobRequest, dict[str, Any]]] = []
    bad: list[dict] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(job_lines(text), start=1):
        if not line.strip():
            continue
        try:
            request = _parse_line(line)
            if not request.custom_id:
                raise InputError("custom_id: field required in a batch line")
            if request.custom_id in seen:
                raise InputError(f"custom_id: {request.custom_id!r} repeats line {seen[request.custom_id]}")
            seen[request.custom_id] = number
            request = request.model_copy(update={"priority": "bulk"})  # batch jobs never jump the interactive queue
            good.append((request, prepare(request, resolver)))
        except ValidationError as exc:
            bad.append({"line": number, "message": summarize(describe_validation_errors(exc.errors()))})
        except ApiError as exc:
            if exc.status >= 500:
                raise
            bad.append({"line": number, "message": exc.message})
        except InputError as exc:
            bad.append({"line": number, "message": exc.message})
    return good, bad


@router.post("/batches", status_code=202, summary="Enqueue a JSONL batch", openapi_extra=_BATCH_BODY_DOC)
async def create_batch(request: Request, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    data = await _read_body(request)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, "malformed_body", f"the batch is not UTF-8 text (byte {exc.start})") from None
    lines = sum(1 for line in job_lines(text) if line.strip())
    if lines == 0:
        raise ApiError(422, "empty_batch", "the batch holds no job lines")
    if lines > MAX_BATCH_LINES:
        message = f"the batch has {lines} job lines; at most {MAX_BATCH_LINES} are accepted"
        raise ApiError(422, "too_many_lines", message)
    # Validation reads Redis and storage and may decode clips: off the event loop.
    return await run_in_threadpool(_enqueue_batch, svc, owner, text)


def _enqueue_batch(svc: Services, owner: str, text: str) -> dict:
    good, bad = validate_lines(text, ClipResolver(svc, owner))
    if bad:
        shown = bad[:MAX_REPORTED_LINES]
        lines = ", ".join(str(item["line"]) for item in shown)
        more = f" (first {len(shown)} of {len(bad)} shown)" if len(bad) > len(shown) else ""
        raise ApiError(422, "invalid_batch", f"{len(bad)} bad line(s), nothing enqueued: line {lines}{more}",
                       details=shown)
    records = [
        JobRecord.new(owner, prepared, queue=queue_name(req.variant, "bulk"), custom_id=req.custom_id)
        for req, prepared in good
    ]
    batch_id = svc.store.create_batch(owner, records)
    max_jobs, defaults = group_limits(svc.settings.deploy_config)
    groups = plan_groups(records, max_jobs, defaults) if max_jobs > 1 else [[record] for record in records]
    for sent, group in enumerate(groups):
        try:
            send_group(svc, group)
        except InfraError:
            for unsent in groups[sent + 1:]:
                for record in unsent:
                    svc.store.fail(record.id, InfraError.code, "the batch could not be enqueued: the broker refused")
            raise
    log.info("batch %s: %d jobs queued as %d task(s) for owner %s", batch_id, len(records), len(groups), owner)
    return {"id": batch_id, "total": len(records)}


def send_group(svc: Services, group: list[JobRecord]) -> None:
    """One task for a group: ``auk.render`` for a lone job, ``auk.render_group`` otherwise; a refused send fails
    the group's records (as ``send_render`` does for one)."""
    if len(group) == 1:
        send_render(svc, group[0])
        return
    try:
        svc.celery.send_task(RENDER_GROUP_TASK, args=[[record.id for record in group]], queue=group[0].queue)
    except Exception as exc:  # the broker's connection errors vary by transport; the boundary is here
        message = f"the job could not be enqueued: {exc}"
        for record in group:
            svc.store.fail(record.id, InfraError.code, message)
        raise InfraError(message) from exc


@router.get("/batches/{batch_id}", summary="Read a batch: counts by status and, when done, its manifest")
def get_batch(batch_id: str, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    batch = svc.store.get_batch(batch_id)
    if batch is None or batch["owner"] != owner:
        raise not_found("batch", batch_id)
    status = batch_state(batch["counts"], batch["total"], manifest_stored=bool(batch.get("manifest_key")))
    manifest = None
    if status == "done":
        key = batch["manifest_key"]
        manifest = {"key": key, "url": svc.storage.presign_get(key, svc.settings.presign_seconds)}
    return {"id": batch["id"], "total": batch["total"], "counts": batch["counts"], "status": status,
            "created_at": batch["created_at"], "manifest": manifest}

