"""What a worker process loads once and every job uses (``RenderRuntime``), the pipeline it calls (``Pipeline``),
and the two waits every step of a job may need: for the current Redis master, and for storage with a cancel check.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from auk_worker.deploy import DeployConfig
from auk_worker.errors import AuKError, Canceled
from auk_worker.service.connect.redis import RedisFailedOver, ReplicationBarrier
from auk_worker.service.connect.settings import Settings
from auk_worker.service.connect.storage import Storage
from auk_worker.service.delivery.notify import Notifier
from auk_worker.service.delivery.replies import ReplySender
from auk_worker.service.records.store import JobStore
from auk_worker.service.worker.board import TaskBoard
from auk_worker.service.worker.heartbeat import Heartbeat
from auk_worker.service.worker.metrics import WorkerMetrics
from auk_worker.service.worker.stopping import GracefulStop
from auk_worker.types import RenderRequest, RenderResult
from auk_worker.voice_cache import VoiceCache

log = logging.getLogger(__name__)


class Pipeline(Protocol):
    """What the worker calls: the real ``AuKPipeline``, the instant fake or the random release-size one."""

    variant: str
    deploy: DeployConfig  # what it was loaded with: defaults, group size (stage 1 max_num_seqs)
    model_hashes: dict[str, str]
    startup: dict[str, float]  # seconds: "load", "warm_up"
    voice_cache: VoiceCache | None  # prepared reference clips by content key; the worker sets it

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
    replies: ReplySender | None = None  # pushes a speech job's audio to the waiting API (delivery/replies.py)
    notifier: Notifier | None = None  # enqueues webhooks of ended jobs and batches (delivery/notify.py)
    voice_cache: VoiceCache | None = None  # decoded clips by content (the pipeline keeps its pieces in the same one)
    holder: str = field(default_factory=lambda: f"{socket.gethostname()}/{os.getpid()}")  # "<worker id>/<instance>"
    last_task_end: float | None = None  # perf_counter when the previous task returned (the idle time between)
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)  # served on AUK_METRICS_PORT when set
    stop: GracefulStop | None = None  # the worker's stop: past its grace, a render stops and its job is released
    board: TaskBoard = field(init=False)  # the running tasks' jobs, shown to the heartbeat and the stop watch

    def __post_init__(self) -> None:
        self.board = TaskBoard(self._show_held)

    def _show_held(self, jobs: list[str]) -> None:
        """The heartbeat and the stop watch see every job the running tasks hold (``TaskBoard``)."""
        if self.stop is not None:
            if jobs:
                self.stop.task_started(jobs)
            else:
                self.stop.task_ended()
        if self.heartbeat is not None:
            if jobs:
                self.heartbeat.set("busy", ",".join(jobs))
            else:
                self.heartbeat.set("ready")


def on_current_master(rt: RenderRuntime, what: str, write: Callable[[], Any]) -> Any:
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


def cancel_check(rt: RenderRuntime, job_id: str) -> Any:
    """Run between storage tries: stop waiting (``Canceled``) once the job's record says canceled. Redis being
    unreachable too is no reason to drop what the worker holds, so it keeps waiting."""

    def check() -> None:
        if rt.stop is not None:
            rt.stop.check()
        try:
            canceled = rt.store.is_canceled(job_id)
        except redis.RedisError as exc:
            log.warning("job %s: cancel not checked while waiting for storage (%s)", job_id, exc)
            return
        if canceled:
            raise Canceled(f"job {job_id} was canceled while waiting for storage")

    return check
