"""Worker start-up as an autoscaler sees it: process start to the first job accepted, compile caches cold and warm.

    python -m bench.service --startup                                         # CPU: the model-free pipeline
    python -m bench.service --startup --pipeline auk --checkpoint DIR         # a checkpoint (the tiny one on a CPU)
    python -m bench.service --startup --pipeline random-release               # GPU: release-size random weights

One Redis, one SeaweedFS and the API stay up; a worker is started ``--starts`` times. The first start gets an empty
``AUK_CACHE_DIR`` (Inductor's and Triton's caches cold, as on a new volume), the later ones the same directory
again (warm, as a restarted or added worker on a shared volume). Each start is timed from just before the process
is spawned to its heartbeat saying ``ready`` (pipeline loaded and warmed up, consumer running), and to the moment a
job submitted at spawn time is ``running`` (the first job accepted). The weights stay in the page cache across
starts, as on a host that has served them before. The JSON goes to
``bench/results/service-startup-<commit>-<device>-<pipeline>-<date>.json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from auk_dev.local import ApiProcess, RedisServer, S3Server, WorkerProcess, connection_env, free_port

API_KEY = "bench-startup-key-0123456789"
TARGETS_S = {"warm": 15.0, "cold": 90.0}  # issue 35, one H200, release-size weights


def one_start(env: dict[str, str], work: Path, index: int, http: httpx.Client, client, timeout: float) -> dict:
    worker = WorkerProcess(env, f"startup-{index}", work)
    spawned = time.perf_counter()
    worker.start()
    body = {"instruction": "A short warm-up line.", "gen_seconds": 1.0, "variant": env["AUK_VARIANT"]}
    job_id = http.post("/v1/jobs", json=body).raise_for_status().json()["id"]
    try:
        worker.wait_state(client, "ready", timeout=timeout)
        ready = time.perf_counter() - spawned
        accepted = None
        deadline = time.monotonic() + timeout
        while accepted is None and time.monotonic() < deadline:
            if http.get(f"/v1/jobs/{job_id}").json()["status"] != "queued":
                accepted = time.perf_counter() - spawned
            else:
                time.sleep(0.01)
        if accepted is None:
            raise TimeoutError(f"the first job was not taken within {timeout:.0f} s")
    finally:
        worker.terminate(timeout=60)
    return {"ready_s": round(ready, 3), "first_job_accepted_s": round(accepted, 3)}


def run(args: argparse.Namespace) -> dict:
    variant = args.variant
    with tempfile.TemporaryDirectory(prefix="auk-bench-startup-") as tmp:
        work = Path(tmp)
        redis_server = RedisServer(work / "redis").start()
        s3 = S3Server(work / "s3").start()
        api = None
        try:
            env = connection_env(redis_server, s3, S3_BUCKET="auk-bench", PIPELINE=args.pipeline, VARIANT=variant,
                                 CACHE_DIR=str(work / "compile-cache"), VARIANT_CHECK="off")  # fmt: skip
            if args.checkpoint:
                env["AUK_CHECKPOINT"] = str(args.checkpoint)
            if args.deploy_config:
                env["AUK_DEPLOY_CONFIG"] = str(args.deploy_config)
            api = ApiProcess({**env, "AUK_API_KEYS": API_KEY}, free_port(), work / "api.log").start()
            http = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
            starts = []
            for index in range(args.starts):
                run_ = one_start(env, work, index, http, redis_server.client(), args.start_timeout)
                starts.append({"caches": "cold" if index == 0 else "warm", **run_})
        finally:
            if api is not None:
                api.stop()
            s3.stop()
            redis_server.stop()
    return {"variant": variant, "deploy_config": str(args.deploy_config or "config/auk.yaml"), "starts": starts,
            "targets_s_h200": TARGETS_S}  # fmt: skip
