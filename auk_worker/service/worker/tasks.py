"""The Celery binding of the render tasks, and the process boundary: ``auk.render`` runs one job
(``single.render_job``), ``auk.render_group`` a bulk group (``group.render_group``); every exception that reaches
here is settled on the job's record (``outcome.settle``), and an infrastructure error lets go of the record and has
Celery send the task again after a backoff (``_retry_or_fail``).

- A record found ``running`` under a dead holder means that holder died with it (``kills`` + 1, in ``start`` or
  in the reaper's release); at ``AUK_MAX_KILLS`` the job fails with ``worker_crashed`` instead of taking a further
  worker down. A record a live holder holds is not started again (a duplicate delivery, dropped).
- Every write of an attempt names its holder (``RenderRuntime.holder``), so an attempt whose job was taken from it
  (``recovery.py``) stops at its next step and records nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from celery import Celery, Task

from auk_worker.errors import AuKError, InfraError
from auk_worker.service.connect.logs import job_context
from auk_worker.service.queues.celery_app import RENDER_TASK
from auk_worker.service.queues.grouping import RENDER_GROUP_TASK
from auk_worker.service.worker import outcome
from auk_worker.service.worker.group import render_group
from auk_worker.service.worker.runtime import RenderRuntime
from auk_worker.service.worker.single import render_job

log = logging.getLogger(__name__)


def register(app: Celery, runtime: RenderRuntime) -> tuple[Task, Task]:
    """Bind ``auk.render`` and ``auk.render_group`` to ``app``, running every job in ``runtime``."""
    settings = runtime.settings

    @app.task(name=RENDER_TASK, bind=True, acks_late=True, ignore_result=True, max_retries=settings.retry_max)
    def render(self: Task, job_id: str) -> None:
        started = time.perf_counter()
        token, mine = runtime.board.started([job_id])
        try:
            if not mine:
                _dropped(runtime, [job_id])
                return
            with job_context(job_id):
                render_job(runtime, job_id)
        except Exception as exc:  # noqa: BLE001 - the process boundary: every job ends with a record
            with job_context(job_id):
                if outcome.settle(runtime, job_id, exc):
                    _retry_or_fail(self, runtime, {job_id: exc}, lambda ids: [ids[0]])
        finally:
            runtime.board.ended(token)
            log.debug("job %s: task took %.1f ms", job_id, (time.perf_counter() - started) * 1000)
            runtime.last_task_end = time.perf_counter()

    @app.task(name=RENDER_GROUP_TASK, bind=True, acks_late=True, ignore_result=True, max_retries=settings.retry_max)
    def render_group_task(self: Task, job_ids: list[str]) -> None:
        started = time.perf_counter()
        if runtime.last_task_end is not None:  # Celery's share: ack, fetch and hand over the next message
            log.info("group of %d: %.1f ms since the previous task returned", len(job_ids),
                     (started - runtime.last_task_end) * 1000)  # fmt: skip
        token, mine = runtime.board.started(job_ids)
        _dropped(runtime, [job_id for job_id in job_ids if job_id not in mine])
        try:
            retry = render_group(runtime, mine) if mine else {}
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # Redis went away between jobs: all again
            retry = {job_id: exc for job_id in mine}
        finally:
            runtime.board.ended(token)
        log.debug("group of %d: task took %.1f ms", len(job_ids), (time.perf_counter() - started) * 1000)
        try:
            if retry:  # only the jobs an infrastructure error stopped, as a smaller group; finished ones stay done
                _retry_or_fail(self, runtime, retry, lambda ids: [ids])
        finally:
            runtime.last_task_end = time.perf_counter()

    return render, render_group_task


def _dropped(rt: RenderRuntime, job_ids: list[str]) -> None:
    """Deliveries of jobs this worker's other task is working on: that task settles them (``board.py``)."""
    for job_id in job_ids:
        log.info("job %s: this worker's other task holds it; this delivery is dropped", job_id)
        rt.metrics.outcome("skipped")


def _retry_or_fail(task: Task, rt: RenderRuntime, stopped: dict[str, Exception], args_for: Any) -> None:
    """Let go of each stopped job's record and have Celery send the task again (``args_for(job ids)``) after a
    backoff; fail the jobs once retries run out."""
    retries = task.request.retries
    give_up = retries >= rt.settings.retry_max
    for job_id, exc in stopped.items():
        message = exc.message if isinstance(exc, AuKError) else f"Redis unreachable: {exc}"
        try:
            if give_up:
                outcome.fail(rt, job_id, "infrastructure", f"gave up after {retries + 1} attempts: {message}")
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
