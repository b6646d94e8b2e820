"""Listing latency at scale: ``GET /v1/jobs?status=...`` over HTTP with 100k jobs under one key.

``python -m bench.listing [--jobs 100000] [--samples 200] [--load-seconds 30]`` starts a private redis-server and
the API (``python -m api`` under uvicorn) on loopback, then:

1. fills Redis with ``--jobs`` job records of key A through the job store (``create_batch`` in chunks of 1000,
   then ``start`` and ``finish`` / ``fail`` on the records): the oldest 0.5 % failed, the next 0.5 % still queued,
   the rest succeeded, the worst case for a listing that filters by scanning (the rare statuses are the oldest);
   key B gets 10 queued jobs;
2. times each listing ``--samples`` times, one at a time on one keep-alive connection (p50, p99, max in ms), with key
   B's 10-job listing as the floor of the machine at that moment, and counts the job records Redis served per
   listing (its command statistics: independent of the machine's load);
3. isolation: key B's small listing timed while 60 threads of key A run ``status=failed&limit=1`` listings
   back to back for ``--load-seconds``; B's requests still unanswered when the window closes count as waiting at
   least until then. Run with the per-key turns off (``--quotas off``, the default: what the index alone gives)
   or at their defaults (``--quotas default``: ``AUK_QUOTA_IN_FLIGHT`` 4 running per key, the rest waiting). The
   request-rate quota is off in both: a timed series of hundreds of listings would measure it instead.

Storage is not contacted by a listing (result URLs are presigned locally), so ``AUK_S3_ENDPOINT`` names a closed
port. Writes ``bench/results/listing-<date>[-label].json``. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx

from auk_worker.service.records.jobs import JobRecord
from auk_worker.service.records.store import JobStore
from auk_dev.local import ApiProcess, RedisServer, free_port
from bench.common import RESULTS, commit

log = logging.getLogger("bench.listing")

KEY_A, KEY_B = "bench-listing-key-a-0123456789", "bench-listing-key-b-0123456789"
QUERIES = {
    "failed_limit_1": {"status": "failed", "limit": 1},
    "queued_limit_50": {"status": "queued", "limit": 50},
    "succeeded_limit_50": {"status": "succeeded", "limit": 50},
    "all_limit_50": {"limit": 50},
}
HEAVY = QUERIES["failed_limit_1"]
LOAD_THREADS = 60


def fill(store: JobStore, owner: str, jobs: int) -> dict[str, int]:
    """``jobs`` records for ``owner``: the oldest 0.5 % failed, the next 0.5 % queued, the rest succeeded."""
    request = {"instruction": "bench listing", "gen_seconds": 1.0, "target_seconds": 1.0, "variant": "base"}
    records = [JobRecord.new(owner, dict(request), queue="auk.base.bulk") for _ in range(jobs)]
    for start in range(0, jobs, 1000):
        store.create_batch(owner, records[start:start + 1000])
    rare = max(1, jobs // 200)

    def settle(index: int) -> str:
        record = records[index]
        if rare <= index < 2 * rare:
            return "queued"
        store.start(record.id, "bench:0")
        if index < rare:
            store.fail(record.id, "bench", "failed for the listing benchmark")
            return "failed"
        store.finish(record.id, {"bucket": "auk", "key": f"jobs/{record.id}.wav", "duration_s": 1.0,
                                 "sample_rate": 24000})  # fmt: skip
        return "succeeded"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(settle, range(jobs), chunksize=500))
    return {status: outcomes.count(status) for status in ("failed", "queued", "succeeded")}


def percentiles(values_ms: list[float]) -> dict[str, float]:
    ordered = sorted(values_ms)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 2), "p99": round(p99, 2), "max": round(ordered[-1], 2),
            "n": len(ordered)}  # fmt: skip


def time_query(url: str, key: str, params: dict, samples: int, warmup: int) -> dict[str, float]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=900) as http:
        for _ in range(warmup):
            http.get("/v1/jobs", params=params).raise_for_status()
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            response = http.get("/v1/jobs", params=params)
            times.append((time.perf_counter() - started) * 1000)
            response.raise_for_status()
    return percentiles(times)


def records_read(client, url: str, params: dict, calls: int = 10) -> float:
    """Job records (HGETALL) Redis served per listing, from Redis's own command counts: independent of how
    loaded the machine is."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=900) as http:
        client.config_resetstat()
        for _ in range(calls):
            http.get("/v1/jobs", params=params).raise_for_status()
        return client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0) / calls


def isolation(url: str, seconds: float) -> dict:
    """Key B's listing latency while ``LOAD_THREADS`` threads of key A list ``HEAVY`` back to back."""
    stop = time.monotonic() + seconds
    counts = {"completed": 0, "refused_429": 0, "errors": 0}
    lock = threading.Lock()

    def load() -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=seconds + 5) as http:
            while time.monotonic() < stop:
                try:
                    status = http.get("/v1/jobs", params=HEAVY).status_code
                except httpx.HTTPError:
                    status = -1
                with lock:
                    key = "completed" if status == 200 else "refused_429" if status == 429 else "errors"
                    counts[key] += 1

    b_times: list[float] = []
    b_waiting: list[float] = []

    def probe() -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY_B}"}) as http:
            while time.monotonic() < stop:
                started = time.perf_counter()
                try:
                    http.get("/v1/jobs", params={"limit": 10}, timeout=max(0.1, stop - time.monotonic())).raise_for_status()
                    b_times.append((time.perf_counter() - started) * 1000)
                except httpx.TimeoutException:
                    b_waiting.append((time.perf_counter() - started) * 1000)
                    return
                time.sleep(0.1)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(LOAD_THREADS)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the load is running before the first probe
    probe()
    for thread in threads:
        thread.join(timeout=seconds + 10)
    out = {"load_threads": LOAD_THREADS, "load_query": HEAVY, "seconds": seconds, "key_a": counts,
           "key_b_limit_10": percentiles(b_times) if b_times else None}  # fmt: skip
    if b_waiting:
        out["key_b_unanswered_at_window_end_ms"] = [round(w, 1) for w in b_waiting]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=2, help="untimed listings before the timed ones")
    parser.add_argument("--load-seconds", type=float, default=30.0)
    parser.add_argument("--quotas", choices=("off", "default"), default="off")
    parser.add_argument("--label", default="", help="suffix of the result file name (e.g. before)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="auk-listing-") as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        api = None
        try:
            store = JobStore(server.client())
            from auk_worker.service.records.jobs import owner_id

            started = time.perf_counter()
            statuses = fill(store, owner_id(KEY_A), args.jobs)
            fill(store, owner_id(KEY_B), 10)
            fill_s = time.perf_counter() - started
            log.info("filled %d jobs in %.1f s: %s", args.jobs, fill_s, statuses)
            env = {"AUK_REDIS_URL": server.url, "AUK_S3_ENDPOINT": f"http://127.0.0.1:{free_port()}",
                   "AUK_S3_ACCESS_KEY": "bench", "AUK_S3_SECRET_KEY": "bench-secret", "AUK_API_KEYS": f"{KEY_A},{KEY_B}",
                   "AUK_LOG_LEVEL": "WARNING"}  # fmt: skip
            env["AUK_QUOTA_RATE"] = "0"  # else the timed series would measure the rate quota, not the listing
            if args.quotas == "off":
                env["AUK_QUOTA_IN_FLIGHT"] = "0"
            api = ApiProcess(env, free_port(), Path(tmp) / "api.log").start()
            timings = {"key_b_limit_10 (floor: a key with 10 jobs)":
                       time_query(api.url, KEY_B, {"limit": 10}, args.samples, args.warmup)}  # fmt: skip
            reads = {}
            for name, params in QUERIES.items():
                timings[name] = time_query(api.url, KEY_A, params, args.samples, args.warmup)
                reads[name] = records_read(server.client(), api.url, params, calls=max(1, min(10, args.samples)))
                log.info("%s: %s, %.0f records read per listing", name, timings[name], reads[name])
            iso = isolation(api.url, args.load_seconds)
            log.info("isolation: %s", iso)
        finally:
            if api is not None:
                api.stop()
            server.stop()
    result = {
        "benchmark": "listing",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "host": {"name": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "setup": {"jobs_key_a": args.jobs, "statuses_key_a": statuses, "fill_seconds": round(fill_s, 1),
                  "samples": args.samples, "warmup": args.warmup, "quotas": args.quotas,
                  "quota_rate": "off", "transport": "HTTP/1.1 keep-alive, loopback",
                  "api": "python -m api (uvicorn, one process)", "redis": "redis-server, loopback"},  # fmt: skip
        "listing_ms": timings,
        "records_read_per_listing": reads,
        "isolation": iso,
    }
    RESULTS.mkdir(exist_ok=True)
    day = datetime.now(timezone.utc).date().isoformat()
    out = RESULTS / f"listing-{day}{'-' + args.label if args.label else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
