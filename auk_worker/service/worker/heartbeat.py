"""The worker's health signal: a heartbeat hash in Redis, written by a daemon thread.

A solo Celery worker renders in its main thread, so it cannot answer ``inspect ping`` while busy; a heartbeat
thread keeps writing ``auk:worker:{worker id}`` = {state, variant, ts, job_id, id, instance, host, pid, error}
every ``interval`` seconds with a TTL, so a worker that dies, or cannot reach Redis, simply disappears. States:

- ``starting``: loading the pipeline;   ``ready``: consuming, waiting for jobs;   ``busy``: rendering ``job_id``
  (a comma-separated list for a group);
- ``stalled``: idle but not consuming: its Celery consumer has not asked the broker for work for ``stall_after_s``
  (the connection is being re-established, or the consumer is wedged); ``error`` says since when;
- ``failed``: the pipeline did not load, or the consumer never came back (``error`` says why); the process exits
  non-zero.

``ready`` is what the consumer does, not what the task code last said: the consumer's event loop calls
``consumer_tick`` every second with whether it can take a message (``main.py``), and an idle worker whose ticks
stopped, or say it cannot, is published as ``stalled``. A worker that stays stalled for ``stall_timeout_s`` while
Redis answers its heartbeat cannot recover by itself: ``on_stuck`` is called (the worker exits non-zero so that its
supervisor starts it again). While Redis itself is away nothing is written and nothing exits: the consumer retries
the connection, and restarting would not bring Redis back.

The job ids stay inside Redis for the workers' own use (``records/scripts.py``: ``holder_state`` reads them to tell a
live holder from one that let go); ``public_view`` is what an unauthenticated reader such as ``/readyz`` gets.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import redis

from auk_worker.service.records.workers import STATES, heartbeat_key

log = logging.getLogger(__name__)

FAILED_TTL_S = 300  # a failed worker's last word stays readable for a while after the process is gone

# One write of the heartbeat, one command (a state change comes with every job, twice). KEYS: the hash, the index.
# ARGV: ttl, worker id, then field, value pairs.
_WRITE = """
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""


class Heartbeat:
    """Publishes one worker's state; ``set`` writes at once, the thread refreshes it until ``stop``."""

    def __init__(
        self,
        client: redis.Redis,
        worker_id: str,
        variant: str,
        *,
        instance: str = "",
        namespace: str = "auk",
        interval_s: float = 2.0,
        ttl_s: int = 10,
        watch_consumer: bool = False,
        stall_after_s: float = 5.0,
        stall_timeout_s: float | None = None,
        on_stuck: Callable[[str], None] | None = None,
        on_beat: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.instance = instance
        self.key = heartbeat_key(worker_id, namespace)
        self.index = f"{namespace}:workers"
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.watch_consumer = watch_consumer  # judge "ready" by the consumer's ticks (a Celery worker)
        self.stall_after_s = stall_after_s
        self.stall_timeout_s = stall_timeout_s
        self.on_stuck = on_stuck
        self.on_beat = on_beat  # a chore run in this thread after every write (the reaper)
        self._fields: dict[str, str] = {"state": "starting", "variant": variant, "job_id": "", "error": "",
                                        "id": worker_id, "instance": instance, "host": socket.gethostname(),
                                        "pid": str(os.getpid())}  # fmt: skip
        self._consuming_at: float | None = None  # monotonic: the last tick that could consume, or the last set()
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a state change: write now, off the caller's thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._script = client.register_script(_WRITE)
        self._beat_at = 0.0  # monotonic: the last run of ``on_beat``

    @property
    def state(self) -> str:
        return self._fields["state"]

    @property
    def holder(self) -> str:
        """What a job record names as this attempt's holder."""
        return f"{self.worker_id}/{self.instance}"

    def start(self) -> Heartbeat:
        self._write()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.worker_id}", daemon=True)
        self._thread.start()
        return self

    def set(self, state: str, job_id: str | None = None, error: str | None = None) -> None:
        """Change the state; the heartbeat thread writes it at once (the render path never waits on Redis)."""
        if state not in STATES:
            raise ValueError(f"unknown worker state {state!r}")
        with self._lock:
            self._fields.update(state=state, job_id=job_id or "", error=error or "")
            if self.watch_consumer:  # a new state (a job just ended: its loop did not tick while it ran)
                self._consuming_at = time.monotonic()
        if self._thread is None:
            self._write()
        else:
            self._wake.set()

    def set_variant(self, variant: str) -> None:
        with self._lock:
            self._fields["variant"] = variant
        self._wake.set()

    def consumer_tick(self, consuming: bool) -> None:
        """Called by the consumer's event loop: it ran, and could (or could not) take a message."""
        if consuming:
            with self._lock:
                self._consuming_at = time.monotonic()

    def stop(self, remove: bool = True) -> None:
        """Stop the thread; remove the key unless the last state should stay visible (``failed``)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 1)
            self._thread = None
        if not remove:
            self._write()
        else:
            try:
                self.client.delete(self.key)
                self.client.srem(self.index, self.worker_id)
            except redis.RedisError as exc:
                log.warning("worker %s: could not remove heartbeat: %s", self.worker_id, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            # The chore runs every interval, not after each state change's write (two a job).
            if self._write() and self.on_beat is not None and time.monotonic() - self._beat_at >= self.interval_s:
                self._beat_at = time.monotonic()
                try:
                    self.on_beat()
                except Exception:  # noqa: BLE001 - a chore's failure must not stop the heartbeat
                    log.exception("worker %s: heartbeat chore failed", self.worker_id)

    def _snapshot(self) -> tuple[dict[str, str], float]:
        """The fields to publish and how long the consumer has not been consuming (0 when it is, or unwatched)."""
        with self._lock:
            fields = {**self._fields, "ts": f"{time.time():.3f}"}
            idle = 0.0 if self._consuming_at is None else time.monotonic() - self._consuming_at
        if fields["state"] != "ready" or idle < self.stall_after_s:
            return fields, 0.0
        fields.update(state="stalled", error=f"not consuming for {idle:.0f} s")
        return fields, idle

    def _write(self) -> bool:
        """Publish the state; True when Redis took it."""
        fields, stalled_for = self._snapshot()
        ttl = FAILED_TTL_S if fields["state"] == "failed" else self.ttl_s
        try:
            self._script(keys=[self.key, self.index],
                         args=[ttl, self.worker_id, *(item for pair in fields.items() for item in pair)])  # fmt: skip
        except redis.RedisError as exc:  # the heartbeat must never take the worker down
            log.warning("worker %s: heartbeat not written: %s", self.worker_id, exc)
            return False
        if stalled_for >= self.stall_after_s:
            log.warning("worker %s: %s", self.worker_id, fields["error"])
        if self.stall_timeout_s is not None and stalled_for > self.stall_timeout_s and self.on_stuck is not None:
            self.on_stuck(f"the consumer has not consumed for {stalled_for:.0f} s while Redis answers")
        return True
