"""``/v1/batches``: the overnight path, many jobs from one JSONL body.

Every line is validated first: here its JSON, ``JobRequest`` and a ``custom_id`` unique within the batch; then the
clip and the length rule in ``api/submit.py``, the path every job takes. If any line is bad, the answer is 422 with
``{"line", "message"}`` for each bad line and nothing is written or enqueued. Otherwise all records and the batch
are written in one transaction, then the jobs go to their variant's bulk queue: as ``auk.render_group`` tasks of
compatible jobs (same schedule, similar lengths, at most the deploy config's stage 1 ``max_num_seqs`` each;
``auk_worker/service/queues/grouping.py``) that a worker renders in shared DiT passes, or one ``auk.render`` task a job
when ``max_num_seqs`` is 1. When the batch's last job finishes, the worker writes a JSONL manifest next to the
WAVs, with an error file of the lines that did not succeed; ``GET /v1/batches/{id}`` links both.

``GET /v1/batches`` lists the key's batches, newest first; ``POST /v1/batches/{id}/cancel`` stops what has not ended
(``BatchBook.cancel``: queued jobs end ``canceled``, running ones at their next step) and then stores the batch's
results at once, since every job has ended: the manifest lists the canceled lines, the error file holds them, and
the batch's webhook goes out. ``GET /v1/batches/{id}/link`` makes a signed link to the batch's listening page
(``batch_page.py``). Another key's batch answers 404 like one that does not exist.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from api.auth import caller
from api.batch_page_links import MAX_LINK_SECONDS, LinkSigner
from api.deps import Services, services
from api.errors import describe_validation_errors, json_failure, summarize, too_large
from api.openapi import BODY_ERRORS, V1_ERRORS, documented, links
from api.responses import BatchCanceled, BatchCreated, BatchLink, BatchOut, BatchPage
from api.submit import MAX_IDEMPOTENCY_KEY, batch_fingerprint, submit_batch
from auk_worker.errors import Conflict, InputError, MalformedBody, NotFound, UnsupportedMediaType
from auk_worker.service.records.batches import public_batch, write_results
from auk_worker.service.records.requests import JobRequest

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["batches"], responses=V1_ERRORS)

MAX_BATCH_LINES = 10_000
MAX_BATCH_BYTES = 64 * 1024 * 1024
JSONL_TYPES = ("application/x-ndjson", "application/jsonl", "application/json-lines", "text/plain", "")

BATCH_EXAMPLE = (
    '{"custom_id": "line-1", "instruction": "A calm narrator: \\"Chapter one.\\"", "gen_seconds": 3}\n'
    '{"custom_id": "line-2", "instruction": "A calm narrator: \\"Chapter two.\\"", "gen_seconds": 4, "seed": 7}\n'
)
_BATCH_BODY_DOC = {
    "requestBody": {
        "required": True,
        "description": "JSONL: one job request per line, each with a unique custom_id; or a multipart `file`.",
        "content": {
            "application/x-ndjson": {"schema": {"type": "string"}, "example": BATCH_EXAMPLE},
            "text/plain": {"schema": {"type": "string"}},
            "multipart/form-data": {
                "schema": {"type": "object", "properties": {"file": {"type": "string", "format": "binary"}},
                           "required": ["file"]},
            },
        },
    }
}


def batch_record(svc: Services, batch: dict[str, Any]) -> dict[str, Any]:
    """A batch as the API shows it (read, listing, cancel): ``batches.public_batch`` plus its webhook's state."""
    body = public_batch(batch, svc.storage, svc.settings.presign_seconds)
    body["webhook"] = svc.notifier.view("batch", batch["id"], batch["webhook_url"])
    return body


@router.get("/batches", summary="List the caller's batches, newest first, with their counts",
            **documented(BatchPage, 422))
def list_batches(
    owner: str = Depends(caller),
    svc: Services = Depends(services),
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: str | None = None,
) -> dict:
    try:
        batches, next_cursor = svc.batches.list(owner, limit=limit, cursor=cursor)
    except ValueError as exc:
        raise InputError(f"cursor: {exc}", code="invalid_request") from None
    return {"data": [batch_record(svc, batch) for batch in batches], "next_cursor": next_cursor}


@router.post("/batches/{batch_id}/cancel", summary="Cancel a batch: its queued and running jobs end canceled",
             **documented(BatchCanceled, 404, 409, 422))
def cancel_batch(batch_id: str, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    batch = svc.batches.owned(batch_id, owner)
    if batch is None:
        raise NotFound(f"no batch {batch_id!r}")
    if batch["done"] and batch["manifest_key"]:
        raise Conflict(f"batch {batch_id!r} has ended ({batch['counts']['canceled']} canceled) and cannot be "
                       "canceled", code="already_finished")  # fmt: skip
    batch, canceled = svc.batches.cancel(batch_id, owner)
    if batch["done"] and batch["manifest_key"] is None:  # also a retry after storage refused the first time
        write_results(svc.store, svc.storage, svc.settings.s3_prefix, batch_id, notifier=svc.notifier)
        batch = svc.batches.get(batch_id)
    body = batch_record(svc, batch)
    body["canceled_now"] = canceled
    return body


@router.get("/batches/{batch_id}/link", summary="A signed link to the batch's listening page",
            **documented(BatchLink, 404, 422))
def batch_link(
    batch_id: str,
    request: Request,
    owner: str = Depends(caller),
    svc: Services = Depends(services),
    expires_in: Annotated[int | None, Query(ge=60, le=MAX_LINK_SECONDS)] = None,
) -> dict:
    if svc.batches.owned(batch_id, owner) is None:
        raise NotFound(f"no batch {batch_id!r}")
    signer: LinkSigner = request.app.state.links
    exp, sig = signer.sign(batch_id, expires_in)
    path = f"/batches/{batch_id}?exp={exp}&sig={sig}"
    return {"path": path, "url": str(request.base_url).rstrip("/") + path, "expires_at": exp}


async def _read_body(request: Request) -> bytes:
    """The JSONL text: the raw body, or the ``file`` part of a multipart form, at most ``MAX_BATCH_BYTES``."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=4)
        part = form.get("file")
        if not isinstance(part, UploadFile):
            raise InputError("file: a multipart batch needs its JSONL in a field named 'file'", code="invalid_request")
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
        raise UnsupportedMediaType(message)
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


def parse_lines(text: str) -> tuple[list[tuple[int, JobRequest]], list[dict]]:
    """Every non-blank line parsed; returns the good ones (line number, request, on the bulk queue) and the bad
    ones (``{"line", "message"}``)."""
    good: list[tuple[int, JobRequest]] = []
    bad: list[dict] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(job_lines(text), start=1):
        if not line.strip():
            continue
        try:
            request = _parse_line(line)
            if not request.custom_id:
                raise InputError("custom_id: field required in a batch line")
            if request.webhook_url is not None:
                raise InputError("webhook_url: set it on the batch (POST /v1/batches?webhook_url=...), not on a line")
            if request.custom_id in seen:
                raise InputError(f"custom_id: {request.custom_id!r} repeats line {seen[request.custom_id]}")
            seen[request.custom_id] = number
            request = request.model_copy(update={"priority": "bulk"})  # batch jobs never jump the interactive queue
            good.append((number, request))
        except ValidationError as exc:
            bad.append({"line": number, "message": summarize(describe_validation_errors(exc.errors()))})
        except InputError as exc:
            bad.append({"line": number, "message": exc.message})
    return good, bad


@router.post("/batches", status_code=202, summary="Enqueue a JSONL batch", openapi_extra=_BATCH_BODY_DOC,
             **documented(BatchCreated, *BODY_ERRORS, status=202, description="The batch, queued.",
                          follow=links(GetBatch=("get_batch", "batch_id"), CancelBatch=("cancel_batch", "batch_id"),
                                       BatchLink=("batch_link", "batch_id")),
                          more={200: {"model": BatchCreated,
                                      "description": "The batch an earlier request with this Idempotency-Key made."}}))
async def create_batch(request: Request, owner: str = Depends(caller), svc: Services = Depends(services),
                       webhook_url: str | None = Query(None, min_length=1, max_length=2048),
                       idempotency_key: Annotated[str | None, Header(max_length=MAX_IDEMPOTENCY_KEY)] = None,
                       ) -> JSONResponse:  # fmt: skip
    data = await _read_body(request)
    idempotency = (idempotency_key, batch_fingerprint(data, webhook_url)) if idempotency_key else None
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark (Windows editors write one) is not a line's
    except UnicodeDecodeError as exc:
        raise MalformedBody(f"the batch is not UTF-8 text (byte {exc.start})") from None
    lines = sum(1 for line in job_lines(text) if line.strip())
    if lines == 0:
        raise InputError("the batch holds no job lines", code="empty_batch")
    if lines > MAX_BATCH_LINES:
        message = f"the batch has {lines} job lines; at most {MAX_BATCH_LINES} are accepted"
        raise InputError(message, code="too_many_lines")
    # Parsing and submitting (Redis, storage, perhaps decoding clips) run off the event loop.
    body, created = await run_in_threadpool(_parse_and_submit, svc, owner, text, webhook_url, idempotency)
    return JSONResponse(body, status_code=202 if created else 200)


def _parse_and_submit(svc: Services, owner: str, text: str, webhook_url: str | None,
                      idempotency: tuple[str, str] | None) -> tuple[dict, bool]:  # fmt: skip
    good, bad = parse_lines(text)
    return submit_batch(svc, owner, good, bad, webhook_url, idempotency)


@router.get("/batches/{batch_id}", summary="Read a batch: counts by status; once done, its manifest and error file",
            **documented(BatchOut, 404, 422))
def get_batch(batch_id: str, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    batch = svc.batches.owned(batch_id, owner)
    if batch is None:
        raise NotFound(f"no batch {batch_id!r}")
    return batch_record(svc, batch)

