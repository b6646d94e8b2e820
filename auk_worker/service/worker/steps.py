"""The steps every job takes in the worker, alone or in a group: start its record (``begin``), validate its
request and fetch its clip (``prepare``, ``load_clip``), report progress and see a cancel (``Progress``), encode the
audio (``encode``) and store it (``store_result``). How a job ends is ``outcome.py``'s; the single-job path is
``single.py``, the group path ``group.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from typing import Any
from urllib.parse import quote

import redis

from auk_worker import formats, rules
from auk_worker.audio import CheckedClip, decode_audio
from auk_worker.errors import Canceled
from auk_worker.service.connect.storage import StorageWait
from auk_worker.service.records.attempts import ResultNotes, attempt_key
from auk_worker.service.records.objects import input_object, result_key, upload_key
from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.records.requests import JobRequest
from auk_worker.service.worker import outcome
from auk_worker.service.worker.runtime import RenderRuntime, cancel_check
from auk_worker.types import RenderRequest, RenderResult

log = logging.getLogger(__name__)

REQUEST_FIELDS = frozenset(JobRequest.model_fields) | {"output_format"}  # the older name of response_format
# Progress (and the cancel check riding on it) is written at most this often, and at the last step: a render of
# 0.3 s writes once, a long one twice a second. A cancel is seen within this long (or one step, if steps are slower).
PROGRESS_INTERVAL_S = 0.5


def begin(rt: RenderRuntime, job_id: str) -> JobRecord | None:
    """Start the record: None for a delivery with nothing to do; a terminal record when the job crashed its
    workers too often (failed here); else the running record."""
    record = rt.store.start(job_id, rt.holder)
    if rt.barrier is not None:
        rt.barrier.wait(f"the start of job {job_id}")
    if record is None:
        outcome.skip(rt, job_id)
        return None
    log.info("job %s: attempt %d started (kills %d)", job_id, record.attempts, record.kills)
    if record.kills >= rt.settings.max_kills:
        message = (f"the job's worker died {record.kills} times while rendering it; "
                   "it is not tried again (a clip or parameters that crash the model?)")  # fmt: skip
        return outcome.fail(rt, job_id, "worker_crashed", message)
    return record


def prepare(rt: RenderRuntime, record: JobRecord) -> tuple[JobRequest, RenderRequest]:
    """The record's validated request and the pipeline's request: the clip fetched and decoded (and checked, once:
    the pipeline takes the checked clip as it is), the length rule applied to it as the API applied it."""
    fields = {k: v for k, v in record.request.items() if k in REQUEST_FIELDS}
    request = JobRequest.model_validate(fields, context={"has_clip": bool(record.request.get("clip"))})
    clip = load_clip(rt, request, record.request.get("clip"))
    plan = record.request.get("plan") or {}  # a one-pass plan: the instruction written and the length estimated
    render_request = RenderRequest(
        instruction=plan.get("instruction", request.instruction),
        audio=clip,
        gen_seconds=plan["gen_seconds"] if plan.get("kind") == "single" else request.gen_seconds,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        sway=request.sway,
        seed=request.seed,
    )
    rules.request_frames(render_request)
    return request, render_request


class Progress:
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
        self.last_write = time.monotonic()  # the first write comes an interval into the render

    def __call__(self, step: int, total: int) -> None:
        if self.rt.stop is not None:
            self.rt.stop.check()  # the worker's stop grace is over: the job goes back to the queue
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


def encode(request: JobRequest, result: RenderResult) -> tuple[formats.AudioFormat, bytes]:
    """The rendered waveform as the file the request asked for (``formats.py``)."""
    spec = formats.get_format(request.response_format)
    return spec, formats.encode(result.waveform, spec, result.sample_rate)


def store_result(
    rt: RenderRuntime, job_id: str, attempt: int, request: JobRequest, result: RenderResult, wait: StorageWait,
    stages: dict[str, float], started: float,
    encoded: tuple[formats.AudioFormat, bytes] | None = None, extra: dict[str, Any] | None = None,
) -> JobRecord | None:
    """Upload the audio to this attempt's own object (through ``wait``: an outage is waited out with the audio in
    hand) and settle the job's success naming it (``outcome.succeeded``). An attempt that no longer holds the job
    deletes its object: it never replaces the one the record names (``records/attempts.py``).

    ``stages``: seconds so far by stage (the upload is added); ``started``: perf_counter when the job began."""
    uploading = time.perf_counter()
    spec, data = encoded or encode(request, result)
    key = attempt_key(rt.settings.s3_prefix, job_id, attempt, spec.extension)
    notes = ResultNotes(rt.store.redis, rt.store.ns)
    notes.writing(key)
    metadata = _metadata(job_id, request, result, rt.pipeline.variant)
    storing = time.perf_counter()
    wait.call(f"upload {key}", lambda: rt.storage.put_bytes(key, data, spec.mime_type, metadata),
              cancel_check(rt, job_id))  # fmt: skip
    result.timings["store"] = time.perf_counter() - storing
    pipeline_stages = {name: s for name, s in result.timings.items() if name != "total"}  # the pipeline's own
    try:
        return outcome.succeeded(rt, job_id, key, {**_result(rt, key, request, result, spec), **(extra or {})}, wait,
                                 stages={**stages, **pipeline_stages}, started=started, uploading=uploading)
    finally:
        _settled(notes, key)


def _settled(notes: ResultNotes, key: str) -> None:
    """The note of ``key``'s upload goes once the record named it or the object was removed; a note left behind
    (Redis away) is dropped by the retention sweep."""
    try:
        notes.recorded(key)
    except redis.RedisError as exc:
        log.warning("%s: upload note not cleared (%s); the retention sweep will", key, exc)


def load_clip(rt: RenderRuntime, request: JobRequest, clip: dict[str, Any] | None) -> CheckedClip | None:
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
    decoded = dataclasses.replace(decode_audio(data, max_seconds=rt.settings.max_recording_s), key=digest)
    if cache is not None:
        cache.put(digest, "clip", decoded)
    return decoded


def _metadata(job_id: str, request: JobRequest, result: RenderResult, variant: str) -> dict[str, str]:
    """Object metadata (ASCII header values): the job's parameters and the seed actually used."""
    instruction = request.instruction or request.text or request.task or ""  # the parts: the text, or the task
    meta = {
        "job-id": job_id,
        "variant": variant,
        "seed": str(result.seed),
        "steps": str(result.num_inference_steps),
        "cfg": f"{result.guidance_scale:g}",
        "instruction-sha256": hashlib.sha256(instruction.encode()).hexdigest()[:16],
        "instruction": quote(instruction[:200], safe=" ,.;:!?'-_()"),
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
