"""The render task: start the record, fetch the clip, render, upload the WAV, record the result.

``render_job`` is the whole job as one plain function over a ``RenderRuntime`` (pipeline, store, storage,
heartbeat), so it reads top to bottom and can be called without Celery. ``register`` binds it to a Celery app as
``auk.render`` and is the process boundary: it turns each error family into the record's final state.

- ``InputError`` (bad audio, a missing key, clip plus target over 30 s): failed at once, never retried.
- ``InfraError`` (storage or Redis unreachable): the attempt lets go of the record (back to ``queued``) and Celery
  retries with exponential backoff (``AUK_RETRY_BACKOFF`` * 2^n s, ``AUK_RETRY_MAX`` times), then the job fails
  with the cause.
- CUDA out of memory: failed with ``out_of_memory``, the cache emptied, the worker goes on.
- ``Canceled`` (raised from the step callback once the record says canceled): nothing uploaded.
- A record found ``running`` under another holder means that holder died with it (``kills`` + 1, in ``start``);
  at ``AUK_MAX_KILLS`` the job fails with ``worker_crashed`` instead of taking a further worker down.

No torch import here: the real pipeline brings it, and the out-of-memory check looks it up only if loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

import redis
from celery import Celery, Task

from auk_worker.audio import decode_audio
from auk_worker.errors import AuKError, Canceled, InfraError, InputError, ModelError, OutOfMemory
from auk_worker.service.celery_app import RENDER_TASK
from auk_worker.service.health import Heartbeat
from auk_worker.service.jobs import JobRecord, JobStatus, JobStore
from auk_worker.service.schema import JobRequest, check_total_length
from auk_worker.service.settings import Settings
from auk_worker.service.storage import Storage, manifest_key, result_key, upload_key
from auk_worker.types import AudioClip, RenderRequest, RenderResult
from auk_worker.wav import write_wav

log = logging.getLogger(__name__)

_REQUEST_FIELDS = frozenset(JobRequest.model_fields)
PROGRESS_INTERVAL_S = 0.05  # a cancel is seen within this long (or one step, if steps are slower)


class Pipeline(Protocol):
    variant: str
    model_hashes: dict[str, str]

    def render(self, request: RenderRequest, on_step: Any = None) -> RenderResult: ...


@dataclass
class RenderRuntime:
    """What a worker process loads once and every job uses."""

    settings: Settings
    pipeline: Pipeline
    store: JobStore
    storage: Storage
    heartbeat: Heartbeat | None = None
    holder: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")  # "host:pid" on the record


# ---------------------------------------------------------------------------------------------------- the job


def render_job(rt: RenderRuntime, job_id: str) -> JobRecord | None:
    """Run one job to its recorded end. Returns the final record, or None when there was nothing to do.

    Raises ``InputError``, ``InfraError``, ``Canceled``, ``ModelError`` for the boundary to record.
    """
    record = rt.store.start(job_id, rt.holder)
    if record is None:
        _skip(rt, job_id)
        return None
    log.info("job %s: attempt %d started (kills %d)", job_id, record.attempts, record.kills)
    if record.kills >= rt.settings.max_kills:
        message = (f"the job's worker died {record.kills} times while rendering it; "
                   "it is not tried again (a clip or parameters that crash the model?)")  # fmt: skip
        return _fail(rt, job_id, "worker_crashed", message)

    request = JobRequest.model_validate({k: v for k, v in record.request.items() if k in _REQUEST_FIELDS})
    clip = _load_clip(rt, request)
    check_total_length(request, clip.duration_s if clip else None)
    render_request = RenderRequest(
        instruction=request.instruction,
        audio=clip,
        gen_seconds=request.gen_seconds,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        sway=request.sway,
        seed=request.seed,
    )

    last_write = 0.0

    def on_step(step: int, total: int) -> None:
        # Progress (and the cancel check riding on it) at most every PROGRESS_INTERVAL_S, plus the last step.
        nonlocal last_write
        now = time.monotonic()
        if step < total and now - last_write < PROGRESS_INTERVAL_S:
            return
        last_write = now
        if rt.store.set_progress(job_id, step, total) == JobStatus.CANCELED:
            raise Canceled(f"job {job_id} was canceled at step {step} of {total}")

    result = rt.pipeline.render(render_request, on_step=on_step)  # the last step always checks for a cancel

    key = result_key(rt.settings.s3_prefix, job_id)
    rt.storage.put_wav(key, write_wav(result.waveform, result.sample_rate, request.output_format),
                       _metadata(job_id, request, result, rt.pipeline.variant))  # fmt: skip
    outcome = rt.store.finish(job_id, _result(rt, key, request, result))
    if outcome.record is None:  # canceled while uploading: the object goes, the record stays canceled
        log.info("job %s: canceled during upload; removing %s", job_id, key)
        rt.storage.delete(key)
        _after_terminal(rt, job_id, None)
        return rt.store.get(job_id)
    log.info("job %s: succeeded, %.2f s uploaded to %s", job_id, result.duration_s, key)
    if outcome.batch_done and outcome.record.batch_id:
        write_manifest(rt, outcome.record.batch_id)
    return outcome.record


def _load_clip(rt: RenderRuntime, request: JobRequest) -> AudioClip | None:
    if request.audio is None:
        return None
    if request.audio.upload_id is not None:
        data = rt.storage.get_bytes(rt.storage.bucket, upload_key(rt.settings.s3_prefix, request.audio.upload_id))
    else:
        data = rt.storage.get_bytes(rt.storage.input_bucket, request.audio.key)
    return decode_audio(data)


def _metadata(job_id: str, request: JobRequest, result: RenderResult, variant: str) -> dict[str, str]:
    """Object metadata (ASCII header values): the job's parameters and the seed actually used."""
    meta = {
        "job-id": job_id,
        "variant": variant,
        "seed": str(result.seed),
        "steps": str(result.num_inference_steps),
        "cfg": f"{result.guidance_scale:g}",
        "instruction-sha256": hashlib.sha256(request.instruction.encode()).hexdigest()[:16],
        "instruction": quote(request.instruction[:200], safe=" ,.;:!?'-_()"),
        "format": request.output_format,
    }
    if request.gen_seconds is not None:
        meta["gen-seconds"] = f"{request.gen_seconds:g}"
    if request.sway is not None:
        meta["sway"] = f"{request.sway:g}"
    if request.custom_id is not None:
        meta["custom-id"] = quote(request.custom_id, safe="")
    return meta


def _result(rt: RenderRuntime, key: str, request: JobRequest, result: RenderResult) -> dict[str, Any]:
    return {
        "bucket": rt.storage.bucket,
        "key": key,
        "duration_s": result.duration_s,
        "sample_rate": result.sample_rate,
        "samples": len(result.waveform),
        "seed": result.seed,
        "num_inference_steps": result.num_inference_steps,
        "guidance_scale": result.guidance_scale,
        "format": request.output_format,
        "variant": rt.pipeline.variant,
        "model_hashes": dict(rt.pipeline.model_hashes),
        "timings": {name: round(seconds, 4) for name, seconds in result.timings.items()},
    }


def _skip(rt: RenderRuntime, job_id: str) -> None:
    """A delivery of a terminal (or unknown) job: acknowledge it without rendering."""
    record = rt.store.get(job_id)
    if record is None:
        log.warning("job %s: no record; message dropped", job_id)
        return
    log.info("job %s: already %s; not rendered again", job_id, record.status.value)
    _after_terminal(rt, job_id, record)


def _fail(rt: RenderRuntime, job_id: str, code: str, message: str) -> JobRecord | None:
    outcome = rt.store.fail(job_id, code, message)
    log.warning("job %s: failed (%s): %s", job_id, code, message)
    if outcome.batch_done and outcome.record and outcome.record.batch_id:
        write_manifest(rt, outcome.record.batch_id)
    return outcome.record


def _after_terminal(rt: RenderRuntime, job_id: str, record: JobRecord | None) -> None:
    """A job ended without this attempt's transition (canceled): write its batch's manifest if it was the last."""
    record = record or rt.store.get(job_id)
    if record is not None and record.batch_id and rt.store.claim_batch_manifest(record.batch_id):
        write_manifest(rt, record.batch_id)


def write_manifest(rt: RenderRuntime, batch_id: str) -> str:
    """The batch's results manifest (JSONL: custom_id, job id, status, key or error), stored next to the WAVs."""
    lines = []
    for record in rt.store.batch_records(batch_id):
        line: dict[str, Any] = {"custom_id": record.custom_id, "job_id": record.id, "status": record.status.value}
        if record.status == JobStatus.SUCCEEDED and record.result:
            line["key"] = record.result["key"]
        else:
            line["error"] = record.error
        lines.append(json.dumps(line, separators=(",", ":")))
    key = manifest_key(rt.settings.s3_prefix, batch_id)
    try:
        rt.storage.put_bytes(key, ("\n".join(lines) + "\n").encode(), "application/x-ndjson")
    except InfraError:
        rt.store.release_batch_manifest(batch_id)  # the retry of this task claims and writes it again
        raise
    rt.store.set_batch_manifest(batch_id, key)
    log.info("batch %s: manifest of %d jobs written to %s", batch_id, len(lines), key)
    return key


# ---------------------------------------------------------------------------------------------------- boundary


def _is_cuda_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # only a worker that loaded the real pipeline can run out of GPU memory
    return torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)


def _empty_cuda_cache() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def register(app: Celery, runtime: RenderRuntime) -> Task:
    """Bind ``auk.render`` to ``app``, running every job in ``runtime``; returns the task."""
    settings = runtime.settings

    @app.task(name=RENDER_TASK, bind=True, acks_late=True, ignore_result=True, max_retries=settings.retry_max)
    def render(self: Task, job_id: str) -> None:
        started = time.perf_counter()
        heartbeat = runtime.heartbeat
        if heartbeat is not None:
            heartbeat.set("busy", job_id)
        try:
            render_job(runtime, job_id)
        except Canceled as exc:
            log.info("job %s: %s", job_id, exc)
            _after_terminal(runtime, job_id, None)
        except InputError as exc:
            _fail(runtime, job_id, exc.code, exc.message)
        except (InfraError, redis.ConnectionError, redis.TimeoutError) as exc:
            _retry_or_fail(self, runtime, job_id, exc)
        except OutOfMemory as exc:
            _empty_cuda_cache()
            _fail(runtime, job_id, exc.code, exc.message)
        except ModelError as exc:
            _fail(runtime, job_id, exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - the process boundary: every job ends with a record
            if _is_cuda_oom(exc):
                _empty_cuda_cache()
                _fail(runtime, job_id, "out_of_memory", f"the GPU ran out of memory: {exc}")
            else:
                log.exception("job %s: unexpected error", job_id)
                code = exc.code if isinstance(exc, AuKError) else "internal"
                _fail(runtime, job_id, code, f"{type(exc).__name__}: {exc}")
        finally:
            if heartbeat is not None:
                heartbeat.set("ready")
            log.debug("job %s: task took %.1f ms", job_id, (time.perf_counter() - started) * 1000)

    return render


def _retry_or_fail(task: Task, rt: RenderRuntime, job_id: str, exc: Exception) -> None:
    """Let go of the record and have Celery send the job again after a backoff; fail it once retries run out."""
    retries = task.request.retries
    message = exc.message if isinstance(exc, AuKError) else f"Redis unreachable: {exc}"
    try:
        if retries >= rt.settings.retry_max:
            _fail(rt, job_id, "infrastructure", f"gave up after {retries + 1} attempts: {message}")
            return
        rt.store.requeue(job_id)
    except (InfraError, redis.RedisError) as again:
        # Redis itself is down: the record cannot be touched; the redelivered message will find it running
        # under this holder, which counts no kill.
        log.warning("job %s: record not updated (%s)", job_id, again)
        if retries >= rt.settings.retry_max:
            raise
    countdown = rt.settings.retry_backoff_s * 2**retries
    log.warning("job %s: %s; retry %d of %d in %.1f s", job_id, message, retries + 1, rt.settings.retry_max, countdown)
    queue = (task.request.delivery_info or {}).get("routing_key")
    raise task.retry(countdown=countdown, max_retries=rt.settings.retry_max, queue=queue) from exc
