"""Celery's own operations tools against a live worker: ``celery inspect`` (remote control), task events, and
Flower (what docker-compose's ``flower`` service runs), each as an operator would run it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx

from auk_worker.service.queues.celery_app import make_celery
from auk_worker.service.records.jobs import JobStatus
from auk_dev.local import _python_env
from tests.service.harness import REPO, free_port, stop_process, wait_until
from tests.service.test_worker import submit, wait_for, wait_terminal

APP = "auk_worker.service.queues.celery_app"


def celery_cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP, *args], env=_python_env(env), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_inspect_ping_is_answered_by_a_worker_between_jobs(start_worker, service_env, store, settings,
                                                            redis_client) -> None:  # fmt: skip
    worker = start_worker("w-ping")
    worker.wait_state(redis_client, "ready", timeout=60)
    assert wait_terminal(store, submit(store, settings).id).status == JobStatus.SUCCEEDED  # now between jobs

    ping = celery_cli(service_env, "inspect", "ping", "-d", "auk@w-ping", "--timeout", "10")
    assert ping.returncode == 0, ping.stdout + ping.stderr
    assert "auk@w-ping: OK" in ping.stdout and "pong" in ping.stdout, ping.stdout
    queues = celery_cli(service_env, "inspect", "active_queues", "-d", "auk@w-ping", "--timeout", "10")
    assert queues.returncode == 0 and "auk.base.interactive" in queues.stdout and "auk.base.bulk" in queues.stdout


def test_worker_and_api_side_send_task_events(start_worker, store, settings, redis_client) -> None:
    """A real event receiver (what Flower and ``celery events`` run) sees the worker's heartbeats and one job from
    ``task-sent`` (the sender's side) to ``task-succeeded``."""
    app = make_celery(settings)
    seen: list[dict] = []
    connection = app.connection_for_read()
    receiver = app.events.Receiver(connection, handlers={"*": seen.append})
    thread = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None, "wakeup": True},
                              daemon=True)  # fmt: skip
    thread.start()
    try:
        worker = start_worker("w-events")
        worker.wait_state(redis_client, "ready", timeout=60)
        wait_until("a heartbeat event", lambda: any(e["type"] == "worker-heartbeat" and e["hostname"] == "auk@w-events"
                                                    for e in list(seen)), 20)  # fmt: skip
        job = submit(store, settings, gen_seconds=0.3)
        assert wait_terminal(store, job.id).status == JobStatus.SUCCEEDED

        def job_events() -> list[str]:
            sent = [e for e in list(seen) if e["type"] == "task-sent" and job.id in str(e.get("args"))]
            return [e["type"] for e in list(seen) if sent and e.get("uuid") == sent[0]["uuid"]]

        wait_until("task events", lambda: "task-succeeded" in job_events(), 10)
        assert job_events() == ["task-sent", "task-received", "task-started", "task-succeeded"]
        received = next(e for e in seen if e["type"] == "task-received" and job.id in str(e.get("args")))
        assert received["hostname"] == "auk@w-events" and received["name"] == "auk.render"
    finally:
        receiver.should_stop = True
        thread.join(timeout=10)
        connection.release()


def test_flower_shows_the_worker_behind_basic_auth(start_worker, service_env, store, settings, redis_client,
                                                   tmp_path) -> None:  # fmt: skip
    """``celery -A auk_worker.service.queues.celery_app flower`` (the compose service's command) with basic auth from the
    environment: 401 without credentials; with them the worker and its finished task are listed."""
    port = free_port()
    env = {**service_env, "FLOWER_BASIC_AUTH": "ops:flower-test-secret"}
    with open(tmp_path / "flower.log", "wb") as out:
        flower = subprocess.Popen([sys.executable, "-m", "celery", "-A", APP, "flower", "--address=127.0.0.1",
                                   f"--port={port}"], env=_python_env(env), cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until("flower", lambda: httpx.get(f"{url}/healthcheck", timeout=1).status_code == 200, 60, flower,
                   tmp_path / "flower.log")  # fmt: skip
        worker = start_worker("w-flower")
        worker.wait_state(redis_client, "ready", timeout=60)
        job = submit(store, settings, gen_seconds=0.3)
        assert wait_terminal(store, job.id).status == JobStatus.SUCCEEDED
        assert httpx.get(f"{url}/api/workers", timeout=10).status_code == 401
        auth = ("ops", "flower-test-secret")

        def task_listed() -> bool:
            tasks = httpx.get(f"{url}/api/tasks", auth=auth, timeout=10).json()
            return any(job.id in str(t.get("args")) and t.get("state") == "SUCCESS" for t in tasks.values())

        wait_until("the task in flower", task_listed, 20)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # "online" comes from the worker's heartbeat events
            listed = httpx.get(f"{url}/workers", params={"json": "1"}, auth=auth, timeout=10).json()["data"]
            if any(w["hostname"] == "auk@w-flower" and w["status"] for w in listed):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"flower does not show auk@w-flower online: {listed}")

        def inspected() -> bool:  # Flower's inspect (remote control) answers land a moment after the refresh
            httpx.get(f"{url}/api/workers", params={"refresh": "1"}, auth=auth, timeout=30)
            workers = httpx.get(f"{url}/api/workers", auth=auth, timeout=10).json()
            return "auk.base.bulk" in str(workers.get("auk@w-flower", {}).get("active_queues"))

        wait_until("flower's inspect of the worker", inspected, 20)
    finally:
        stop_process(flower)


def test_a_rendering_worker_answers_ping_and_flower_sees_it_started(start_worker, service_env, store, settings,
                                                                   redis_client, tmp_path) -> None:  # fmt: skip
    """While a job renders (the instant pipeline slowed to about 12 s): ``inspect ping`` is answered, Flower shows
    the worker online through its heartbeat events and the task STARTED from its ``task-started`` event, sent when
    the render began; the worker still renders one job at a time (a second job waits, queued)."""
    port = free_port()
    with open(tmp_path / "flower.log", "wb") as out:
        flower = subprocess.Popen([sys.executable, "-m", "celery", "-A", APP, "flower", "--address=127.0.0.1",
                                   f"--port={port}"], env=_python_env({**service_env, "FLOWER_UNAUTHENTICATED_API": "1"}),
                                  cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until("flower", lambda: httpx.get(f"{url}/healthcheck", timeout=1).status_code == 200, 60, flower,
                   tmp_path / "flower.log")  # fmt: skip
        worker = start_worker("w-busy", AUK_INSTANT_STEP_DELAY="0.04")
        worker.wait_state(redis_client, "ready", timeout=60)
        job = submit(store, settings, num_inference_steps=300)
        second = submit(store, settings, num_inference_steps=2)
        running = wait_for(store, job.id, lambda r: r.status == JobStatus.RUNNING and r.progress, 20, "running")
        began = time.time()

        def task_started() -> bool:
            tasks = httpx.get(f"{url}/api/tasks", timeout=10).json()
            return any(job.id in str(t.get("args")) and t.get("state") == "STARTED" for t in tasks.values())

        wait_until("the task STARTED in flower", task_started, 10)
        task = next(t for t in httpx.get(f"{url}/api/tasks", timeout=10).json().values() if job.id in str(t["args"]))
        assert task["started"] is not None and task["started"] <= began + 1, (task, began)

        ping = celery_cli(service_env, "inspect", "ping", "-d", "auk@w-busy", "--timeout", "5")
        assert ping.returncode == 0 and "pong" in ping.stdout, ping.stdout + ping.stderr
        listed = httpx.get(f"{url}/workers", params={"json": "1"}, timeout=10).json()["data"]
        assert any(w["hostname"] == "auk@w-busy" and w["status"] for w in listed), listed
        assert store.get(second.id).status == JobStatus.QUEUED  # one render at a time
        now = store.get(job.id)
        assert now.status == JobStatus.RUNNING and now.progress != running.progress, "the render went on meanwhile"
        assert wait_terminal(store, job.id, timeout=60).status == JobStatus.SUCCEEDED
        assert wait_terminal(store, second.id, timeout=30).status == JobStatus.SUCCEEDED
    finally:
        stop_process(flower)
