"""A long job's way through the worker: a text or recording longer than one pass, still one job.

Its plan (``record.request["plan"]``, ``longform/plan.py``) lists segments (a text) or windows (a recording); they
render in groups of the deploy config's ``max_num_seqs`` (``longform/render.py``), each finished one stored under the
job's prefix so that a later attempt renders only the missing ones; the progress counts segments and a cancel stops at
the next step; the record lists each segment's place in the file, and an optional timestamps file goes beside it.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from auk_worker.audio import resample
from auk_worker.errors import Canceled, InfraError, InputError, ModelError
from auk_worker.longform import timestamps as longform_timestamps
from auk_worker.longform.render import Hooks, SegmentStore, render_plan
from auk_worker.service.connect.storage import StorageWait
from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.records.objects import result_key
from auk_worker.service.records.requests import JobRequest
from auk_worker.service.worker import outcome
from auk_worker.service.worker.runtime import Pipeline, RenderRuntime, cancel_check
from auk_worker.service.worker.steps import PROGRESS_INTERVAL_S, REQUEST_FIELDS, encode, load_clip, store_result
from auk_worker.types import SAMPLE_RATE, AudioClip, RenderResult

log = logging.getLogger(__name__)


def render_long(rt: RenderRuntime, job_id: str, record: JobRecord, started_at: float,
                 started: float) -> JobRecord | None:  # fmt: skip
    """A text or recording longer than one pass (``record.request["plan"]``, ``longform/plan.py``), still one job:
    its segments render in groups of the deploy config's ``max_num_seqs`` (``longform/render.py``); each finished
    segment is stored under the job's prefix, so a later attempt renders only the missing ones; the progress counts
    segments (step k of N) and a cancel stops at the next step; the record lists each segment's place in the file."""
    plan = record.request["plan"]
    wait = StorageWait.from_settings(rt.settings)
    fields = {k: v for k, v in record.request.items() if k in REQUEST_FIELDS}
    request = JobRequest.model_validate(fields)
    clip = wait.call(f"fetch the clip of job {job_id}", lambda: load_clip(rt, request, record.request.get("clip")),
                     cancel_check(rt, job_id))  # fmt: skip
    if plan["kind"] == "windows":  # windows are cut from the source at 24 kHz, in whole latent frames
        clip = AudioClip(resample(clip.samples, clip.sample_rate, SAMPLE_RATE), SAMPLE_RATE)
    fetched = time.perf_counter()
    store = SegmentStore(rt.storage, result_key(rt.settings.s3_prefix, job_id).rsplit(".", 1)[0] + "/segments/")
    count = len(plan["segments"] if plan["kind"] == "text" else plan["windows"])
    done = [0]
    last_check = [0.0]

    def progress(finished: int, total: int) -> None:
        done[0] = finished
        status = rt.store.set_progress(job_id, finished, total, rt.holder)
        if status != JobStatus.RUNNING:
            why = "was canceled" if status == JobStatus.CANCELED else "is no longer held by this worker"
            raise Canceled(f"job {job_id} {why} after {finished} of {total} segments")

    def on_step(step: int, steps: int) -> None:
        if rt.stop is not None:
            rt.stop.check()  # the worker's stop grace is over: the job goes back to the queue
        now = time.monotonic()
        if now - last_check[0] >= PROGRESS_INTERVAL_S:
            last_check[0] = now
            progress(done[0], count)

    stream = outcome.audio_stream(rt, record, request.response_format, {"started_at": started_at})

    def on_segment(index: int, samples: Any, is_last: bool) -> None:
        if stream is not None:  # a streamed speech request hears each part of the file as it becomes final
            stream.feed(samples)
            if is_last:
                stream.close()

    knobs = {name: getattr(request, name) for name in ("num_inference_steps", "guidance_scale", "sway", "seed")}
    hooks = Hooks(load=store.load, save=store.save, progress=progress, on_step=on_step, on_segment=on_segment)
    rendering = time.perf_counter()
    try:
        long = render_plan(rt.pipeline, plan, clip, knobs, hooks, group_size=_group_size(rt.pipeline))
    except (Canceled, InputError, ModelError):
        # The job ends here (canceled, or failed for good): its segments go. One taken over by another attempt
        # keeps them, for that attempt to pick up.
        if rt.store.is_canceled(job_id) or not isinstance(sys.exc_info()[1], Canceled):
            _clear_segments(store, job_id)
        raise
    rendered = time.perf_counter()
    result = RenderResult(long.waveform, long.seed, long.num_inference_steps, long.guidance_scale,
                          timings={"render": rendered - rendering})  # fmt: skip
    texts = [s["text"] for s in plan["segments"]] if plan["kind"] == "text" else [None] * count
    segments = [{"index": i, "text": texts[i], "start": round(a, 3), "end": round(b, 3)}
                for i, (a, b) in enumerate(long.spans)]  # fmt: skip
    extra: dict[str, Any] = {"segments": segments, "passes": long.passes, "segments_rendered": long.rendered,
                             "duration": plan["duration"], "first_segment_s": round(long.first_audio_s or 0.0, 4)}
    if request.timestamps is not None:
        extension, mime = longform_timestamps.FORMATS[request.timestamps]
        key = result_key(rt.settings.s3_prefix, job_id, extension)
        data = longform_timestamps.render(segments, request.timestamps)
        wait.call(f"upload {key}", lambda: rt.storage.put_bytes(key, data, mime, {"job-id": job_id}),
                  cancel_check(rt, job_id))  # fmt: skip
        extra["timestamps"] = {"key": key, "format": request.timestamps, "content_type": mime}
    encoded = encode(request, result)
    if record.request.get("reply") is True and rt.replies is not None:
        timings = {"started_at": started_at, "prepare": rendering - started, "render": rendered - rendering,
                   "encode": time.perf_counter() - rendered}  # fmt: skip
        rt.replies.audio(job_id, encoded[1], fmt=encoded[0].name, content_type=encoded[0].mime_type, timings=timings)
    stages = {"fetch": fetched - started, "render": rendered - rendering}
    final = store_result(rt, job_id, record.attempts, request, result, wait, stages, started, encoded, extra=extra)
    if final is not None and final.status == JobStatus.SUCCEEDED:
        _clear_segments(store, job_id)  # the file is stored: the segments are no longer needed
    return final


def _clear_segments(store: SegmentStore, job_id: str) -> None:
    try:
        store.clear()
    except InfraError as exc:  # left for the retention sweep of the job's prefix
        log.warning("job %s: stored segments not removed: %s", job_id, exc)


def _group_size(pipeline: Pipeline) -> int:
    """Segments per render_batch call: the deploy config's stage 1 ``max_num_seqs`` (one DiT pass's rows)."""
    return max(1, pipeline.deploy.dit.max_num_seqs)
