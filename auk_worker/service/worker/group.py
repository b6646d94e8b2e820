"""The bulk path (``auk.render_group``, a list of job ids sent by ``POST /v1/batches``): the steps of ``steps.py`` for
several jobs, with one ``pipeline.render_batch`` call so that compatible jobs share DiT passes.

Every job keeps its own record, seed, WAV and failure: a bad clip or a failed render fails that job alone, a job
canceled mid-render is dropped while its neighbours go on, and an infrastructure error retries only the jobs it
touched (as a smaller group). A job that was running when a worker died (``kills`` > 0) is rendered alone, so a
job that crashes the model cannot take its neighbours' attempts with it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from auk_worker.service.connect.storage import StorageWait
from auk_worker.service.records.jobs import JobRecord
from auk_worker.service.records.requests import JobRequest
from auk_worker.service.worker import outcome
from auk_worker.longform.plan import is_long
from auk_worker.service.worker.long import render_long
from auk_worker.service.worker.runtime import RenderRuntime, cancel_check
from auk_worker.service.worker.steps import Progress, begin, prepare, store_result
from auk_worker.types import RenderRequest, RenderResult

log = logging.getLogger(__name__)

MAX_UPLOADS_IN_FLIGHT = 8  # a group's results are uploaded and recorded this many at a time


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
            record = begin(rt, job_id)
            if record is None or record.terminal:
                continue
            if is_long(record.request.get("plan")):  # its segments are its own groups
                render_long(rt, job_id, record, time.time(), time.perf_counter())
                continue
            # A bad or missing clip fails this job only.
            request, render_request = wait.call(f"fetch the clip of job {job_id}", lambda: prepare(rt, record),
                                                cancel_check(rt, job_id))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - recorded per job
            outcome.settle_into(rt, job_id, exc, retry)
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
    progress = Progress(rt, ids, on_cancel=canceled.add)
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
                outcome.canceled(rt, job_id)
                return None
            if isinstance(result, Exception):
                raise result
            store_result(rt, job_id, member.record.attempts, member.request, result, wait,
                         {"render": rendered - started}, started)  # fmt: skip
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
            outcome.settle_into(rt, member.job_id, exc, retry)
    return retry
