"""The worker's health signal: a heartbeat hash in Redis, written by a daemon thread.

A solo Celery worker renders in its main thread, so it cannot answer ``inspect ping`` while busy; a heartbeat
thread keeps writing ``auk:worker:{hostname}`` = {state, variant, ts, job_id, pid, error} every ``interval``
seconds with a TTL, so a worker that dies simply disappears. States:

- ``starting``: loading the pipeline;   ``ready``: waiting for jobs;   ``busy``: rendering ``job_id``;
- ``failed``: the pipeline did not load (``error`` says why); the process then exits non-zero.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import redis

log = logging.getLogger(__name__)

STATES = ("starting", "ready", "busy", "failed")
FAILED_TTL_S = 300  # a failed worker's last word stays readable for a while after the process is gone


def heartbeat_key(hostname: str, namespace: str = "auk") -> str:
    return f"{namespace}:worker:{hostname}"


class Heartbeat:
    """Publishes one worker's state; ``set`` writes at once, the thread refreshes it until ``stop``."""

    def __init__(
        self,
        client: redis.Redis,
        hostname: str,
        variant: str,
        *,
        namespace: str = "auk",
        interval_s: float = 2.0,
        ttl_s: int = 10,
    ) -> None:
        self.client = client
        self.hostname = hostname
        self.key = heartbeat_key(hostname, namespace)
        self.index = f"{namespace}:workers"
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._fields: dict[str, str] = {"state": "starting", "variant": variant, "job_id": "", "error": "",
                                        "pid": str(os.getpid()), "hostname": hostname}  # fmt: skip
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a state change: write now, off the caller's thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> str:
        return self._fields["state"]

    def start(self) -> Heartbeat:
        self._write()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.hostname}", daemon=True)
        self._thread.start()
        return self

    def set(self, state: str, job_id: str | None = None, error: str | None = None) -> None:
        """Change the state; the heartbeat thread writes it at once (the render path never waits on Redis)."""
        if state not in STATES:
            raise ValueError(f"unknown worker state {state!r}")
        with self._lock:
            self._fields.update(state=state, job_id=job_id or "", error=error or "")
        if self._thread is None:
            self._write()
        else:
            self._wake.set()

    def set_variant(self, variant: str) -> None:
        with self._lock:
            self._fields["variant"] = variant
        self._wake.set()

    def stop(self, remove: bool = True) -> None:
        """Stop the thread; remove the key unless the last state should stay visible (``failed``)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)
            self._thread = None
        if not remove:
            self._write()
        else:
            try:
                self.client.delete(self.key)
                self.client.srem(self.index, self.hostname)
            except redis.RedisError as exc:
                log.warning("worker %s: could not remove heartbeat: %s", self.hostname, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self._write()

    def _write(self) -> None:
        with self._lock:
            fields = {**self._fields, "ts": f"{time.time():.3f}"}
        ttl = FAILED_TTL_S if fields["state"] == "failed" else self.ttl_s
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(self.key, mapping=fields)
            pipe.expire(self.key, ttl)
            pipe.sadd(self.index, self.hostname)
            pipe.execute()
        except redis.RedisError as exc:  # the heartbeat must never take the worker down
            log.warning("worker %s: heartbeat not written: %s", self.hostname, exc)


def read_heartbeats(client: redis.Redis, namespace: str = "auk") -> list[dict[str, Any]]:
    """Every live worker's heartbeat (the API's readiness check); stale hostnames are pruned from the index."""
    index = f"{namespace}:workers"
    hostnames = sorted(client.smembers(index))
    if not hostnames:
        return []
    pipe = client.pipeline(transaction=False)
    for hostname in hostnames:
        pipe.hgetall(heartbeat_key(hostname, namespace))
    beats = []
    for hostname, beat in zip(hostnames, pipe.execute()):
        if beat:
            beats.append(beat)
        else:
            client.srem(index, hostname)
    return beats
