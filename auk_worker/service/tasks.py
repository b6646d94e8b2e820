"""The render tasks: start the record, fetch the clip, render, encode, upload the audio, record the result.

``render_job`` is the whole job as one plain function over a ``RenderRuntime`` (pipeline, store, storage,
heartbeat), so it reads top to bottom and can be called without Celery. ``register`` binds it to a Celery app as
``auk.render`` and is the process boundary: it turns each error family into the record's final state.

``render_group`` is the bulk path (``auk.render_group``, a list of job ids sent by ``POST /v1/batches``): the same
steps for several jobs, with one ``pipeline.render_batch`` call so that compatible jobs share DiT passes. Every
job keeps its own record, seed, WAV and failure: a bad clip or a failed render fails that job alone, a job
canceled mid-render is dropped while its neighbours go on, and an infrastructure error retries only the jobs it
touched (as a smaller group). A job that was running when a worker died (``kills`` > 0) is rendered alone, so a
job that crashes the model cannot take its neighbours' attempts with it.

- ``InputError`` (bad audio, a missing key, clip plus target over 30 s): failed at once, never retried.
- Storage unreachable (its clip, its upload): the worker keeps what it holds (a rendered WAV stays in memory) and
  tries storage again with backoff (``StorageWait``) while it heartbeats busy, so an outage renders nothing twice;
  once storage has refused for ``AUK_STORAGE_RETRY_DEADLINE`` the job fails with ``storage_unavailable``.
- ``InfraError`` otherwise (Redis unreachable): the attempt lets go of the record (back to ``queued``) and Celery
  retries with exponential backoff (``AUK_RETRY_BACKOFF`` * 2^n s, ``AUK_RETRY_MAX`` times), then the job fails
  with the cause.
- CUDA out of memory: failed with ``out_of_memory``, the cache emptied, the worker goes on.
- ``Canceled`` (raised from the step callback once the record says canceled): nothing uploaded.
- A record found ``running`` under a dead holder means that holder died with it (``kills`` + 1, in ``start`` or
  in the reaper's release); at ``AUK_MAX_KILLS`` the job fails with ``worker_crashed`` instead of taking a further
  worker down. A record a live holder holds is not started again (a duplicate delivery, dropped).
- Every write of an attempt names its holder (``RenderRuntime.holder``), so an attempt whose job was taken from it
  (``recovery.py``) stops at its next step and records nothing.

No torch import here: the real pipeline brings it, and the out-of-memory check looks it up only if loaded.

Longer than 400 lines: the single-job and the group path share each step (begin, clip, store, settle) and the
Celery boundary that maps each error family to the record; together they read as one job's way through the worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

import redis
from celery import Celery, Task

from auk_worker import formats, rules
from auk_worker.audio import CheckedClip, decode_audio
from auk_worker.errors import AuKError, Canceled, InfraError, InputError, ModelError, OutOfMemory, StorageUnavailable
from auk_worker.service.batches import write_results
from auk_worker.service.celery_app import RENDER_TASK
from auk_worker.service.grouping import RENDER_GROUP_TASK
from auk_worker.service.health import Heartbeat
from auk_worker.service.jobs import JobRecord, JobStatus, JobStore
from auk_worker.service.redis_client import RedisFailedOver, ReplicationBarrier
from auk_worker.service.replies import ReplySender
from auk_worker.service.logs import job_context
from auk_worker.service.metrics import WorkerMetrics
from auk_worker.service.schema import JobRequest
from auk_worker.service.settings import Settings
from auk_worker.service.storage import Storage, StorageWait, input_object, result_key, upload_key
from auk_worker.streaming import AudioStream
from auk_worker.types import RenderRequest, RenderResult
from auk_worker.voice_cache import VoiceCache

log = logging.getLogger(__name__)

_REQUEST_FIELDS = frozenset(JobRequest.model_fields) | {"output_format"}  # the older name of response_format
PROGRESS_INTERVAL_S = 0.05  # a cancel is seen within this long (or one step, if steps are slower)
MAX_UPLOADS_IN_FLIGHT = 8  # a group's results are uploaded and recorded this many at a time


class Pipeline(Protocol):
    variant: str
    model_hashes: dict[str, str]

    def render(self, request: RenderRequest, on_step: Any = None) -> RenderResult: ...

    def render_batch(self, requests: list[RenderRequest], on_step: Any = None) -> list[RenderResult | AuKError]: ...


@dataclass
class RenderRuntime:
    """What a worker process loads once and every job uses."""

    settings: Settings
    pipeline: Pipeline
    store: JobStore
    storage: Storage
    heartbeat: Heartbeat | None = None
    barrier: ReplicationBarrier | None = None  # a job starts only on the current Redis master (Sentinel)
    replies: ReplySender | None = None  # pushes a speech job's audio to the waiting API (service/replies.py)
    voice_cache: VoiceCache | None = None  # decoded clips by content (the pipeline keeps its pieces in the same one)
    holder: str = field(default_factory=lambda: f"{socket.gethostname()}/{os.getpid()}")  # "<worker id>/<instance>"
    last_task_end: float | None = None  # perf_counter when the previous task returned (the idle time between)
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)  # served on AUK_METRICS_PORT when set


# ---------------------------------------------------------------------------------------------------- the job


def render_job(rt: RenderRuntime, job_id: str) -> JobRecord | None:
    """Run one job to its recorded end. Returns the final record, or None when there was nothing to do.

    Raises ``InputError``, ``InfraError``, ``Canceled``, ``ModelError`` for the boundary to record.
    """
    started_at, started = time.time(), time.perf_counter()
    record = _begin(rt, job_id)
    if record is None or record.terminal:
        return record
    with job_context(job_id, record.batch_id):
        wait = StorageWait.from_settings(rt.settings)
        request, render_request = wait.call(f"fetch the clip of job {job_id}", lambda: _prepare(rt, record),
                                            _cancel_check(rt, job_id))  # fmt: skip
        fetched = time.perf_counter()
        progress = _Progress(rt, [job_id])
        rendering = time.perf_counter()
        result = rt.pipeline.render(render_request, on_step=progress)  # the last step always checks for a cancel
        encoding = time.perf_counter()
        reply = record.request.get("reply") if rt.replies is not None else None
        if reply == "stream":  # the pieces go out as they are encoded; the whole file is stored as for any job
            timings = {"started_at": started_at, "prepare": rendering - started, "render": encoding - rendering}
            stream = AudioStream(lambda header, body: rt.replies.send(job_id, header, body), request.response_format,
                                 timings)  # fmt: skip
            stream.feed(result.waveform)
            stream.close()
        encoded = _encode(request, result)
        if reply is True:
            # The waiting API gets the audio now; the object and the record follow (a lost worker is redelivered:
            # the record is still running, so the job renders and stores again).
            timings = {"started_at": started_at, "prepare": rendering - started, "render": encoding - rendering,
                       "encode": time.perf_counter() - encoding}
            rt.replies.audio(job_id, encoded[1], fmt=encoded[0].name, content_type=encoded[0].mime_type,
                             timings=timings)  # fmt: skip
        stages = {"fetch": fetched - started, "render": encoding - rendering}
        return _store_result(rt, job_id, request, result, wait, stages, started, encoded)


def _begin(rt: RenderRuntime, job_id: str) -> JobRecord | None:
    """Start the record: None for a delivery with nothing to do; a terminal record when the job crashed its
    workers too often (failed here); else the running record."""
    record = rt.store.start(job_id, rt.holder)
    if rt.barrier is not None:
        rt.barrier.wait(f"the start of job {job_id}")
    if record is None:
        _skip(rt, job_id)
        return None
    log.info("job %s: attempt %d started (kills %d)", job_id, record.attempts, record.kills)
    if record.kills >= rt.settings.max_kills:
        message = (f"the job's worker died {record.kills} times while rendering it; "
                   "it is not tried again (a clip or parameters that crash the model?)")  # fmt: skip
        return _fail(rt, job_id, "worker_crashed", message)
    return record


def _prepare(rt: RenderRuntime, record: JobRecord) -> tuple[JobRequest, RenderRequest]:
    """The record's validated request and the pipeline's request: the clip fetched and decoded (and checked, once:
    the pipeline takes the checked clip as it is), the length rule applied to it as the API applied it."""
    fields = {k: v for k, v in record.request.items() if k in _REQUEST_FIELDS}
    request = JobRequest.model_validate(fields, context={"has_clip": bool(record.request.get("clip"))})
    clip = _load_clip(rt, request, record.request.get("clip"))
    render_request = RenderRequest(
        instruction=request.instruction,
        audio=clip,
        gen_seconds=request.gen_seconds,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        sway=request.sway,
        seed=request.seed,
    )
    rules.request_frames(render_request)
    return request, render_request


class _Progress:
    """The step callback: progress (and the cancel check riding on it) written to each job's record at most every
    ``PROGRESS_INTERVAL_S``, plus the last step.

    One job (``on_cancel`` None): a cancel (or the job taken from this attempt) raises ``Canceled`` and the render
    stops. Several jobs: such a job is reported to ``on_cancel`` and no longer written; the render stops only once
    every job is.
    """

    def __init__(self, rt: RenderRuntime, job_ids: list[str], on_cancel: Any = None) -> None:
        self.rt = rt
        self.live = list(job_ids)
        self.on_cancel = on_cancel
        self.last_write = 0.0

    def __call__(self, step: int, total: int) -> None:
        now = time.monotonic()
        if step < total and now - self.last_write < PROGRESS_INTERVAL_S:
            return
        self.last_write = now
        for job_id in list(self.live):
            status = self.rt.store.set_progress(job_id, step, total, self.rt.holder)
            if status == JobStatus.RUNNING:
                continue
            why = "was canceled" if status == JobStatus.CANCELED else "is no longer held by this worker"
            if self.on_cancel is None:
                raise Canceled(f"job {job_id} {why} at step {step} of {total}")
            log.info("job %s: %s at step %d of %d; its group goes on", job_id, why, step, total)
            self.live.remove(job_id)
            self.on_cancel(job_id)
        if not self.live:
            raise Canceled(f"every job of the group was canceled by step {step} of {total}")


def _encode(request: JobRequest, result: RenderResult) -> tuple[formats.AudioFormat, bytes]:
    """The rendered waveform as the file the request asked for (``formats.py``)."""
    spec = formats.get_format(request.response_format)
    return spec, formats.encode(result.waveform, spec, result.sample_rate)


def _store_result(
    rt: RenderRuntime, job_id: str, request: JobRequest, result: RenderResult, wait: StorageWait,
    stages: dict[str, float], started: float,
    encoded: tuple[formats.AudioFormat, bytes] | None = None,
) -> JobRecord | None:
    """Upload the audio (through ``wait``: an outage is waited out with the audio in hand) and record the success
    (and the batch manifest when this was the batch's last job).

    ``stages``: seconds so far by stage (the upload is added); ``started``: perf_counter when the job began."""
    uploading = time.perf_counter()
    spec, data = encoded or _encode(request, result)
    key = result_key(rt.settings.s3_prefix, job_id, spec.extension)
    metadata = _metadata(job_id, request, result, rt.pipeline.variant)
    storing = time.perf_counter()
    wait.call(f"upload {key}", lambda: rt.storage.put_bytes(key, data, spec.mime_type, metadata),
              _cancel_check(rt, job_id))  # fmt: skip
    result.timings["store"] = time.perf_counter() - storing
    outcome = _on_current_master(rt, f"the end of job {job_id}",
                                 lambda: rt.store.finish(job_id, _result(rt, key, request, result, spec), rt.holder))
    if outcome.record is None:
        current = rt.store.get(job_id)
        if current is not None and current.status == JobStatus.CANCELED:  # the object goes, the record stays
            log.info("job %s: canceled during upload; removing %s", job_id, key)
            rt.metrics.outcome("canceled")
            wait.call(f"remove {key}", lambda: rt.storage.delete(key))
        else:  # taken from this attempt: the key is the job's one object, which its current attempt writes too
            log.warning("job %s: no longer held by this worker (%s); its result is not recorded", job_id,
                        current.status.value if current else "no record")  # fmt: skip
        _after_terminal(rt, job_id, current)
        return current
    stages = {**stages, "upload": time.perf_counter() - uploading,
              **{name: s for name, s in result.timings.items() if name != "total"}}  # the pipeline's own stages
    rt.metrics.succeeded(stages, time.perf_counter() - started)
    log.info("job %s: succeeded, %.2f s uploaded to %s", job_id, result.duration_s, key,
             extra={"job_id": job_id, "batch_id": outcome.record.batch_id, "duration_s": result.duration_s,
                    "stages": {name: round(s, 4) for name, s in stages.items()}})  # fmt: skip
    if outcome.batch_done and outcome.record.batch_id:
        write_manifest(rt, outcome.record.batch_id)
    return outcome.record


# ---------------------------------------------------------------------------------------------------- the group


@dataclass
class _Member:
    """One started job of a group, ready to render."""

    job_id: str
    record: JobRecord
    request: JobRequest
    render_request: RenderRequest


def render_group(rt: RenderRuntime, job_ids: list[str]) -> dict[str, Exception]:
    """Run a group of bulk jobs to their recorded ends, sharing DiT passes; each job's outcome is its own.

    Returns the jobs an infrastructure error stopped (id -> error), for the boundary to retry; every other job
    is terminal (or was skipped) when this returns.
    """
    started = time.perf_counter()
    phases = {"prepare": 0.0, "render": 0.0, "store": 0.0}  # seconds, logged as one line per group
    retry: dict[str, Exception] = {}
    members: list[_Member] = []
    wait = StorageWait.from_settings(rt.settings)  # one outage clock for the whole group
    for job_id in job_ids:
        try:
            record = _begin(rt, job_id)
            if record is None or record.terminal:
                continue
            # A bad or missing clip fails this job only.
            request, render_request = wait.call(f"fetch the clip of job {job_id}", lambda: _prepare(rt, record),
                                                _cancel_check(rt, job_id))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - recorded per job
            _settle_into(rt, job_id, exc, retry)
            continue
        members.append(_Member(job_id, record, request, render_request))
    # A job that was running when a worker died may be what killed it: it renders alone, after the others.
    together = [m for m in members if m.record.kills == 0]
    alone = [[m] for m in members if m.record.kills > 0]
    phases["prepare"] = time.perf_counter() - started
    for pass_members in ([together] if together else []) + alone:
        retry.update(_render_members(rt, pass_members, phases, wait))
    log.info("group of %d: %s", len(job_ids), ", ".join(f"{name} {s * 1000:.1f} ms" for name, s in phases.items()))
    return retry


def _render_members(
    rt: RenderRuntime, members: list[_Member], phases: dict[str, float], wait: StorageWait
) -> dict[str, Exception]:
    """One ``render_batch`` call over started jobs, then an upload and a record per job (their wall times added
    to ``phases``; the uploads wait out a storage outage through ``wait``, each job's audio in hand)."""
    ids = [m.job_id for m in members]
    log.info("group of %d: rendering %s", len(members), ", ".join(ids))
    canceled: set[str] = set()
    progress = _Progress(rt, ids, on_cancel=canceled.add)
    retry: dict[str, Exception] = {}
    started = time.perf_counter()
    try:
        results: list[RenderResult | Exception] = rt.pipeline.render_batch(
            [m.render_request for m in members], on_step=progress
        )
    except Exception as exc:  # noqa: BLE001 - the whole call failed (every job canceled, or no pass ran)
        results = [exc] * len(members)
    rendered = time.perf_counter()
    phases["render"] += rendered - started

    def conclude(member: _Member, result: RenderResult | Exception) -> Exception | None:
        job_id = member.job_id
        try:
            if job_id in canceled or rt.store.is_canceled(job_id):
                log.info("job %s: canceled (or taken over) during its group's render; result dropped", job_id)
                rt.metrics.outcome("canceled")
                _after_terminal(rt, job_id, None)
                return None
            if isinstance(result, Exception):
                raise result
            _store_result(rt, job_id, member.request, result, wait, {"render": rendered - started}, started)
        except Exception as exc:  # noqa: BLE001 - recorded per job
            return exc
        return None

    # The uploads and records are network round trips: the group's run concurrently (boto3 clients and redis-py
    # clients are thread-safe), so a group of 8 waits about one upload, not eight.
    with ThreadPoolExecutor(max_workers=min(len(members), MAX_UPLOADS_IN_FLIGHT)) as pool:
        failures = list(pool.map(conclude, members, results))
    phases["store"] += time.perf_counter() - rendered
    for member, exc in zip(members, failures):
        if exc is not None:
            _settle_into(rt, member.job_id, exc, retry)
    return retry


def _on_current_master(rt: RenderRuntime, what: str, write: Callable[[], Any]) -> Any:
    """``write()``, then the replication barrier; when the write went to a Redis master that was failed over, once
    more on the new one (the audio is stored: recording the job's end again beats rendering it again)."""
    outcome = write()
    if rt.barrier is None:
        return outcome
    try:
        rt.barrier.wait(what)
    except RedisFailedOver as exc:
        log.warning("%s: %s; writing it again on the new master", what, exc)
        outcome = write()
        rt.barrier.wait(what)
    return outcome


def _cancel_check(rt: RenderRuntime, job_id: str) -> Any:
    """Run between storage tries: stop waiting (``Canceled``) once the job's record says canceled. Redis being
    unreachable too is no reason to drop what the worker holds, so it keeps waiting."""

    def check() -> None:
        try:
            canceled = rt.store.is_canceled(job_id)
        except redis.RedisError as exc:
            log.warning("job %s: cancel not checked while waiting for storage (%s)", job_id, exc)
            return
        if canceled:
            raise Canceled(f"job {job_id} was canceled while waiting for storage")

    return check


def _load_clip(rt: RenderRuntime, request: JobRequest, clip: dict[str, Any] | None) -> CheckedClip | None:
    """The job's clip, decoded, carrying its content key (the SHA-256 of its bytes) for the voice cache: from the
    cache when this content was decoded before, else fetched from where the API resolved it (``request.clip``:
    an upload, a voice, an input key, a speech request's inline clip)."""
    if clip is None and request.audio is None:
        return None
    digest = (clip or {}).get("sha256")
    cache = rt.voice_cache
    cached = cache.get(digest, "clip") if cache is not None else None
    if cached is not None:
        return cached
    if clip is not None:
        data = rt.storage.get_bytes(clip["bucket"], clip["key"])
    elif request.audio.upload_id is not None:
        data = rt.storage.get_bytes(rt.storage.bucket, upload_key(rt.settings.s3_prefix, request.audio.upload_id))
    else:
        data = rt.storage.get_bytes(*input_object(rt.settings, request.audio.key))
    digest = hashlib.sha256(data).hexdigest()
    decoded = dataclasses.replace(decode_audio(data), key=digest)
    if cache is not None:
        cache.put(digest, "clip", decoded)
    return decoded


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
        "format": request.response_format,
    }
    if request.gen_seconds is not None:
        meta["gen-seconds"] = f"{request.gen_seconds:g}"
    if request.sway is not None:
        meta["sway"] = f"{request.sway:g}"
    if request.custom_id is not None:
        meta["custom-id"] = quote(request.custom_id, safe="")
    return meta


def _result(rt: RenderRuntime, key: str, request: JobRequest, result: RenderResult,
            spec: formats.AudioFormat) -> dict[str, Any]:
    return {
        "bucket": rt.storage.bucket,
        "key": key,
        "duration_s": result.duration_s,
        "sample_rate": result.sample_rate,
        "samples": len(result.waveform),
        "seed": result.seed,
        "num_inference_steps": result.num_inference_steps,
        "guidance_scale": result.guidance_scale,
        "format": spec.name,
        "content_type": spec.mime_type,
        "variant": rt.pipeline.variant,
        "model_hashes": dict(rt.pipeline.model_hashes),
        "timings": {name: round(seconds, 4) for name, seconds in result.timings.items()},
    }


def _skip(rt: RenderRuntime, job_id: str) -> None:
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
    _after_terminal(rt, job_id, record)


def _fail(rt: RenderRuntime, job_id: str, code: str, message: str) -> JobRecord | None:
    outcome = rt.store.fail(job_id, code, message, rt.holder)
    if outcome.record is not None:
        rt.metrics.outcome("failed")
    log.warning("job %s: failed (%s): %s", job_id, code, message,
                extra={"job_id": job_id, "error_code": code,
                       "batch_id": outcome.record.batch_id if outcome.record else None})  # fmt: skip
    if outcome.record is not None and outcome.record.request.get("reply") and rt.replies is not None:
        rt.replies.failure(job_id, code, message)  # the waiting API answers at once, not at its next look
    if outcome.batch_done and outcome.record and outcome.record.batch_id:
        write_manifest(rt, outcome.record.batch_id)
    return outcome.record


def _after_terminal(rt: RenderRuntime, job_id: str, record: JobRecord | None) -> None:
    """A job ended without this attempt's transition (canceled, or finished by an attempt that died before its
    message was acknowledged): write its batch's manifest if every job has ended and none is stored.

    A worker killed between recording a batch's last job and storing the manifest leaves only the redelivery of
    its message to write it, so this does not wait for a turn. A second write, racing that worker's, stores the
    same bytes: the records of an ended batch no longer change."""
    record = record or rt.store.get(job_id)
    notifier = getattr(rt.store, "notifier", None)
    if notifier is not None:  # the transition's own enqueue may have been cut off; the delivery id makes it once
        notifier.job_ended(record)
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
        f"the results of batch {batch_id}", lambda: write_results(rt.store, rt.storage, rt.settings.s3_prefix, batch_id)
    )


# ---------------------------------------------------------------------------------------------------- boundary


def _is_cuda_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # only a worker that loaded the real pipeline can run out of GPU memory
    return torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)


def _empty_cuda_cache() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _settle(rt: RenderRuntime, job_id: str, exc: BaseException) -> bool:
    """Record how an attempt at ``job_id`` ended with ``exc``. True for an infrastructure error (storage or Redis
    unreachable): the record is left as it is and the caller retries the job."""
    if isinstance(exc, Canceled):
        log.info("job %s: %s", job_id, exc)
        rt.metrics.outcome("canceled")
        _after_terminal(rt, job_id, None)
    elif isinstance(exc, RedisFailedOver):  # delivered by a demoted master: the new one still holds the message
        log.warning("job %s: %s; left to the new master's delivery", job_id, exc)
    elif isinstance(exc, StorageUnavailable):  # waited for storage until the deadline: retrying cannot help now
        _fail(rt, job_id, exc.code, exc.message)
    elif isinstance(exc, (InfraError, redis.ConnectionError, redis.TimeoutError)):
        return True
    elif isinstance(exc, OutOfMemory) or _is_cuda_oom(exc):
        _empty_cuda_cache()
        message = exc.message if isinstance(exc, AuKError) else f"the GPU ran out of memory: {exc}"
        _fail(rt, job_id, "out_of_memory", message)
    elif isinstance(exc, (InputError, ModelError)):
        _fail(rt, job_id, exc.code, exc.message)
    else:
        log.error("job %s: unexpected error", job_id, exc_info=exc)
        code = exc.code if isinstance(exc, AuKError) else "internal"
        _fail(rt, job_id, code, f"{type(exc).__name__}: {exc}")
    return False


def _settle_into(rt: RenderRuntime, job_id: str, exc: BaseException, retry: dict[str, Exception]) -> None:
    """``_settle`` for one job of a group: a job to retry (or whose record could not be written, storage or
    Redis being down) goes into ``retry``; the group's other jobs go on."""
    try:
        stopped = _settle(rt, job_id, exc)
    except (InfraError, redis.ConnectionError, redis.TimeoutError) as again:
        stopped, exc = True, again
    if stopped:
        retry[job_id] = exc  # type: ignore[assignment]


def register(app: Celery, runtime: RenderRuntime) -> tuple[Task, Task]:
    """Bind ``auk.render`` and ``auk.render_group`` to ``app``, running every job in ``runtime``."""
    settings = runtime.settings

    @app.task(name=RENDER_TASK, bind=True, acks_late=True, ignore_result=True, max_retries=settings.retry_max)
    def render(self: Task, job_id: str) -> None:
        started = time.perf_counter()
        _busy(runtime, job_id)
        try:
            with job_context(job_id):
                render_job(runtime, job_id)
        except Exception as exc:  # noqa: BLE001 - the process boundary: every job ends with a record
            with job_context(job_id):
                if _settle(runtime, job_id, exc):
                    _retry_or_fail(self, runtime, {job_id: exc}, lambda ids: [ids[0]])
        finally:
            _ready(runtime)
            log.debug("job %s: task took %.1f ms", job_id, (time.perf_counter() - started) * 1000)
            runtime.last_task_end = time.perf_counter()

    @app.task(name=RENDER_GROUP_TASK, bind=True, acks_late=True, ignore_result=True, max_retries=settings.retry_max)
    def render_group_task(self: Task, job_ids: list[str]) -> None:
        started = time.perf_counter()
        if runtime.last_task_end is not None:  # Celery's share: ack, fetch and hand over the next message
            log.info("group of %d: %.1f ms since the previous task returned", len(job_ids),
                     (started - runtime.last_task_end) * 1000)  # fmt: skip
        _busy(runtime, ",".join(job_ids))
        try:
            retry = render_group(runtime, job_ids)
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # Redis went away between jobs: all again
            retry = {job_id: exc for job_id in job_ids}
        finally:
            _ready(runtime)
        log.debug("group of %d: task took %.1f ms", len(job_ids), (time.perf_counter() - started) * 1000)
        try:
            if retry:  # only the jobs an infrastructure error stopped, as a smaller group; finished ones stay done
                _retry_or_fail(self, runtime, retry, lambda ids: [ids])
        finally:
            runtime.last_task_end = time.perf_counter()

    return render, render_group_task


def _busy(rt: RenderRuntime, what: str) -> None:
    if rt.heartbeat is not None:
        rt.heartbeat.set("busy", what)


def _ready(rt: RenderRuntime) -> None:
    if rt.heartbeat is not None:
        rt.heartbeat.set("ready")


def _retry_or_fail(task: Task, rt: RenderRuntime, stopped: dict[str, Exception], args_for: Any) -> None:
    """Let go of each stopped job's record and have Celery send the task again (``args_for(job ids)``) after a
    backoff; fail the jobs once retries run out."""
    retries = task.request.retries
    give_up = retries >= rt.settings.retry_max
    for job_id, exc in stopped.items():
        message = exc.message if isinstance(exc, AuKError) else f"Redis unreachable: {exc}"
        try:
            if give_up:
                _fail(rt, job_id, "infrastructure", f"gave up after {retries + 1} attempts: {message}")
            else:
                rt.store.requeue(job_id, rt.holder)
        except (InfraError, redis.RedisError) as again:
            # Redis itself is down: the record cannot be touched; the redelivered message will find it running
            # under this holder, which counts no kill.
            log.warning("job %s: record not updated (%s)", job_id, again)
            if give_up:
                raise
        if not give_up:
            log.warning("job %s: %s; retry %d of %d", job_id, message, retries + 1, rt.settings.retry_max)
            rt.metrics.outcome("retried")
    if give_up:
        return
    countdown = rt.settings.retry_backoff_s * 2**retries
    log.info("retrying %d job(s) in %.1f s", len(stopped), countdown)
    queue = (task.request.delivery_info or {}).get("routing_key")
    cause = next(iter(stopped.values()))
    raise task.retry(args=args_for(list(stopped)), countdown=countdown, max_retries=rt.settings.retry_max,
                     queue=queue) from cause  # fmt: skip
