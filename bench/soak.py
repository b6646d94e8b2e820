"""Soak: a fleet of workers renders a batch while a supervisor-like loop SIGKILLs busy workers and starts them again.

``python -m bench.soak [--jobs 5000] [--workers 4] [--kills 60] [--redis-restarts 2]`` starts a private
redis-server (append-only file), a SeaweedFS S3 server, the API and ``--workers`` worker processes as separate hosts
would run them: each its own ``AUK_WORKER_ID`` (``host<i>-gpu0``), working directory, ``HOME`` and ``TMPDIR``, all
with the instant (model-free) pipeline and the bulk deploy config (groups of 8). It posts one batch of ``--jobs``
lines through the API, then every ``--kill-every-s`` seconds SIGKILLs a random worker whose heartbeat says ``busy``
and starts it again under the same id after ``--restart-delay-s`` seconds, as a container supervisor would;
``--redis-restarts`` also stops Redis for ``--redis-outage-s`` seconds that many times. When the batch is done it
checks what the issue asks and prints it:

- jobs, succeeded, failed, **lost** (no terminal record), **stuck** (queued or running at the end), **duplicated**
  (more than one ``succeeded`` line in the workers' logs, or a WAV the record does not name once the orphans are
  swept);
- **orphans swept**: objects of attempts killed between their upload and their record, deleted by the retention
  sweeper's orphan pass (``records/attempts.py``), run here with no grace period;
- one WAV per job in storage, the manifest complete (one line per job, every custom id);
- faults injected, and the **recovery time** of every job a kill took: from the kill to the job's next start on a
  live worker, p50 and max.

It writes ``bench/results/soak-<date>.json``. ``tests/service/test_fleet.py`` runs the same ``Soak`` with CI sizes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import redis

from auk_worker.service.records.attempts import ResultNotes
from auk_worker.service.records.jobs import JobStatus
from auk_worker.service.records.store import JobStore
from auk_dev.local import REPO, ApiProcess, RedisServer, S3Server, WorkerProcess, connection_env, free_port
from auk_worker.service.connect.settings import Settings
from auk_worker.service.connect.storage import Storage
from bench.common import commit

log = logging.getLogger("bench.soak")

API_KEY = "soak-key-0123456789abcdef"
SUCCEEDED_LINE = re.compile(r"job ([0-9a-f]{32}): succeeded")


@dataclass
class SoakConfig:
    jobs: int = 1000
    workers: int = 3
    kills: int = 20
    kill_every_s: float = 3.0  # between two kills (the first comes after one interval)
    restart_delay_s: float = 0.5  # a supervisor's pause before it starts the killed worker again
    redis_restarts: int = 0
    redis_outage_s: float = 5.0
    step_delay_s: float = 0.1  # AUK_INSTANT_STEP_DELAY: how long the instant pipeline takes per step
    steps: int = 8  # per job: a group of 8 renders for steps x step delay
    timeout_s: float = 600.0  # the batch must be done by then
    stall_s: float = 60.0  # after the last fault, give up when no job has ended for this long (stuck jobs)
    max_kills: int = 10  # AUK_MAX_KILLS: kills land on random busy workers here, not on jobs that cause them
    seed: int = 0


@dataclass
class Kill:
    at: float  # seconds since the batch was posted
    worker: str
    jobs: list[str]  # the jobs its instance held
    recovery_s: dict[str, float] = field(default_factory=dict)  # job -> seconds until its next start


@dataclass
class SoakReport:
    config: SoakConfig
    wall_s: float = 0.0
    jobs: int = 0
    succeeded: int = 0
    failed: int = 0
    lost: int = 0
    stuck: int = 0
    duplicated: int = 0
    wavs: int = 0
    orphans_swept: int = 0
    manifest_lines: int = 0
    manifest_complete: bool = False
    kills: list[Kill] = field(default_factory=list)
    redis_outages: list[dict] = field(default_factory=list)
    attempts_max: int = 0
    errors: list[dict] = field(default_factory=list)  # failed jobs' errors (first 20)
    stuck_ids: list[str] = field(default_factory=list)  # first 20

    @property
    def recovery_s(self) -> list[float]:
        return sorted(s for kill in self.kills for s in kill.recovery_s.values())

    def summary(self) -> dict:
        times = self.recovery_s
        return {
            "wall_s": round(self.wall_s, 1), "jobs": self.jobs, "succeeded": self.succeeded, "failed": self.failed,
            "lost": self.lost, "stuck": self.stuck, "duplicated": self.duplicated, "wavs": self.wavs,
            "orphans_swept": self.orphans_swept,
            "manifest_complete": self.manifest_complete, "faults": len(self.kills) + len(self.redis_outages),
            "kills": len(self.kills), "jobs_hit": len(times), "redis_outages": len(self.redis_outages),
            "recovery_p50_s": round(statistics.median(times), 2) if times else None,
            "recovery_max_s": round(max(times), 2) if times else None, "attempts_max": self.attempts_max,
        }  # fmt: skip


class Soak:
    """The services, the fleet and the fault loop of one soak run under ``workdir``."""

    def __init__(self, config: SoakConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = Path(workdir)
        self.rng = random.Random(config.seed)
        self.redis_server = RedisServer(self.workdir / "redis", persist=True)
        self.s3 = S3Server(self.workdir / "s3")
        self.api: ApiProcess | None = None
        self.workers: list[WorkerProcess] = []
        self.env: dict[str, str] = {}
        self.report = SoakReport(config)

    # -- setup ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.redis_server.start()
        self.s3.start()
        self.env = connection_env(
            self.redis_server, self.s3, S3_BUCKET="auk-soak", S3_PREFIX="soak", VARIANT="base", PIPELINE="instant",
            DEPLOY_CONFIG=str(REPO / "config" / "auk-bulk.yaml"), VISIBILITY_TIMEOUT="3600", RETRY_BACKOFF="0.5",
            INSTANT_STEP_DELAY=str(self.config.step_delay_s), MAX_KILLS=str(self.config.max_kills),
        )  # fmt: skip
        Storage(Settings.from_env(self.env)).ensure_buckets()
        for index in range(self.config.workers):
            home = self.workdir / f"host{index}"
            (home / "tmp").mkdir(parents=True, exist_ok=True)
            env = {**self.env, "AUK_WORKER_ID": f"host{index}-gpu0", "HOME": str(home), "TMPDIR": str(home / "tmp")}
            self.workers.append(WorkerProcess(env, f"host{index}-gpu0", home, cwd=home, id_from_env=True).start())
        self.api = ApiProcess({**self.env, "AUK_API_KEYS": API_KEY}, free_port(), self.workdir / "api.log")
        self.api.start(timeout=120)
        client = self.client()
        for worker in self.workers:
            worker.wait_state(client, "ready", timeout=120)

    def stop(self) -> None:
        for worker in self.workers:
            worker.terminate(timeout=20)
        if self.api is not None:
            self.api.stop()
        self.s3.stop()
        self.redis_server.stop()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_server.url, decode_responses=True, socket_timeout=10,
                                    socket_connect_timeout=2)  # fmt: skip

    # -- the run --------------------------------------------------------------------------------------------------
    def run(self) -> SoakReport:
        lines = [json.dumps({"instruction": f"Line {i}.", "gen_seconds": 0.2 + 0.01 * (i % 20), "custom_id": f"c{i}",
                             "num_inference_steps": self.config.steps}) for i in range(self.config.jobs)]  # fmt: skip
        with httpx.Client(base_url=self.api.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
            posted = time.monotonic()
            response = http.post("/v1/batches", content="\n".join(lines),
                                 headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
            response.raise_for_status()
            batch_id = response.json()["id"]
            self._faults(batch_id, posted)
            self.report.wall_s = time.monotonic() - posted
        self._verify(batch_id)
        return self.report

    def _batch_done(self, store: JobStore, batch_id: str) -> bool:
        try:
            batch = store.get_batch(batch_id)
        except redis.RedisError:
            return False
        return bool(batch and batch["done"] and batch["manifest_key"])

    def _faults(self, batch_id: str, posted: float) -> None:
        """Until the batch is done: a kill every ``kill_every_s`` (and the Redis outages spread among them), while
        the killed jobs' next starts are watched for their recovery times."""
        store = JobStore(self.client())
        config = self.config
        outages_at = {round((i + 1) * config.kills / (config.redis_restarts + 1)) for i in range(config.redis_restarts)}
        pending: list[tuple[Kill, float, dict[str, str]]] = []  # a kill, its monotonic time, job -> dead holder
        next_fault = posted + config.kill_every_s
        faults = 0
        deadline = posted + config.timeout_s
        progress, progress_at = -1, posted
        while not self._batch_done(store, batch_id):
            now = time.monotonic()
            terminal = self._terminal(store, batch_id)
            if terminal != progress:
                progress, progress_at = terminal, now
            done_faulting = faults >= config.kills + config.redis_restarts
            if now > deadline or (done_faulting and now - progress_at > config.stall_s):
                log.error("batch %s: %d of %d jobs ended; giving up after %.0f s", batch_id, progress,
                          config.jobs, now - posted)  # fmt: skip
                break
            if faults < config.kills + config.redis_restarts and now >= next_fault:
                if faults in outages_at and len(self.report.redis_outages) < config.redis_restarts:
                    self._redis_outage(posted)
                    store = JobStore(self.client())
                    faults += 1
                    next_fault = time.monotonic() + config.kill_every_s
                else:
                    hit = self._kill_one(store, posted)
                    if hit is not None:
                        pending.append(hit)
                        faults += 1
                        next_fault = time.monotonic() + config.kill_every_s
            pending = [p for p in pending if not self._recovered(store, *p)]
            time.sleep(0.05)
        for item in pending:  # a job finished by a later attempt already: its next start is on its record
            self._recovered(store, *item)

    def _terminal(self, store: JobStore, batch_id: str) -> int:
        try:
            batch = store.get_batch(batch_id)
        except redis.RedisError:
            return -1
        return sum(batch["counts"][s] for s in ("succeeded", "failed", "canceled")) if batch else 0

    def _kill_one(self, store: JobStore, posted: float) -> tuple[Kill, float, dict[str, str]] | None:
        client = store.redis
        busy = [w for w in self.workers if w.proc.poll() is None and w.heartbeat(client).get("state") == "busy"
                and w.heartbeat(client).get("pid") == str(w.pid)]  # fmt: skip
        if not busy:
            return None
        victim = self.rng.choice(busy)
        holder = f"{victim.hostname}/{victim.heartbeat(client).get('instance')}"
        victim.kill()
        at = time.monotonic()
        held = {job_id: holder for job_id in self._held_by(store, holder)}
        kill = Kill(at=round(at - posted, 2), worker=victim.hostname, jobs=sorted(held))
        self.report.kills.append(kill)
        log.info("kill %d: %s holding %d job(s)", len(self.report.kills), victim.hostname, len(held))
        time.sleep(self.config.restart_delay_s)
        victim.start()
        return kill, at, held

    def _held_by(self, store: JobStore, holder: str) -> list[str]:
        keys = sorted(store.redis.smembers(f"{store.ns}:running"))
        pipe = store.redis.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "worker")
        return [key.rsplit(":", 1)[-1] for key, worker in zip(keys, pipe.execute()) if worker == holder]

    def _recovered(self, store: JobStore, kill: Kill, at: float, held: dict[str, str]) -> bool:
        """Record each held job's next start (another holder took it); True once every one has one."""
        wall_at = time.time() - (time.monotonic() - at)
        for job_id, holder in held.items():
            if job_id in kill.recovery_s:
                continue
            try:
                record = store.get(job_id)
            except redis.RedisError:
                return False
            if record is None:
                continue
            if record.worker and record.worker != holder and record.held_at:
                kill.recovery_s[job_id] = round(max(0.0, float(record.held_at) - wall_at), 2)
            elif record.terminal and record.status == JobStatus.SUCCEEDED and record.finished_at:
                finished = datetime.fromisoformat(record.finished_at.replace("Z", "+00:00")).timestamp()
                kill.recovery_s[job_id] = round(max(0.0, finished - wall_at), 2)
        return len(kill.recovery_s) == len(held)

    def _redis_outage(self, posted: float) -> None:
        started = time.monotonic()
        self.redis_server.stop()
        time.sleep(self.config.redis_outage_s)
        self.redis_server.start()
        log.info("redis stopped for %.1f s", self.config.redis_outage_s)
        self.report.redis_outages.append({"at": round(started - posted, 2), "seconds": self.config.redis_outage_s})

    # -- checks ---------------------------------------------------------------------------------------------------
    def _verify(self, batch_id: str) -> None:
        report = self.report
        settings = Settings.from_env(self.env)
        store, storage = JobStore(self.client()), Storage(settings)
        records = store.batch_records(batch_id)
        report.jobs = self.config.jobs
        report.lost = self.config.jobs - sum(1 for r in records if r.terminal)
        report.stuck = sum(1 for r in records if r.status in (JobStatus.QUEUED, JobStatus.RUNNING))
        report.succeeded = sum(1 for r in records if r.status == JobStatus.SUCCEEDED)
        report.failed = sum(1 for r in records if r.status == JobStatus.FAILED)
        report.errors = [{"job": r.id, **(r.error or {})} for r in records if r.status == JobStatus.FAILED][:20]
        report.attempts_max = max((r.attempts for r in records), default=0)
        # A worker killed after its upload and before its record leaves its attempt's object behind; the retention
        # sweeper deletes it an hour later. Sweep now, so that what remains is what the records name.
        report.orphans_swept = ResultNotes(store.redis, store.ns).sweep(store, storage, grace_s=0)
        wav_keys = [k for k in storage.list_keys(f"{settings.s3_prefix}jobs/") if k.endswith(".wav")]
        report.wavs = len(wav_keys)
        expected = {r.result["key"] for r in records if r.status == JobStatus.SUCCEEDED}  # each attempt its own key
        successes: dict[str, int] = {}
        for worker in self.workers:
            for job_id in SUCCEEDED_LINE.findall(worker.log.read_text(errors="replace")):
                successes[job_id] = successes.get(job_id, 0) + 1
        extra_wavs = len(wav_keys) - len(set(wav_keys) & expected)
        report.duplicated = sum(1 for n in successes.values() if n > 1) + extra_wavs
        report.stuck_ids = [r.id for r in records if r.status in (JobStatus.QUEUED, JobStatus.RUNNING)][:20]
        batch = store.get_batch(batch_id) or {}
        if not batch.get("manifest_key"):
            return
        manifest = storage.get_bytes(storage.bucket, batch["manifest_key"]).decode()
        entries = [json.loads(line) for line in manifest.splitlines() if line.strip()]
        report.manifest_lines = len(entries)
        report.manifest_complete = (
            sorted(e["custom_id"] for e in entries) == sorted(f"c{i}" for i in range(self.config.jobs))
            and all(e["status"] == "succeeded" and e["key"] in expected for e in entries)
        )


def print_report(report: SoakReport) -> None:
    summary = report.summary()
    print(f"soak: {summary['jobs']} jobs on {report.config.workers} workers in {summary['wall_s']} s")
    print(f"  faults injected: {summary['kills']} SIGKILLs of busy workers ({summary['jobs_hit']} jobs held), "
          f"{summary['redis_outages']} Redis outages")  # fmt: skip
    print(f"  succeeded {summary['succeeded']}, failed {summary['failed']}, lost {summary['lost']}, "
          f"duplicated {summary['duplicated']}, stuck {summary['stuck']}; {summary['wavs']} WAVs "
          f"({summary['orphans_swept']} orphans swept); "
          f"manifest complete: {summary['manifest_complete']}")  # fmt: skip
    print(f"  recovery (kill -> next start): p50 {summary['recovery_p50_s']} s, max {summary['recovery_max_s']} s; "
          f"most attempts of one job: {summary['attempts_max']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    defaults = SoakConfig(jobs=5000, workers=4, kills=60, redis_restarts=2)
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(value), default=value,
                            help=f"default {value}")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs) afterwards")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    config = SoakConfig(**{name: getattr(args, name) for name in asdict(defaults)})
    workdir = Path(tempfile.mkdtemp(prefix="auk-soak-"))
    soak = Soak(config, workdir)
    try:
        soak.start()
        report = soak.run()
    finally:
        soak.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print_report(report)
    out = REPO / "bench" / "results" / f"soak-{datetime.now(timezone.utc):%Y-%m-%d-%H%M}.json"
    result = {
        "benchmark": "soak", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
        "host": {"name": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "setup": {"pipeline": "instant", "deploy_config": "config/auk-bulk.yaml (groups of 8)",
                  "broker": "redis-server (loopback, append-only file)", "storage": "SeaweedFS S3 (loopback)",
                  "visibility_timeout_s": 3600},
        "config": asdict(config), "summary": report.summary(),
        "kills": [asdict(kill) for kill in report.kills], "redis_outages": report.redis_outages,
        "errors": report.errors, "stuck_ids": report.stuck_ids,
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  written to {out.relative_to(REPO)}")
    ok = report.lost == report.stuck == report.duplicated == report.failed == 0 and report.manifest_complete
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
