"""A worker's graceful stop: the running job finishes within ``AUK_STOP_GRACE``, else goes back to the queue.

SIGTERM (Kubernetes, ``make run``, ``docker stop``) and a first Ctrl-C are Celery's warm shutdown: the consumer
stops taking messages and the pool waits for the running task. The render runs in the pool's thread, not in the
thread that handles the signal (``worker.py``), so the stop is watched while it renders:

- **Finished within the grace**: the job ends as usual (stored, recorded, acknowledged) and the worker exits.
  Log: ``worker W: job J finished within the stop grace (3.2 s of 30 s); stopping``.
- **Still rendering when the grace is over**: the job is *released*. Its render stops at its next step (or its
  next storage try), its record goes back to ``queued`` under no holder (``JobStore.requeue``: no kill counted,
  so an operator's stop never brings a job nearer ``worker_crashed``), and it is sent to its variant's recovery
  queue, which every worker polls first; the task then returns and its message is acknowledged. Log:
  ``worker W: stop grace of 30 s over with job J rendering; releasing it to the queue (an operator stop, not a
  crash)`` and ``job J: released back to auk.base.recovery``.
- **A render that does not reach a step within ``RELEASE_S`` of its release** (one long GPU call): the records are
  released from the watching thread and the process exits at once; the unacknowledged message comes back too and
  meets a record that is queued or held by the worker that took the released copy (the usual fencing).

A cold shutdown (a second Ctrl-C, SIGQUIT) releases at once. The supervisor's wait before SIGKILL (Kubernetes'
``terminationGracePeriodSeconds``, ``make run``'s) must exceed the grace plus ``RELEASE_S``; deploy/ and
``auk_dev/supervisor.py`` follow that rule.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import redis

from auk_worker.errors import InfraError
from auk_worker.service.queues.celery_app import RECOVERY, RENDER_TASK, queue_name
from auk_worker.service.records.store import JobStore

log = logging.getLogger(__name__)

RELEASE_S = 15.0  # after the grace, how long a render has to reach a step before the process leaves anyway
EXIT_RELEASED = 0  # a stop is an operator's wish, not a failure


class OperatorStop(Exception):
    """Raised on the render thread at its next step once the stop grace is over: the job goes back to the queue."""


class GracefulStop:
    """Watches one worker's stop. ``task_started``/``task_ended`` come from the render thread, ``requested`` from
    the thread that handled the signal, ``check`` from the render's step callback and storage waits."""

    def __init__(self, store: JobStore, holder: str, variant: str, send: Callable[[str, list, str], None],
                 grace_s: float, worker_id: str, exit_process: Callable[[int], None] = os._exit,
                 release_s: float = RELEASE_S) -> None:  # fmt: skip
        self.store = store
        self.holder = holder
        self.recovery = queue_name(variant, RECOVERY)
        self.send = send
        self.grace_s = grace_s
        self.worker_id = worker_id
        self.exit_process = exit_process
        self.release_s = release_s
        self.stopping = threading.Event()  # a stop was asked for
        self.expired = threading.Event()  # the grace is over: the running job is released at its next step
        self._lock = threading.Lock()
        self._jobs: list[str] = []  # the running task's jobs
        self._task_started: float | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._grace_left: float | None = None  # the grace of a stop asked for while no job ran (a job may yet start)

    # ------------------------------------------------------------------------------------------ render thread

    def task_started(self, job_ids: list[str]) -> None:
        """The jobs the running tasks hold now (every job of both tasks with store-behind: ``board.py``)."""
        with self._lock:
            self._jobs = list(job_ids)
            if self._idle.is_set():  # the first task since idle; a second one joining keeps the first's start
                self._task_started = time.monotonic()
            self._idle.clear()
            grace, self._grace_left = self._grace_left, None
        if grace is not None:  # the stop came as this task was handed over: it is watched like any other
            threading.Thread(target=self._watch, args=(grace,), name="graceful-stop", daemon=True).start()

    def task_ended(self) -> None:
        with self._lock:
            self._jobs = []
            self._task_started = None
            self._idle.set()

    def check(self) -> None:
        """Raise ``OperatorStop`` once the grace is over (the render thread's steps and storage waits call this)."""
        if self.expired.is_set():
            raise OperatorStop(f"the worker was stopped and its grace of {self.grace_s:g} s is over")

    def release(self, job_id: str) -> bool:
        """The job back to ``queued`` (no kill) and sent to the recovery queue, if this worker still holds it."""
        try:
            outcome = self.store.requeue(job_id, self.holder)
            if outcome.record is None:
                log.info("job %s: stopped by an operator stop; no longer held by this worker, nothing to release",
                         job_id)  # fmt: skip
                return False
            self.send(RENDER_TASK, [job_id], self.recovery)
        except (InfraError, redis.RedisError) as exc:  # its message still comes back, after the visibility timeout
            log.warning("job %s: not released (%s); it comes back when its message does", job_id, exc)
            return False
        log.info("job %s: released back to %s by an operator stop (not counted as a crash)", job_id, self.recovery)
        return True

    # ------------------------------------------------------------------------------------------ the stop

    def requested(self, how: str = "Warm") -> None:
        """Celery's ``worker_shutting_down`` (in the signal handler: quick, the watching is done by a thread)."""
        if self.stopping.is_set():
            if how == "Cold":
                self.expired.set()
            return
        self.stopping.set()
        grace = 0.0 if how == "Cold" else self.grace_s
        threading.Thread(target=self._watch, args=(grace,), name="graceful-stop", daemon=True).start()

    def _watch(self, grace: float) -> None:
        with self._lock:
            jobs, started = list(self._jobs), self._task_started
            if not jobs:
                self._grace_left = grace
        if not jobs:
            log.info("worker %s: stop requested with no job running; stopping now", self.worker_id)
            return
        what = ",".join(jobs)
        log.info("worker %s: stop requested; job %s may finish within the stop grace of %g s, else it goes back "
                 "to the queue", self.worker_id, what, grace)  # fmt: skip
        if self._idle.wait(grace):
            took = time.monotonic() - started if started is not None else 0.0
            log.info("worker %s: job %s finished within the stop grace (%.1f s of %g s); stopping", self.worker_id,
                     what, took, grace)  # fmt: skip
            return
        log.warning("worker %s: stop grace of %g s over with job %s rendering; releasing it to the queue (an "
                    "operator stop, not a crash)", self.worker_id, grace, what)  # fmt: skip
        self.expired.set()
        if self._idle.wait(self.release_s):
            log.info("worker %s: job %s released; stopping", self.worker_id, what)
            return
        with self._lock:
            jobs = list(self._jobs)
        log.warning("worker %s: job %s did not reach a step within %g s of its release; releasing its record and "
                    "exiting now", self.worker_id, ",".join(jobs), self.release_s)  # fmt: skip
        for job_id in jobs:
            self.release(job_id)
        logging.shutdown()
        self.exit_process(EXIT_RELEASED)
