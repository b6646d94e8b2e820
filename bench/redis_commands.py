"""Redis commands per job, counted one by one with ``MONITOR``: what bounds how many GPUs one Redis carries.

``python -m bench.redis_commands [--jobs N]`` starts a private redis-server, SeaweedFS, the API and one model-free
worker (``AUK_PIPELINE=instant``, ``AUK_INSTANT_STEP_DELAY`` so that a job renders its steps over some time, as a
real one does), then for each phase:

- ``idle``: the service with nothing to do, for ``--idle`` seconds: the fixed load (heartbeats, the reaper, the bulk
  feeders, Celery's polling), as commands per second;
- ``jobs``: N single jobs through ``POST /v1/jobs`` (default priority, 32 steps, 6 s), waited for by reading Redis
  from this process's own connection (left out of the count);
- ``batch``: one ``POST /v1/batches`` of N lines.

Every command a client sends is seen through ``MONITOR`` (the connections of this benchmark excepted), grouped by
command and by key pattern (ids replaced by ``{id}``); the commands scripts run inside an ``EVALSHA`` are counted
apart (``inside_scripts``: no round trip of their own, but Redis's time). Per job: the phase's commands minus the idle rate times the
phase's duration. It writes ``bench/results/redis-commands-<commit>-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import httpx
import redis

from auk_dev.local import ApiProcess, RedisServer, S3Server, WorkerProcess, connection_env, free_port
from bench.common import commit

API_KEY = "bench-redis-commands-key-000000"
GEN_SECONDS = 6.0
STEPS = 32
STEP_DELAY_S = 0.01  # 0.32 s a job: progress is written as often as a real render's steps allow
ID = re.compile(r"[0-9a-f]{12,}|[0-9a-f-]{36}")


def _script_names() -> dict[str, str]:
    """The service's Lua scripts by SHA-1 (what ``EVALSHA`` names): ``jobs._PROGRESS`` and so on."""
    import hashlib
    import importlib
    import pkgutil

    import auk_worker.service as service

    names = {}
    for info in pkgutil.walk_packages(service.__path__, "auk_worker.service."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a module that needs what this process lacks holds no script we need
            continue
        for attr, value in vars(module).items():
            if isinstance(value, str) and "redis.call" in value:
                names[hashlib.sha1(value.encode()).hexdigest()] = f"{info.name.rsplit('.', 1)[-1]}.{attr}"
    return names


SCRIPTS = _script_names()


def _pattern(args: list[str]) -> str:
    """The command and its first key with ids replaced: ``HSET auk:job:{id}``; a script by its name."""
    name = args[0].upper()
    if name == "EVALSHA" and len(args) > 1:
        return f"EVALSHA {SCRIPTS.get(args[1], args[1][:8])}"
    if name in ("EVALSHA", "EVAL") and len(args) > 3 and args[2] != "0":
        key = args[3]
    elif name in ("MULTI", "EXEC", "PING", "INFO", "CLIENT", "SCRIPT", "SELECT", "HELLO") or len(args) < 2:
        key = ""
    else:
        key = args[1]
    key = ID.sub("{id}", key)
    key = re.sub(r"celery-task-meta-.*|_kombu\.binding\..*", lambda m: m.group(0).split(".")[0] + "...", key)
    return f"{name} {key}".strip()


class Monitor:
    """A thread reading ``MONITOR``; counts every command by name and by pattern, except from ``ignored`` ports."""

    def __init__(self, client: redis.Redis, ignored: set[int]) -> None:
        self.client = client
        self.ignored = ignored
        self.names: Counter[str] = Counter()
        self.patterns: Counter[str] = Counter()
        self.total = 0
        self.inside_scripts = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._stop = False

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def _run(self) -> None:
        with self.client.monitor() as monitor:
            self.ignored.add(monitor.connection._sock.getsockname()[1])
            for entry in monitor.listen():
                if self._stop:
                    return
                if entry.get("client_type") == "lua" or entry.get("client_address") == "lua":
                    with self._lock:
                        self.inside_scripts += 1  # run by a script, within its EVALSHA: no round trip of its own
                    continue
                port = int(str(entry.get("client_port") or entry.get("client_address", ":0").rsplit(":", 1)[-1]))
                if port in self.ignored:
                    continue
                try:
                    args = shlex.split(entry["command"])
                except ValueError:
                    args = entry["command"].split()
                if not args:
                    continue
                with self._lock:
                    self.total += 1
                    self.names[args[0].upper()] += 1
                    self.patterns[_pattern(args)] += 1

    def snapshot(self) -> tuple[int, Counter, Counter, int]:
        with self._lock:
            return self.total, Counter(self.names), Counter(self.patterns), self.inside_scripts


def _phase(monitor: Monitor, work, idle_rate: float, n: int) -> dict:
    total0, names0, patterns0, inner0 = monitor.snapshot()
    started = time.monotonic()
    work()
    time.sleep(0.5)  # the last job's trailing writes (the feeder's nudge, the webhook check)
    seconds = time.monotonic() - started
    total1, names1, patterns1, inner1 = monitor.snapshot()
    raw = total1 - total0
    background = idle_rate * seconds
    names, patterns = names1 - names0, patterns1 - patterns0
    return {
        "jobs": n,
        "seconds": round(seconds, 2),
        "commands": raw,
        "background_commands": round(background),
        "commands_per_job": round((raw - background) / n, 1),
        "raw_commands_per_job": round(raw / n, 1),
        "inside_scripts_per_job": round((inner1 - inner0) / n, 1),
        "by_command_per_job": {k: round(v / n, 2) for k, v in names.most_common(16)},
        "by_pattern_per_job": {k: round(v / n, 2) for k, v in patterns.most_common(40)},
    }


def run(jobs: int, idle_s: float, workdir: Path) -> dict:
    redis_server = RedisServer(workdir / "redis").start()
    s3 = S3Server(workdir / "s3").start()
    env = connection_env(redis_server, s3, PIPELINE="instant", VARIANT="base", API_KEYS=API_KEY,
                         INSTANT_STEP_DELAY=str(STEP_DELAY_S))  # fmt: skip
    api = ApiProcess(env, free_port(), workdir / "api.log").start()
    worker = WorkerProcess(env, "commands0", workdir).start()
    reader = redis_server.client()
    worker.wait_state(reader, "ready", timeout=120)
    reader.ping()
    connection = reader.connection_pool.get_connection()
    ignored = {connection._sock.getsockname()[1]}
    reader.connection_pool.release(connection)
    monitor = Monitor(redis.Redis(port=redis_server.port, decode_responses=True), ignored).start()
    http = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    body = {"instruction": "A calm voice reads the weather.", "gen_seconds": GEN_SECONDS, "num_inference_steps": STEPS}

    def finished(job_ids: list[str]) -> bool:
        pipe = reader.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(f"auk:job:{job_id}", "status")
        return all(status in ("succeeded", "failed", "canceled") for status in pipe.execute())

    def wait(job_ids: list[str], timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not finished(job_ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs not finished in {timeout:.0f} s")
            time.sleep(0.2)

    def singles() -> None:
        ids = []
        for _ in range(jobs):
            response = http.post("/v1/jobs", json=body)
            response.raise_for_status()
            ids.append(response.json()["id"])
        wait(ids)

    def batch() -> None:
        lines = "\n".join(json.dumps({**body, "custom_id": f"line-{i}"}) for i in range(jobs))
        created = http.post("/v1/batches", content=lines, headers={"Content-Type": "application/x-ndjson"})
        created.raise_for_status()
        batch_id = created.json()["id"]
        deadline = time.monotonic() + 600
        while not reader.hget(f"auk:batch:{batch_id}", "manifest_key"):
            if time.monotonic() > deadline:
                raise TimeoutError("the batch did not finish")
            time.sleep(0.2)

    try:
        time.sleep(2.0)  # the monitor is attached; start-up traffic has settled
        total0, _, idle0, _ = monitor.snapshot()
        time.sleep(idle_s)
        total1, _, idle1, _ = monitor.snapshot()
        idle_rate = (total1 - total0) / idle_s
        results = {"idle": {"seconds": idle_s, "commands_per_second": round(idle_rate, 1),
                            "by_pattern_per_second": {k: round(v / idle_s, 2)
                                                      for k, v in (idle1 - idle0).most_common(16)}}}  # fmt: skip
        results["jobs"] = _phase(monitor, singles, idle_rate, jobs)
        results["batch"] = _phase(monitor, batch, idle_rate, jobs)
    finally:
        monitor._stop = True
        http.close()
        worker.terminate(timeout=20)
        api.stop()
        s3.stop()
        redis_server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_commands", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100, help="jobs per phase (default 100)")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of the idle baseline (default 10)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="auk-redis-commands-") as tmp:
        results = run(args.jobs, args.idle, Path(tmp))
    record = {"benchmark": "redis_commands", "commit": commit(), "date": datetime.now(timezone.utc).isoformat(),
              "machine": "cpu", "pipeline": "instant", "gen_seconds": GEN_SECONDS, "steps": STEPS,
              "step_delay_s": STEP_DELAY_S, **results}  # fmt: skip
    print(json.dumps(record, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"redis-commands-{record['commit']}-{datetime.now(timezone.utc):%Y-%m-%d}.json"
    (args.out / name).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
