"""``POST /v1/audio/speech``: OpenAI's speech endpoint (and vLLM-Omni's AuK fields), answered with the audio bytes.

The request is a job like any other: checked by the same rules, written as a record under the caller's key, sent
to the variant's interactive queue. What differs is the answer: the worker pushes the encoded audio through Redis
as soon as it exists (``auk_worker/service/replies.py``) and the route, waiting on that with ``BLPOP``, answers
with it at once; the worker stores the object and records the success afterwards, off the answer's path. The job
id comes back in ``X-Job-Id`` (``GET /v1/jobs/{id}`` shows the stored result once recorded), and the split of the
time in ``Server-Timing``: ``submit`` (checks and the clip, up to the record), ``queue`` (record written and task
sent, to the worker's start), ``prepare`` (the worker starts the record and reads the clip), ``render``, ``encode``,
``transfer`` (push to receipt) and ``total`` as the API saw it.

A streamed request (``stream_format: "audio"``, vLLM-Omni's ``stream: true``) answers with chunked transfer as the
worker's pieces arrive (``auk_worker/streaming.py``: the first 0.2 s of audio encoded and sent first, then a second
a piece); ``stream_format: "sse"`` sends each piece as OpenAI's ``speech.audio.delta`` event (base64 ``audio``) and
ends with ``speech.audio.done``. The status and headers go out with the first piece, so ``Server-Timing`` then
holds ``submit``, ``queue``, ``prepare`` and ``render`` only. A job that fails before its first piece is answered
with its error as any job is; a client that hangs up mid-stream cancels nothing: the job stores its file and
records its end, and the rest of its pieces expire unread.

While waiting, the route looks at the record between slices of the wait, so a job that fails or is canceled
before it can push anything is answered with its error. ``AUK_SPEECH_TIMEOUT`` bounds the wait (504 after it; the
job goes on and its record keeps the result).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from datetime import datetime
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.auth import caller
from api.deps import Services, services
from api.errors import RETRY_AFTER_S, error_response
from api.openapi import AUDIO_CONTENT, BODY_ERRORS, V1_ERRORS, errors
from api.requests import SpeechRequest, design_or_none, in_callers_terms, resolve_clip, to_job
from api.submit import ClipResolver, submit_job
from auk_worker import formats
from auk_worker.errors import InputError
from auk_worker.service.records.jobs import JobStatus
from auk_worker.service.delivery.replies import WAIT_SLICE_S, Reply

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["speech"], responses=V1_ERRORS)

_AUDIO_RESPONSES = {
    200: {"description": "The audio, in the requested format (streamed with stream_format audio, as server-sent events "
                         "with sse); its job id in X-Job-Id, the time split in Server-Timing.",
          "content": {**AUDIO_CONTENT, "text/event-stream": {"schema": {"type": "string"}}},
          "headers": {"X-Job-Id": {"description": "the job's id (GET /v1/jobs/{id})", "schema": {"type": "string"}},
                      "Server-Timing": {"description": "submit, queue, prepare, render, encode, transfer, total (ms)",
                                        "schema": {"type": "string"}}}},
    **errors(*BODY_ERRORS, 504),
}  # fmt: skip


# Codes of a job that failed through no fault of its request: a 5xx, not a 422.
SERVER_FAULTS = {"infrastructure": 503, "worker_crashed": 500, "out_of_memory": 503, "model_error": 500,
                 "internal": 500}  # fmt: skip


def _job_error(code: str, message: str) -> JSONResponse:
    """A failed job's answer: its code and message, 422 for the request's fault, else its server status."""
    status = SERVER_FAULTS.get(code)
    if status is None:
        return error_response(InputError(message, code=code))
    headers = {"Retry-After": RETRY_AFTER_S} if status == 503 else None
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def _submit(svc: Services, owner: str, body: SpeechRequest) -> tuple[str, float]:
    """The job's id, and the wall time its record was made (where ``queue`` starts). The one submit path, with the
    speech request's clip source, its reply (whole or streamed) and its field names; no idempotency key
    (``submit.submit_job`` says why)."""
    request, design = to_job(body)
    try:
        record, _ = submit_job(svc, owner, request, None,
                               clip_source=lambda job: resolve_clip(svc, body, job, ClipResolver(svc, owner)),
                               reply="stream" if body.streams else True, length_field="duration_seconds",
                               voice=design_or_none(design))  # fmt: skip
    except InputError as exc:  # the job's rules, said with this request's field names
        raise in_callers_terms(exc) from None
    return record.id, datetime.fromisoformat(record.created_at.replace("Z", "+00:00")).timestamp()


@router.post("/audio/speech", summary="Render speech and answer with the audio (OpenAI-compatible)",
             response_class=Response, responses=_AUDIO_RESPONSES)  # fmt: skip
async def create_speech(body: SpeechRequest, owner: str = Depends(caller), svc: Services = Depends(services)):
    started, started_at = time.perf_counter(), time.time()
    job_id, enqueued_at = await run_in_threadpool(_submit, svc, owner, body)
    deadline = started + svc.settings.speech_timeout_s
    reply = await _wait(svc, job_id, deadline)
    received = time.time()
    if isinstance(reply, JSONResponse):
        reply.headers["X-Job-Id"] = job_id
        return reply
    timings = reply.header.get("timings", {})
    split = {
        "submit": (enqueued_at - started_at) * 1000,
        "queue": max(0.0, (timings.get("started_at", enqueued_at) - enqueued_at) * 1000),
        "prepare": timings.get("prepare", 0.0) * 1000,
        "render": timings.get("render", 0.0) * 1000,
    }
    if body.streams is not None:
        headers = {"X-Job-Id": job_id, "Server-Timing": _server_timing(split), "Cache-Control": "no-store"}
        pieces = _pieces(svc, job_id, reply, deadline)
        if body.streams == "sse":
            return StreamingResponse(_events(pieces), media_type="text/event-stream", headers=headers)
        return StreamingResponse(_audio(pieces), media_type=reply.header.get("content_type"), headers=headers)
    split.update({
        "encode": timings.get("encode", 0.0) * 1000,
        "transfer": max(0.0, (received - reply.header.get("pushed_at", received)) * 1000),
        "total": (time.perf_counter() - started) * 1000,
    })  # fmt: skip
    headers = {"X-Job-Id": job_id, "Server-Timing": _server_timing(split)}
    return Response(reply.body, media_type=reply.header.get("content_type"), headers=headers)


def _server_timing(split: dict[str, float]) -> str:
    return ", ".join(f"{name};dur={ms:.2f}" for name, ms in split.items())


async def _pieces(svc: Services, job_id: str, first: Reply, deadline: float) -> AsyncIterator[Reply]:
    """A streamed job's messages from its first piece to its final marker; a failure after the first piece, or the
    wait running out, ends the stream with that message (``ok`` false)."""
    reply = first
    while True:
        yield reply
        if reply.final:
            return
        reply = await _wait(svc, job_id, deadline)
        if isinstance(reply, Reply) and reply.header.get("stored"):  # the rest of the pieces expired unread
            yield Reply({"status": "failed", "code": "timeout", "message": "the stream's pieces expired"}, b"")
            return
        if isinstance(reply, JSONResponse):
            error = json.loads(reply.body).get("error", {})
            log.warning("job %s: its stream ended early: %s", job_id, error.get("message"))
            yield Reply({"status": "failed", **error}, b"")
            return


async def _audio(pieces: AsyncIterator[Reply]) -> AsyncIterator[bytes]:
    """The audio bytes of each piece (chunked transfer); a stream cut by a failure just ends."""
    async for reply in pieces:
        if reply.ok and reply.body:
            yield reply.body


async def _events(pieces: AsyncIterator[Reply]) -> AsyncIterator[bytes]:
    """OpenAI's speech events: ``speech.audio.delta`` per piece, ``speech.audio.done`` at the end (AuK counts no
    tokens: its usage is zeros), or an ``error`` event when the job failed mid-stream."""
    async for reply in pieces:
        if not reply.ok:
            error = {"code": reply.header.get("code", "failed"), "message": reply.header.get("message", "")}
            yield _event({"type": "error", "error": error})
            return
        if reply.body:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(reply.body).decode()})
        if reply.final:
            yield _event({"type": "speech.audio.done",
                          "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}})  # fmt: skip


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def _wait(svc: Services, job_id: str, deadline: float) -> Reply | JSONResponse:
    """The worker's reply; or the job's error as a response when it ended without one."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            message = (f"the render did not finish within {svc.settings.speech_timeout_s} s; the job goes on: "
                       f"follow it at /v1/jobs/{job_id}")  # fmt: skip
            return JSONResponse({"error": {"code": "timeout", "message": message}}, status_code=504)
        reply = await svc.replies.wait(job_id, min(WAIT_SLICE_S, left))
        if reply is not None:
            if reply.ok:
                return reply
            return _job_error(reply.header.get("code", "failed"), reply.header.get("message", "the job failed"))
        record = await run_in_threadpool(svc.store.get, job_id)
        if record is None:
            return error_response(InputError(f"job {job_id} disappeared", code="not_found"))
        if record.status in (JobStatus.FAILED, JobStatus.CANCELED):
            error = record.error or {}
            return _job_error(error.get("code", record.status.value), error.get("message", record.status.value))
        if record.status == JobStatus.SUCCEEDED:  # the reply was pushed and taken or expired: read the stored copy
            result = record.result or {}
            data = await run_in_threadpool(svc.storage.get_bytes, result["bucket"], result["key"])
            spec = formats.get_format(result.get("format", "wav"))
            return Reply({"status": "succeeded", "content_type": spec.mime_type, "timings": {}, "stored": True}, data)
