"""The worker probe (``python -m auk_worker.service.ops.probe``): its verdicts on heartbeats, and the real command run
as the kubelet runs it, against a real redis-server, on heartbeats written by ``Heartbeat`` and by a real worker."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis

from auk_worker.service.records.workers import heartbeat_key
from auk_worker.service.worker.heartbeat import Heartbeat
from auk_worker.service.records.jobs import JobStatus
from auk_dev.local import REPO, free_port
from auk_worker.service.ops.probe import judge
from tests.service.test_worker import submit, wait_for

NOW = 1_000_000.0


def beat(state: str, age: float = 1.0, **fields: str) -> dict[str, str]:
    return {"state": state, "ts": f"{NOW - age:.3f}", "variant": "base", "job_id": "", "error": "", **fields}


@pytest.mark.parametrize(
    ("heartbeat", "ready", "live"),
    [
        (beat("ready"), True, True),
        (beat("busy", job_id="j1"), True, True),
        (beat("starting"), False, True),
        (beat("failed", error="ConfigError: no checkpoint"), False, False),
        (beat("ready", age=16.0), False, False),
        (beat("busy", age=40.0), False, False),
        ({}, False, False),
        (beat("ready", ts="yesterday"), False, False),
    ],
    ids=["ready", "busy", "starting", "failed", "stale-ready", "stale-busy", "missing", "bad-ts"],
)
def test_verdicts(heartbeat: dict[str, str], ready: bool, live: bool) -> None:
    assert judge(heartbeat, NOW, 15.0, live=False).ok is ready
    assert judge(heartbeat, NOW, 15.0, live=True).ok is live


def test_verdicts_say_why() -> None:
    failed = beat("failed", error="ConfigError: no checkpoint")
    assert "ConfigError: no checkpoint" in judge(failed, NOW, 15, False).reason
    assert "stale" in judge(beat("ready", age=20), NOW, 15, False).reason
    assert "starting" in judge(beat("starting"), NOW, 15, False).reason
    assert "job j1" in judge(beat("busy", job_id="j1"), NOW, 15, False).reason


def run_probe(redis_url: str, worker_id: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUK_")}
    env["AUK_REDIS_URL"] = redis_url
    if worker_id is not None:
        env["AUK_WORKER_ID"] = worker_id
    return subprocess.run([sys.executable, "-m", "auk_worker.service.ops.probe", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=30)  # fmt: skip


def test_probe_command_follows_a_real_heartbeat(redis_server, redis_client: redis.Redis) -> None:
    assert run_probe(redis_server.url, "w-probe").returncode == 1  # nothing written yet
    heartbeat = Heartbeat(redis_client, "w-probe", "base").start()
    try:
        starting = run_probe(redis_server.url, "w-probe")
        assert starting.returncode == 1 and "starting" in starting.stdout
        assert run_probe(redis_server.url, "w-probe", "--live").returncode == 0
        heartbeat.set("ready")
        time.sleep(0.2)  # the heartbeat thread writes a state change at once, off the caller's thread
        ready = run_probe(redis_server.url, "w-probe")
        assert ready.returncode == 0 and "w-probe: ready" in ready.stdout
        own = run_probe(redis_server.url, None)  # no id given: the one heartbeat that names this host
        assert own.returncode == 0 and "w-probe: ready" in own.stdout
        heartbeat.set("busy", job_id="job-1")
        time.sleep(0.2)
        busy = run_probe(redis_server.url, "w-probe")
        assert busy.returncode == 0 and "job job-1" in busy.stdout
        other = run_probe(redis_server.url, "w-other")  # another worker's probe never reads this heartbeat
        assert other.returncode == 1 and "no heartbeat" in other.stdout
    finally:
        heartbeat.stop(remove=True)
    gone = run_probe(redis_server.url, "w-probe", "--live")
    assert gone.returncode == 1 and "no heartbeat" in gone.stdout


def test_probe_command_refuses_a_stale_or_failed_heartbeat(redis_server, redis_client: redis.Redis) -> None:
    key = heartbeat_key("w-stale")
    redis_client.hset(key, mapping={"state": "busy", "ts": f"{time.time() - 30:.3f}", "job_id": "j"})
    for args in ((), ("--live",)):
        stale = run_probe(redis_server.url, "w-stale", *args)
        assert stale.returncode == 1 and "stale" in stale.stdout
    assert run_probe(redis_server.url, "w-stale", "--max-age", "60").returncode == 0
    redis_client.hset(key, mapping={"state": "failed", "ts": f"{time.time():.3f}", "error": "OSError: no GPU"})
    failed = run_probe(redis_server.url, "w-stale", "--live")
    assert failed.returncode == 1 and "OSError: no GPU" in failed.stdout


def test_probe_command_without_redis() -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"
    unready = run_probe(closed, "w-x")
    assert unready.returncode == 1 and "redis unreachable" in unready.stdout
    live = run_probe(closed, "w-x", "--live")  # a Redis outage restarts no worker
    assert live.returncode == 0 and "redis unreachable" in live.stdout



def test_probe_without_identity_and_no_heartbeat_of_this_host(redis_server, redis_client: redis.Redis) -> None:
    redis_client.hset(heartbeat_key("w-elsewhere"), mapping={"state": "ready", "ts": f"{time.time():.3f}",
                                                             "host": "another-host"})  # fmt: skip
    redis_client.sadd("auk:workers", "w-elsewhere")
    anonymous = run_probe(redis_server.url, None)
    assert anonymous.returncode == 1 and "AUK_WORKER_ID" in anonymous.stdout


def test_probe_imports_no_torch() -> None:
    code = "import sys, auk_worker.service.ops.probe; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_probe_on_a_real_worker_ready_busy_and_gone(start_worker, store, settings, redis_server, redis_client) -> None:
    worker = start_worker("w-probe-real", AUK_INSTANT_STEP_DELAY="0.1")
    worker.wait_state(redis_client, "ready", timeout=60)
    assert run_probe(redis_server.url, "w-probe-real").returncode == 0
    job = submit(store, settings, num_inference_steps=60)  # about 6 s of rendering
    wait_for(store, job.id, lambda r: (r.progress or {}).get("step", 0) >= 2, 20, "step 2")
    time.sleep(3)  # longer than a heartbeat interval: the thread keeps writing while the job runs
    for args in ((), ("--live",)):
        busy = run_probe(redis_server.url, "w-probe-real", *args)
        assert busy.returncode == 0 and f"busy, job {job.id}" in busy.stdout, busy.stdout
    assert worker.terminate(timeout=60) == 0  # warm shutdown: the job finishes, the heartbeat is removed
    assert store.get(job.id).status == JobStatus.SUCCEEDED
    assert run_probe(redis_server.url, "w-probe-real", "--live").returncode == 1
