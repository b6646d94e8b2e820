"""Queue overhead: what the service adds around a render, measured on loopback with the model taken out.

``python -m bench.queue_overhead [--jobs N]`` starts a private redis-server, a SeaweedFS S3 server and one worker
with ``AUK_PIPELINE=instant`` (silence of the right length, no model), then:

1. latency: N jobs one at a time, each timed from just before its record is written (the API's first step) to the
   moment the record says ``succeeded`` (WAV encoded and uploaded, record finished, message acknowledged next);
2. throughput: N jobs enqueued at once, timed until the last one succeeds.

It writes ``bench/results/queue_overhead-<date>.json`` with the torch version, the commit and the host. Target: a
median under 10 ms a job. Run it from the repository root (the process managers are ``auk_dev.local``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from auk_worker.service.queues.celery_app import RENDER_TASK, make_celery, queue_name
from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.records.store import JobStore
from auk_worker.service.connect.settings import Settings
from auk_dev.local import REPO, RedisServer, S3Server, WorkerProcess, connection_env
from bench.common import commit

log = logging.getLogger("bench.queue_overhead")

TARGET_MS = 10.0
OWNER = "bench0000000000"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "not installed"


class Bench:
    """Enqueues as the API does and waits for each record's ``succeeded`` without polling: the private Redis
    publishes keyspace events for job hashes, so the waiting client sleeps in a socket read instead of taking CPU
    from the worker, Redis and SeaweedFS it is timing (the machine has 2 cores)."""

    def __init__(self, settings: Settings, store: JobStore, gen_seconds: float, steps: int) -> None:
        self.settings = settings
        self.store = store
        self.celery = make_celery(settings)
        self.body = {"instruction": "Benchmark line.", "audio": None, "gen_seconds": gen_seconds, "variant": "base",
                     "num_inference_steps": steps, "output_format": "pcm16", "priority": "interactive"}  # fmt: skip
        self.queue = queue_name("base", "interactive")
        store.redis.config_set("notify-keyspace-events", "Kh")  # hash writes, keyspace channel
        db = store.redis.connection_pool.connection_kwargs.get("db", 0)
        self.events = store.redis.pubsub(ignore_subscribe_messages=True)
        self.events.psubscribe(f"__keyspace@{db}__:{store.job_key('*')}")
        self.events.get_message(timeout=1.0)  # the subscription's confirmation

    def enqueue(self) -> str:
        record = JobRecord.new(OWNER, self.body, queue=self.queue)
        self.store.create(record)
        self.celery.send_task(RENDER_TASK, args=[record.id], queue=self.queue)
        return record.id

    def wait(self, job_id: str, timeout: float = 30.0) -> None:
        key = self.store.job_key(job_id)
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            status = self.store.redis.hget(key, "status")
            if status == JobStatus.SUCCEEDED.value:
                return
            if status in (JobStatus.FAILED.value, JobStatus.CANCELED.value):
                raise RuntimeError(f"job {job_id} ended {status}: {self.store.get(job_id).error}")
            # Sleep until some job record is written again (a write that lands between the read above and this
            # call is still queued on the subscription, so none is missed).
            self.events.get_message(timeout=max(0.0, deadline - time.perf_counter()))
        raise RuntimeError(f"job {job_id} did not finish within {timeout} s")

    def one(self) -> float:
        started = time.perf_counter()
        self.wait(self.enqueue())
        return (time.perf_counter() - started) * 1000

    def burst(self, n: int) -> float:
        started = time.perf_counter()
        ids = [self.enqueue() for _ in range(n)]
        for job_id in ids:
            self.wait(job_id, timeout=120)
        return time.perf_counter() - started


def run(jobs: int, warmup: int, gen_seconds: float, steps: int, out_dir: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="auk-bench-") as tmp:
        work = Path(tmp)
        redis_server = RedisServer(work / "redis").start()
        s3 = S3Server(work / "s3").start()
        worker = None
        try:
            env = connection_env(redis_server, s3, S3_BUCKET="auk-bench", VARIANT="base", PIPELINE="instant")
            settings = Settings.from_env(env)
            worker = WorkerProcess(env, "bench-worker", work).start()
            client = redis_server.client()
            worker.wait_state(client, "ready", timeout=120)
            bench = Bench(settings, JobStore(client), gen_seconds, steps)
            for _ in range(warmup):
                bench.one()
            latencies = [bench.one() for _ in range(jobs)]
            burst_s = bench.burst(jobs)
        finally:
            if worker is not None:
                worker.terminate(timeout=30)
            s3.stop()
            redis_server.stop()

    median = statistics.median(latencies)
    result = {
        "benchmark": "queue_overhead",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "torch": _torch_version(),
        "python": platform.python_version(),
        "host": {"name": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "setup": {"pipeline": "instant", "broker": "redis-server (loopback)", "storage": "SeaweedFS S3 (loopback)",
                  "worker": "1 solo process", "gen_seconds": gen_seconds, "steps": steps,
                  "client": "waits on Redis keyspace events (no polling)",
                  "wav_bytes": int(gen_seconds * 24_000) * 2 + 44},  # fmt: skip
        "jobs": jobs,
        "latency_ms": {
            "median": round(median, 3),
            "p90": round(_percentile(latencies, 0.9), 3),
            "mean": round(statistics.fmean(latencies), 3),
            "min": round(min(latencies), 3),
            "max": round(max(latencies), 3),
        },
        "burst": {"jobs": jobs, "seconds": round(burst_s, 3), "jobs_per_s": round(jobs / burst_s, 1)},
        "target_ms": TARGET_MS,
        "meets_target": median < TARGET_MS,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"queue_overhead-{datetime.now(timezone.utc):%Y-%m-%d}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    result["path"] = str(path)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs per phase (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed jobs first (default 20)")
    parser.add_argument("--gen-seconds", type=float, default=1.0, help="length of each rendered clip (default 1 s)")
    parser.add_argument("--steps", type=int, default=32, help="steps, one progress write each (default 32, Base)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="results directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = run(args.jobs, args.warmup, args.gen_seconds, args.steps, args.out)
    lat = result["latency_ms"]
    print(
        f"queue overhead over {result['jobs']} jobs: median {lat['median']:.2f} ms, p90 {lat['p90']:.2f} ms "
        f"(target {TARGET_MS:g} ms: {'met' if result['meets_target'] else 'MISSED'}); "
        f"burst {result['burst']['jobs_per_s']} jobs/s; written to {result['path']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
