"""Overnight throughput: one batch of N base instruct-TTS jobs through the real service, timed end to end.

``python -m bench.throughput [--jobs N] [--seconds 6] [--pipeline tiny|instant|release]
[--deploy-config config/auk-bulk.yaml] [--dtype float8] [--store-behind auto|on|off] [--step-delay S]`` starts a
private redis-server, a SeaweedFS S3 server, the API and one worker (the process managers of
``auk_dev/local.py``), posts ONE batch of N jobs of ``--seconds`` each (same schedule) to ``POST /v1/batches``,
which cuts it into ``auk.render_group`` tasks of the deploy config's ``max_num_seqs``, and waits until the batch
is done. ``--dtype`` runs API and worker on a copy of
the deploy config with that stage 1 ``dtype``. It reports:

- audio seconds rendered per wall second and jobs per second, over the render window (first job started to last
  job finished) and from enqueue (just before the POST to the last job finished);
- per-job latency medians: enqueue to finished, and started to finished;
- how many ``render_batch`` calls the worker made and their sizes, and the medians of where a group task's time
  went (from its log: the gap between tasks, prepare, render, store);
- the pipeline's busy share: seconds in render calls (the worker's ``auk_worker_render_busy_seconds_total``) over
  the timed batch's wall time, enqueue to done. With ``--store-behind on`` (``AUK_STORE_BEHIND``) the worker stores
  one group while it renders the next; ``--step-delay`` gives the instant pipeline a render time
  (``AUK_INSTANT_STEP_DELAY`` seconds a step), as a GPU would take.

Pipelines: ``instant`` (silence, no model: the service's own ceiling), ``tiny`` (the tiny checkpoint, made in a
temporary directory), ``release`` (``AUK_PIPELINE=random-release``: release-size random weights built by
``bench/models.py``, for a GPU). Before the timed batch, an untimed warm-up batch (``--warmup`` jobs, one group
by default) lets a graph-capturing worker record the group shapes. The result goes to
``bench/results/throughput[-<dtype>]-<device>-<date>.json``. Run it from the repository root. The issue's target:
at least 40 s of audio per wall second on one H200 with 6 s jobs.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
import tempfile
import time
import typing
from datetime import datetime
from pathlib import Path

import httpx
import yaml

from auk_worker.deploy import DiTDtype, load_deploy_config
from auk_worker.service.connect.settings import STORE_BEHIND
from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.records.store import JobStore
from auk_dev.local import (
    REPO,
    ApiProcess,
    RedisServer,
    S3Server,
    WorkerProcess,
    connection_env,
    free_port,
)
from bench.common import BULK_INSTRUCTION, write_result

log = logging.getLogger("bench.throughput")

API_KEY = "bench-throughput-key-0123456789"
TARGET_AUDIO_S_PER_S = 40.0
PIPELINE_ENV = {"instant": "instant", "tiny": "auk", "release": "random-release"}


def _parse_time(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class ServiceUnderTest:
    """redis-server, SeaweedFS, the API and one worker on loopback, in ``workdir``."""

    def __init__(self, workdir: Path, pipeline: str, deploy_config: Path, checkpoint: Path | None,
                 worker_env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.workdir = workdir
        self.worker_env = dict(worker_env or {})
        self.metrics_port = free_port()
        self.redis = RedisServer(workdir / "redis")
        self.s3 = S3Server(workdir / "s3")
        self.pipeline = pipeline
        self.deploy_config = deploy_config
        self.checkpoint = checkpoint
        self.api: ApiProcess | None = None
        self.worker: WorkerProcess | None = None

    def start(self, ready_timeout: float) -> ServiceUnderTest:
        self.redis.start()
        self.s3.start()
        env = connection_env(
            self.redis, self.s3, S3_BUCKET="auk-bench", VARIANT="base", PIPELINE=PIPELINE_ENV[self.pipeline],
            DEPLOY_CONFIG=str(self.deploy_config), VISIBILITY_TIMEOUT="7200",
        )
        if self.checkpoint is not None:
            env["AUK_CHECKPOINT"] = str(self.checkpoint)
        self.api = ApiProcess({**env, "AUK_API_KEYS": API_KEY}, free_port(), self.workdir / "api.log").start()
        worker_env = {**env, **self.worker_env, "AUK_METRICS_PORT": str(self.metrics_port)}
        self.worker = WorkerProcess(worker_env, "bench-throughput", self.workdir).start()
        self.worker.wait_state(self.redis.client(), "ready", timeout=ready_timeout)
        return self

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.terminate(timeout=60)
        if self.api is not None:
            self.api.stop()
        self.s3.stop()
        self.redis.stop()


def post_batch(http: httpx.Client, jobs: int, seconds: float, steps: int | None, tag: str) -> str:
    line = {"instruction": BULK_INSTRUCTION, "gen_seconds": seconds, "seed": 0}
    if steps is not None:
        line["num_inference_steps"] = steps
    body = "\n".join(json.dumps({**line, "seed": i, "custom_id": f"{tag}-{i}"}) for i in range(jobs))
    response = http.post("/v1/batches", content=body, headers={"Content-Type": "application/x-ndjson"})
    if response.status_code != 202:
        raise RuntimeError(f"POST /v1/batches answered {response.status_code}: {response.text}")
    return response.json()["id"]


def wait_batch(http: httpx.Client, batch_id: str, timeout: float, worker: WorkerProcess) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        batch = http.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] == "done":
            return batch
        if worker.proc is not None and worker.proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {worker.proc.returncode}:\n{worker.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id} not done after {timeout:.0f} s: {batch['counts']}")
        time.sleep(0.1)


def measure(records: list[JobRecord], enqueued_at: float) -> dict:
    """Throughput and latency of one finished batch from its records' timestamps."""
    failed = [r for r in records if r.status != JobStatus.SUCCEEDED]
    if failed:
        raise RuntimeError(f"{len(failed)} job(s) did not succeed, e.g. {failed[0].id}: {failed[0].error}")
    started = [_parse_time(r.started_at) for r in records]
    finished = [_parse_time(r.finished_at) for r in records]
    created = [_parse_time(r.created_at) for r in records]
    audio_s = sum(r.result["duration_s"] for r in records)
    window = max(finished) - min(started)
    from_enqueue = max(finished) - enqueued_at
    stages = sorted({name for r in records for name in r.result.get("timings", {})})
    stage_ms = {name: round(1000 * statistics.median(r.result["timings"].get(name, 0.0) for r in records), 1)
                for name in stages}  # fmt: skip
    return {
        "jobs": len(records),
        "stage_ms_per_job_median": stage_ms,  # the pipeline's own clock (the DiT pass split over its rows)
        "audio_seconds": round(audio_s, 3),
        "render_window_s": round(window, 3),
        "from_enqueue_s": round(from_enqueue, 3),
        "audio_s_per_s": round(audio_s / window, 3),
        "audio_s_per_s_from_enqueue": round(audio_s / from_enqueue, 3),
        "jobs_per_s": round(len(records) / window, 3),
        "jobs_per_s_from_enqueue": round(len(records) / from_enqueue, 3),
        "latency_s": {
            "enqueue_to_finished_median": round(statistics.median(f - c for f, c in zip(finished, created)), 3),
            "started_to_finished_median": round(statistics.median(f - s for f, s in zip(finished, started)), 3),
        },
    }


def render_busy_s(port: int) -> float:
    """The worker's ``auk_worker_render_busy_seconds_total``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    match = re.search(r"^auk_worker_render_busy_seconds_total ([0-9.e+-]+)$", text, re.M)
    if match is None:
        raise RuntimeError("the worker's metrics have no auk_worker_render_busy_seconds_total")
    return float(match[1])


def render_calls(worker_log: str) -> list[int]:
    """Sizes of the worker's ``render_batch`` calls (one per group task, plus lone re-renders)."""
    return [int(n) for n in re.findall(r"group of (\d+): rendering", worker_log)]


def group_phases(worker_log: str) -> dict[str, float]:
    """Medians over the worker's group tasks of where their wall time went (ms): Celery between two tasks, then
    starting the records and fetching inputs, the ``render_batch`` call, the uploads and records."""
    phases = re.findall(r"group of \d+: prepare ([\d.]+) ms, render ([\d.]+) ms, store ([\d.]+) ms", worker_log)
    between = [float(ms) for ms in re.findall(r"group of \d+: ([\d.]+) ms since the previous task", worker_log)]
    medians = {"between_tasks": statistics.median(between)} if between else {}
    for i, name in enumerate(("prepare", "render", "store")):
        if phases:
            medians[name] = statistics.median(float(row[i]) for row in phases)
    return {name: round(ms, 1) for name, ms in medians.items()}


def with_dit_dtype(deploy_config: Path, dtype: str, copy: Path) -> Path:
    """A copy of ``deploy_config`` whose stage 1 ``dtype`` is ``dtype`` (the API and the worker both read it)."""
    raw = yaml.safe_load(deploy_config.read_text())
    raw["stages"][1]["dtype"] = dtype
    copy.write_text(yaml.safe_dump(raw, sort_keys=False))
    return copy


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="auk-throughput-") as tmp:
        work = Path(tmp)
        deploy_config = args.deploy_config.resolve()
        if args.dtype:
            deploy_config = with_dit_dtype(deploy_config, args.dtype, work / deploy_config.name)
        deploy = load_deploy_config(deploy_config)
        warmup = deploy.dit.max_num_seqs if args.warmup is None else args.warmup
        checkpoint = None
        if args.pipeline == "tiny":
            from auk_worker.tiny.checkpoint import make_tiny_checkpoint

            checkpoint = Path(make_tiny_checkpoint(work / "auk-tiny-base", "base"))
        worker_env = {"AUK_STORE_BEHIND": args.store_behind}
        if args.step_delay is not None:
            worker_env["AUK_INSTANT_STEP_DELAY"] = str(args.step_delay)
        service = ServiceUnderTest(work, args.pipeline, deploy_config, checkpoint, worker_env)
        try:
            service.start(ready_timeout=args.ready_timeout)
            store = JobStore(service.redis.client())
            with httpx.Client(base_url=service.api.url, headers={"Authorization": f"Bearer {API_KEY}"},
                              timeout=120) as http:  # fmt: skip
                if warmup:
                    log.info("warm-up batch of %d jobs", warmup)
                    wait_batch(http, post_batch(http, warmup, args.seconds, args.steps, "warmup"), args.timeout,
                               service.worker)  # fmt: skip
                log_before = len(service.worker.log_tail(10_000_000))
                log.info("timed batch of %d jobs of %.1f s", args.jobs, args.seconds)
                busy_before = render_busy_s(service.metrics_port)
                enqueued_at = time.time()
                batch_id = post_batch(http, args.jobs, args.seconds, args.steps, "job")
                wait_batch(http, batch_id, args.timeout, service.worker)
                wall_s = time.time() - enqueued_at
                busy_s = render_busy_s(service.metrics_port) - busy_before
            result = measure(store.batch_records(batch_id), enqueued_at)
            result["render_busy"] = {"seconds": round(busy_s, 3), "share_of_wall": round(busy_s / wall_s, 3)}
            timed_log = service.worker.log_tail(10_000_000)[log_before:]
            result["render_batch_calls"] = render_calls(timed_log)
            result["group_phases_ms"] = group_phases(timed_log)
        finally:
            service.stop()
    return {
        "benchmark": "throughput",
        "setup": {
            "pipeline": args.pipeline,
            "deploy_config": str(args.deploy_config),
            "dit_dtype": deploy.dit.dtype,
            "max_num_seqs": deploy.dit.max_num_seqs,
            "position_budget": deploy.dit.model_config.auk_dit_batch_position_budget,
            "gen_seconds": args.seconds,
            "steps": args.steps or deploy.defaults.num_inference_steps,
            "guidance_scale": deploy.defaults.guidance_scale,
            "warmup_jobs": warmup,
            "store_behind": args.store_behind,
            "instant_step_delay_s": args.step_delay,
            "path": "POST /v1/batches -> auk.render_group tasks -> 1 worker -> SeaweedFS",
        },
        **result,
        "target_audio_s_per_s": TARGET_AUDIO_S_PER_S,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=64, help="jobs in the timed batch (default 64)")
    parser.add_argument("--seconds", type=float, default=6.0, help="target length of every job (default 6 s)")
    parser.add_argument("--pipeline", choices=sorted(PIPELINE_ENV), default="release",
                        help="release (random weights, GPU), tiny (tiny checkpoint) or instant (no model)")  # fmt: skip
    parser.add_argument("--deploy-config", type=Path, default=REPO / "config" / "auk-bulk.yaml",
                        help="deploy YAML for the API and the worker (default config/auk-bulk.yaml)")  # fmt: skip
    parser.add_argument("--dtype", choices=typing.get_args(DiTDtype), default=None,
                        help="stage 1 dtype instead of the config's (float8: the DiT's block linears in E4M3)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="num_inference_steps (default: the config's)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed jobs first (default: max_num_seqs)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for a batch")
    parser.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds to wait for the worker")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    parser.add_argument("--store-behind", choices=STORE_BEHIND, default="auto",
                        help="AUK_STORE_BEHIND of the worker (default auto: on for a group config)")
    parser.add_argument("--step-delay", type=float, default=None,
                        help="instant pipeline: seconds a DiT step takes (AUK_INSTANT_STEP_DELAY)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    result = run(args)
    name = f"throughput-{args.dtype}" if args.dtype and args.dtype != "auto" else "throughput"
    name += f"-{args.pipeline}-store-behind-{args.store_behind}"
    path = write_result(name, result, args.out)
    print(
        f"throughput ({args.pipeline}, {result['jobs']} x {args.seconds:g} s, max_num_seqs "
        f"{result['setup']['max_num_seqs']}): {result['audio_s_per_s']:.2f} audio s / s, "
        f"{result['jobs_per_s']:.2f} jobs/s over the render window; {result['audio_s_per_s_from_enqueue']:.2f} "
        f"audio s / s from enqueue; median latency {result['latency_s']['enqueue_to_finished_median']:.2f} s; "
        f"render_batch calls {result['render_batch_calls']}; median group phases (ms) {result['group_phases_ms']}; "
        f"pipeline busy {result['render_busy']['share_of_wall']:.0%} of the wall time; "
        f"written to {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
