"""Store-behind: a bulk worker uploads and records one group's results while the pipeline renders the next group.

Why. A group task used to run prepare, render, store in turn, and the next task started only when the last upload
and record were done: the GPU waited for the network every group (``bench/RESULTS.md`` has the figures). With
store-behind the worker runs two tasks at once (Celery's threads pool, concurrency 2, prefetch 1 a
slot) and the pipeline takes one render at a time (``OneRender``): while task A stores, task B prepares and renders.
Each task still acknowledges its message only after its own jobs are recorded, so a worker killed at any moment
leaves both messages in its unacknowledged set, restored as before (``queues/fetch.py``), and every record stays
fenced by its holder.

``AUK_STORE_BEHIND``: ``auto`` (default) turns it on for a worker whose deploy config renders groups (stage 1
``max_num_seqs`` above 1, ``config/auk-bulk.yaml``); ``on`` or ``off`` decide outright. A one-job worker keeps one
task at a time, so that an interactive job is never held behind a render while another worker is free.

``TaskBoard`` keeps what the running tasks hold: the heartbeat lists every job of every running task (the reaper
takes a running job whose live holder does not list it as let go) and the graceful stop watches them all. A job
is held by one task at a time: a second delivery of a job the other task is working on (the reaper's re-send of a
dead worker's job beside its restored message) is dropped, because both tasks are the same holder to the record's
fencing, and the task that holds the job settles its fate (an end, a retry, a release).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from auk_worker.types import RenderRequest, RenderResult


def tasks_at_once(store_behind: str, group_size: int) -> int:
    """How many tasks a worker runs at once: 2 with store-behind, else 1."""
    on = store_behind == "on" or (store_behind == "auto" and group_size > 1)
    return 2 if on else 1


class TaskBoard:
    """The running tasks' jobs. ``show(jobs)`` is called, under the board's lock, with every job still held after
    each change (an empty list once no task runs), so that the heartbeat and the stop watch see them in order."""

    def __init__(self, show: Callable[[list[str]], None]) -> None:
        self._show = show
        self._lock = threading.Lock()
        self._tasks: dict[int, list[str]] = {}
        self._tokens = itertools.count()

    def started(self, job_ids: list[str]) -> tuple[int, list[str]]:
        """A task begins: returns its token and the jobs it takes, those no other running task holds."""
        with self._lock:
            held = set(self._held())
            token = next(self._tokens)
            mine = [job_id for job_id in job_ids if job_id not in held]
            self._tasks[token] = mine
            self._show(self._held())
        return token, mine

    def ended(self, token: int) -> None:
        with self._lock:
            self._tasks.pop(token, None)
            self._show(self._held())

    def held(self) -> list[str]:
        with self._lock:
            return self._held()

    def _held(self) -> list[str]:
        return [job_id for jobs in self._tasks.values() for job_id in jobs]


class OneRender:
    """The pipeline, taken by one render at a time: ``render`` and ``render_batch`` hold a lock; everything else is
    the pipeline's own. ``busy_s`` adds up the seconds renders held it (the GPU's share of the worker's time), and
    ``on_turn(seconds)`` hears of each turn (the worker's ``auk_worker_render_busy_seconds_total``)."""

    def __init__(self, pipeline: Any, on_turn: Callable[[float], None] | None = None) -> None:
        self._pipeline = pipeline
        self._lock = threading.Lock()
        self._on_turn = on_turn
        self.busy_s = 0.0

    def render(self, request: RenderRequest, on_step: Any = None) -> RenderResult:
        with self._turn():
            return self._pipeline.render(request, on_step=on_step)

    def render_batch(self, requests: list[RenderRequest], on_step: Any = None) -> list:
        with self._turn():
            return self._pipeline.render_batch(requests, on_step=on_step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    @contextmanager
    def _turn(self) -> Iterator[None]:
        with self._lock:
            started = time.perf_counter()
            try:
                yield
            finally:
                seconds = time.perf_counter() - started
                self.busy_s += seconds
                if self._on_turn is not None:
                    self._on_turn(seconds)
