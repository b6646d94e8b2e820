"""How a job ends in the worker, and everything that follows from it, in one place (rq's ``handle_job_success`` /
``handle_job_failure``): the record's final transition, the metrics, the waiting API's reply (a speech request),
the job's webhook and, when it was its batch's last job, the batch's results (manifest, error file, webhook).

- ``succeeded``: the stored audio's result recorded; a job canceled during its upload has its object removed.
- ``fail``: failed with a code and a sentence a person can act on.
- ``canceled``, ``skip``, ``ended_elsewhere``: the job ended without this attempt's transition (a cancel, a
  duplicate delivery, an attempt that died after recording its end); what its end should have fired is fired now
  (the delivery ids and the manifest's claim make each happen once).
- ``settle``: the process boundary's map from an exception to one of the above (or to a retry):

  - ``InputError`` (bad audio, a missing key, clip plus target over 30 s) and ``ModelError``: failed at once, never
    retried.
  - Storage unreachable: the steps wait for it with backoff (``StorageWait``) while the worker heartbeats busy, so
    an outage renders nothing twice; once storage has refused for ``AUK_STORAGE_RETRY_DEADLINE`` the job fails with
    ``storage_unavailable``.
  - ``InfraError`` otherwise (Redis unreachable): the caller retries (``tasks.py``: the attempt lets go of the
    record, back to ``queued``, and Celery sends the task again with exponential backoff, ``AUK_RETRY_BACKOFF`` *
    2^n s, ``AUK_RETRY_MAX`` times; then the job fails with the cause).
  - A Redis master that was failed over: left to the new master's delivery.
  - CUDA out of memory: failed with ``out_of_memory``, the cache emptied, the worker goes on.
  - ``Canceled`` (the step callback saw the record canceled, or the job taken from this attempt): nothing uploaded.

No torch import here: the out-of-memory check looks torch up only if the real pipeline loaded it.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import redis

from auk_worker import formats
from auk_worker.errors import AuKError, Canceled, InfraError, InputError, ModelError, OutOfMemory, StorageUnavailable
from auk_worker.service.connect.redis import RedisFailedOver
from auk_worker.service.connect.storage import StorageWait
from auk_worker.service.records.batches import write_results
from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.worker.runtime import RenderRuntime, on_current_master
from auk_worker.service.worker.stopping import OperatorStop
from auk_worker.streaming import AudioStream

log = logging.getLogger(__name__)


def succeeded(rt: RenderRuntime, job_id: str, key: str, result: dict[str, Any], wait: StorageWait, *,
              stages: dict[str, float], started: float, uploading: float) -> JobRecord | None:
    """Record the success of a job whose audio is stored at ``key`` (``result``: the record's result), then fire
    what follows. When the record no longer lets this attempt finish it (canceled during the upload: the object is
    removed; taken by another attempt: left as it is), settle what did happen instead.

    ``stages``: seconds by stage so far (the upload, from ``uploading``, is added); ``started``: perf_counter when
    the job began."""
    transition = on_current_master(rt, f"the end of job {job_id}", lambda: rt.store.finish(job_id, result, rt.holder))
    if transition.record is None:
        current = rt.store.get(job_id)
        if current is not None and current.status == JobStatus.CANCELED:  # the object goes, the record stays
            log.info("job %s: canceled during upload; removing %s", job_id, key)
            rt.metrics.outcome("canceled")
            wait.call(f"remove {key}", lambda: rt.storage.delete(key))
        elif current is None or (current.result or {}).get("key") != key:  # taken from this attempt
            log.warning("job %s: no longer held by this worker (%s); its result is not recorded and its object %s "
                        "is removed", job_id, current.status.value if current else "no record", key)  # fmt: skip
            wait.call(f"remove {key}", lambda: rt.storage.delete(key))
        ended_elsewhere(rt, job_id, current)
        return current
    record = transition.record
    stages = {"upload": time.perf_counter() - uploading, **stages}
    rt.metrics.succeeded(stages, time.perf_counter() - started)
    log.info("job %s: succeeded, %.2f s uploaded to %s", job_id, result["duration_s"], key,
             extra={"job_id": job_id, "batch_id": record.batch_id, "duration_s": result["duration_s"],
                    "stages": {name: round(s, 4) for name, s in stages.items()}})  # fmt: skip
    _webhook(rt, record)
    if transition.batch_done and record.batch_id:
        write_manifest(rt, record.batch_id)
    return record


def reply_audio(rt: RenderRuntime, record: JobRecord, encoded: tuple[formats.AudioFormat, bytes],
                timings: dict[str, float]) -> None:
    """A speech request's waiting API gets the audio as soon as it is encoded; the object and the record follow (a
    lost worker is redelivered: the record is still running, so the job renders and stores again)."""
    if record.request.get("reply") is True and rt.replies is not None:
        spec, data = encoded
        rt.replies.audio(record.id, data, fmt=spec.name, content_type=spec.mime_type, timings=timings)


def audio_stream(rt: RenderRuntime, record: JobRecord, fmt: str, timings: dict[str, float]) -> AudioStream | None:
    """A streamed speech request's answer (``reply: "stream"``): pieces are encoded and pushed as they are fed, the
    whole file is stored as for any job; None for any other job."""
    if record.request.get("reply") != "stream" or rt.replies is None:
        return None
    replies = rt.replies
    return AudioStream(lambda header, body: replies.send(record.id, header, body), fmt, timings)


def canceled(rt: RenderRuntime, job_id: str) -> None:
    """The job was canceled (or taken from this attempt) while this attempt worked on it: nothing is stored."""
    rt.metrics.outcome("canceled")
    ended_elsewhere(rt, job_id, None)


def _webhook(rt: RenderRuntime, record: JobRecord | None) -> None:
    if rt.notifier is not None:
        rt.notifier.job_ended(record)


def skip(rt: RenderRuntime, job_id: str) -> None:
    """A delivery of a terminal (or unknown) job, or of one a live worker holds: acknowledge it without rendering."""
    rt.metrics.outcome("skipped")
    record = rt.store.get(job_id)
    if record is None:
        log.warning("job %s: no record; message dropped", job_id)
        return
    if record.status == JobStatus.RUNNING:
        log.info("job %s: held by %s, which is alive; this delivery is dropped", job_id, record.worker)
        return
    log.info("job %s: already %s; not rendered again", job_id, record.status.value)
    ended_elsewhere(rt, job_id, record)


def fail(rt: RenderRuntime, job_id: str, code: str, message: str) -> JobRecord | None:
    """Fail the job (under this attempt's holder) and fire what follows: metrics, the waiting API's reply, the
    webhook, and the batch's results when this was its last job."""
    outcome = rt.store.fail(job_id, code, message, rt.holder)
    if outcome.record is not None:
        rt.metrics.outcome("failed")
        _webhook(rt, outcome.record)
    log.warning("job %s: failed (%s): %s", job_id, code, message,
                extra={"job_id": job_id, "error_code": code,
                       "batch_id": outcome.record.batch_id if outcome.record else None})  # fmt: skip
    if outcome.record is not None and outcome.record.request.get("reply") and rt.replies is not None:
        rt.replies.failure(job_id, code, message)  # the waiting API answers at once, not at its next look
    if outcome.batch_done and outcome.record and outcome.record.batch_id:
        write_manifest(rt, outcome.record.batch_id)
    return outcome.record


def ended_elsewhere(rt: RenderRuntime, job_id: str, record: JobRecord | None) -> None:
    """A job ended without this attempt's transition (canceled, or finished by an attempt that died before its
    message was acknowledged): write its batch's manifest if every job has ended and none is stored.

    A worker killed between recording a batch's last job and storing the manifest leaves only the redelivery of
    its message to write it, so this does not wait for a turn. A second write, racing that worker's, stores the
    same bytes: the records of an ended batch no longer change."""
    record = record or rt.store.get(job_id)
    _webhook(rt, record)  # the ending attempt's own enqueue may have been cut off; the delivery id makes it once
    if record is None or not record.batch_id:
        return
    batch = rt.store.get_batch(record.batch_id)
    if batch is not None and batch["done"] and batch["manifest_key"] is None:
        write_manifest(rt, record.batch_id)


def write_manifest(rt: RenderRuntime, batch_id: str) -> str:
    """The batch's results: its error file and manifest (JSONL: custom_id, job id, status, key or error), stored
    next to the WAVs, and its webhook (``batches.write_results``). A storage outage is waited out (``StorageWait``)
    until AUK_STORAGE_RETRY_DEADLINE; after that the InfraError retries the task, whose delivery meets an ended job
    and writes them then."""
    return StorageWait.from_settings(rt.settings).call(
        f"the results of batch {batch_id}",
        lambda: write_results(rt.store, rt.storage, rt.settings.s3_prefix, batch_id, notifier=rt.notifier),
    )


def _is_cuda_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # only a worker that loaded the real pipeline can run out of GPU memory
    return torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)


def _empty_cuda_cache() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def settle(rt: RenderRuntime, job_id: str, exc: BaseException) -> bool:
    """Record how an attempt at ``job_id`` ended with ``exc``. True for an infrastructure error (storage or Redis
    unreachable): the record is left as it is and the caller retries the job."""
    if isinstance(exc, OperatorStop):  # the worker's stop grace is over: back to the queue, not a crash
        log.info("job %s: %s", job_id, exc)
        if rt.stop is not None:
            rt.stop.release(job_id)
    elif isinstance(exc, Canceled):
        log.info("job %s: %s", job_id, exc)
        canceled(rt, job_id)
    elif isinstance(exc, RedisFailedOver):  # delivered by a demoted master: the new one still holds the message
        log.warning("job %s: %s; left to the new master's delivery", job_id, exc)
    elif isinstance(exc, StorageUnavailable):  # waited for storage until the deadline: retrying cannot help now
        fail(rt, job_id, exc.code, exc.message)
    elif isinstance(exc, (InfraError, redis.ConnectionError, redis.TimeoutError)):
        return True
    elif isinstance(exc, OutOfMemory) or _is_cuda_oom(exc):
        _empty_cuda_cache()
        message = exc.message if isinstance(exc, AuKError) else f"the GPU ran out of memory: {exc}"
        fail(rt, job_id, "out_of_memory", message)
    elif isinstance(exc, (InputError, ModelError)):
        fail(rt, job_id, exc.code, exc.message)
    else:
        log.error("job %s: unexpected error", job_id, exc_info=exc)
        code = exc.code if isinstance(exc, AuKError) else "internal"
        fail(rt, job_id, code, f"{type(exc).__name__}: {exc}")
    return False


def settle_into(rt: RenderRuntime, job_id: str, exc: BaseException, retry: dict[str, Exception]) -> None:
    """``_settle`` for one job of a group: a job to retry (or whose record could not be written, storage or
    Redis being down) goes into ``retry``; the group's other jobs go on."""
    try:
        stopped = settle(rt, job_id, exc)
    except (InfraError, redis.ConnectionError, redis.TimeoutError) as again:
        stopped, exc = True, again
    if stopped:
        retry[job_id] = exc  # type: ignore[assignment]
