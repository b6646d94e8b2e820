"""One job's way through the worker (``auk.render``): start its record, fetch its clip, render, encode, store and
settle. A plain function over a ``RenderRuntime``, so it reads top to bottom and runs without Celery; it raises
``InputError``, ``InfraError``, ``Canceled`` or ``ModelError`` for the task boundary (``tasks.py``) to settle.
"""

from __future__ import annotations

import time

from auk_worker.longform.plan import is_long
from auk_worker.service.connect.logs import job_context
from auk_worker.service.connect.storage import StorageWait
from auk_worker.service.records.jobs import JobRecord
from auk_worker.service.worker import outcome
from auk_worker.service.worker.long import render_long
from auk_worker.service.worker.runtime import RenderRuntime, cancel_check
from auk_worker.service.worker.steps import Progress, begin, encode, prepare, store_result


def render_job(rt: RenderRuntime, job_id: str) -> JobRecord | None:
    """Run one job to its recorded end. Returns the final record, or None when there was nothing to do.

    Raises ``InputError``, ``InfraError``, ``Canceled``, ``ModelError`` for the boundary to record.
    """
    started_at, started = time.time(), time.perf_counter()
    record = begin(rt, job_id)
    if record is None or record.terminal:
        return record
    if is_long(record.request.get("plan")):
        with job_context(job_id, record.batch_id):
            return render_long(rt, job_id, record, started_at, started)
    with job_context(job_id, record.batch_id):
        wait = StorageWait.from_settings(rt.settings)
        request, render_request = wait.call(f"fetch the clip of job {job_id}", lambda: prepare(rt, record),
                                            cancel_check(rt, job_id))  # fmt: skip
        fetched = time.perf_counter()
        progress = Progress(rt, [job_id])
        rendering = time.perf_counter()
        result = rt.pipeline.render(render_request, on_step=progress)  # the last step always checks for a cancel
        encoding = time.perf_counter()
        stream = outcome.audio_stream(rt, record, request.response_format, {
            "started_at": started_at, "prepare": rendering - started, "render": encoding - rendering})
        if stream is not None:  # the pieces go out as they are encoded; the whole file is stored as for any job
            stream.feed(result.waveform)
            stream.close()
        encoded = encode(request, result)
        # A speech request's waiting API gets the audio now; the object and the record follow.
        outcome.reply_audio(rt, record, encoded, {"started_at": started_at, "prepare": rendering - started,
                                                  "render": encoding - rendering,
                                                  "encode": time.perf_counter() - encoding})
        stages = {"fetch": fetched - started, "render": encoding - rendering}
        return store_result(rt, job_id, record.attempts, request, result, wait, stages, started, encoded)
