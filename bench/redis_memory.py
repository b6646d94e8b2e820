"""Redis memory per finished job, and what retention gives back: ``python -m bench.redis_memory [--jobs N]``.

A private ``redis-server`` (the Debian package, persistence off); N jobs go through the real ``JobStore`` as the API
and a worker drive it: created with an idempotency key (a realistic instruct-TTS request, as ``api/submit.py``
prepares it), started, finished with a result as ``worker/outcome.py`` records it (model hashes, timings). Reported:
``INFO used_memory`` before and after divided by N, ``MEMORY USAGE`` of one record, one idempotency key and the
owner index per entry; then, with a retention of 1 s, what is left after the records expire and the sweeper runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

from auk_worker.service.records.jobs import JobRecord
from auk_worker.service.records.store import JobStore
from auk_dev.local import RedisServer
from auk_worker.service.ops.retention import Sweeper
from auk_worker.service.connect.settings import Settings

OWNER = "0123456789abcdef"
HASH = "9f2c" * 16  # a sha256 in hex, as model_hashes hold them


def _request(i: int) -> dict:
    text = "The results are in, and they look great."
    return {"instruction": f'Generate speech based on the following description: "An energetic young man, speaking '
            f'quickly.". The content to speak is: "{text}".', "audio": None, "gen_seconds": 6.0, "variant": "base",
            "num_inference_steps": None, "guidance_scale": None, "sway": None, "seed": None,
            "output_format": "pcm16", "custom_id": f"line-{i:06d}", "priority": "interactive"}  # fmt: skip


def _result(job_id: str) -> dict:
    return {"bucket": "auk", "key": f"prod/jobs/{job_id}.wav", "duration_s": 6.0, "sample_rate": 24000,
            "samples": 144000, "seed": 1234, "num_inference_steps": 32, "guidance_scale": 2.0, "format": "pcm16",
            "variant": "base", "model_hashes": {"dit": HASH, "vae": HASH, "thinker": HASH},
            "timings": {"encode": 0.0123, "dit": 0.2871, "decode": 0.0311, "total": 0.3305}}  # fmt: skip


def _used(client) -> int:
    return int(client.info("memory")["used_memory"])


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())  # fmt: skip
    return f"{cpu}, {platform.system()} {platform.release()}, python {platform.python_version()}"


def measure(n: int, workdir: Path) -> dict:
    server = RedisServer(workdir / "redis").start()
    client = server.client()
    try:
        store = JobStore(client, retain_s=0)
        client.set("warm", "x")  # the allocator's first pages and the stats hash exist before the baseline
        base = _used(client)
        ids = []
        for i in range(n):
            record, _ = store.create(JobRecord.new(OWNER, _request(i), queue="auk.base.interactive",
                                                   custom_id=f"line-{i:06d}"), f"idem-{i:06d}-{'k' * 20}")  # fmt: skip
            store.start(record.id, f"gpu-host-07:{1000 + i % 7}")
            store.finish(record.id, _result(record.id))
            ids.append(record.id)
        used = _used(client)
        one = {
            "record": client.memory_usage(store.job_key(ids[0]), samples=0),
            "idempotency_key": client.memory_usage(store.idem_key(OWNER, f"idem-000000-{'k' * 20}"), samples=0),
            "index_entry": client.memory_usage(store.owner_key(OWNER), samples=0) / n,
        }
        # Retention: the same records with a 1 s TTL (as a store with retain_s=1 sets on finishing), then a sweep.
        for job_id in ids:
            store.retire(job_id, store.get(job_id).status, ttl=1, count=False)
        time.sleep(1.5)
        settings = dataclasses.replace(Settings.from_env({}), retain_records_s=1)
        # Redis expires keys lazily and by sampling: reading one removes it once its time is up.
        for pattern in ("auk:job:*", "auk:idem:*"):
            for key in list(client.scan_iter(pattern, count=1000)):
                client.exists(key)
        Sweeper(settings, store, storage=None).sweep()
        after = _used(client)
        return {
            "jobs": n,
            "redis_version": client.info("server")["redis_version"],
            "used_memory_per_finished_job_bytes": round((used - base) / n, 1),
            "memory_usage_bytes": {k: round(v, 1) for k, v in one.items()},
            "used_memory_after_retention_delta_bytes": after - base,
            "keys_left": sorted(client.keys("*")),
            "machine": _machine(),
        }
    finally:
        client.close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/redis-memory-per-job.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.jobs, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
