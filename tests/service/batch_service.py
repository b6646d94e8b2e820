"""One API process (and workers on demand) for the batch, webhook and page tests: the real API over HTTP on a
loopback port, the session's redis-server and SeaweedFS, instant-pipeline workers as real processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from redis import Redis

from tests.service.conftest import BUCKET
from tests.service.harness import ApiProcess, RedisServer, S3Server, WorkerProcess, connection_env, free_port

KEY_A, KEY_B, KEY_C = "key-alpha-batches-0001", "key-bravo-batches-0002", "key-charlie-batches-0003"
TERMINAL = ("succeeded", "failed", "canceled")


@dataclass
class BatchService:
    api: ApiProcess
    env: dict[str, str]
    redis: Redis
    s3: S3Server
    logdir: Path
    prefix: str
    workers: list[WorkerProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.api.url

    def client(self, key: str | None = KEY_A) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def start_worker(self, hostname: str, **env: str) -> WorkerProcess:
        worker = WorkerProcess({**self.env, **env}, hostname, self.logdir).start()
        self.workers.append(worker)
        worker.wait_state(self.redis, "ready", timeout=120)
        return worker

    def stop_workers(self) -> None:
        while self.workers:
            self.workers.pop().terminate(timeout=20)

    def wait(self, what: str, check: Callable[[], object], timeout: float = 60.0) -> object:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                tails = "\n".join(w.log_tail(2000) for w in self.workers)
                raise AssertionError(f"{what}: not within {timeout:g} s\n{self.api.log_tail(3000)}\n{tails}")
            time.sleep(0.1)

    def wait_job(self, job_id: str, key: str = KEY_A, timeout: float = 60.0) -> dict:
        with self.client(key) as http:
            return self.wait(f"job {job_id} ended", lambda: (job := http.get(f"/v1/jobs/{job_id}").json())["status"]
                             in TERMINAL and job, timeout)  # fmt: skip

    def wait_batch(self, batch_id: str, key: str = KEY_A, timeout: float = 90.0) -> dict:
        with self.client(key) as http:
            return self.wait(f"batch {batch_id} done", lambda: (b := http.get(f"/v1/batches/{batch_id}").json())
                             ["status"] == "done" and b, timeout)  # fmt: skip


@contextmanager
def batch_service(redis_server: RedisServer, s3_server: S3Server, logdir: Path, prefix: str,
                  **api_settings: str) -> Iterator[BatchService]:
    """The API with ``api_settings`` (``AUK_`` names without the prefix) over a flushed Redis; workers started by
    the tests are stopped at the end."""
    env = connection_env(redis_server, s3_server, S3_BUCKET=BUCKET, S3_PREFIX=prefix, VARIANT="base",
                         PIPELINE="instant", VISIBILITY_TIMEOUT="60", RETRY_BACKOFF="0.5")  # fmt: skip
    client = redis_server.client()
    client.flushdb()
    # AUK_VARIANT_CHECK=off: some tests queue a Flash job while only base workers run (it waits, or fails later).
    api_env = {**env, "AUK_API_KEYS": f"{KEY_A},{KEY_B},{KEY_C}", "AUK_VARIANT_CHECK": "off",
               **{f"AUK_{name}": value for name, value in api_settings.items()}}  # fmt: skip
    api = ApiProcess(api_env, free_port(), logdir / "api.log").start()
    service = BatchService(api, env, client, s3_server, logdir, prefix)
    try:
        yield service
    finally:
        service.stop_workers()
        api.stop()
        client.close()
