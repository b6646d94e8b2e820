"""``make run`` end to end: ``python -m auk_dev.demo --once`` in a temporary directory on a free API port.

The demo starts its own redis-server, SeaweedFS, worker (tiny checkpoint) and API, renders its batch through the
REST API and stops everything. The test checks the exit status, that every WAV the demo reports exists locally
with the length its request asked for, that the same keys are in the summary it writes, and that no child
process outlives it (found by the API port in their inherited environment).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import soundfile as sf

from auk_dev.local import GRPC_OFFSET, REPO, RedisServer, free_port

REPORTED = re.compile(r"^\s+(demo-\d+): (\S+\.wav) \(([\d.]+) s\) = s3://(\S+?)/(\S+\.wav)$", re.MULTILINE)


def _processes_with_env(marker: str) -> list[int]:
    """PIDs whose environment holds ``marker`` (every child of the demo inherits the test's AUK_API_PORT)."""
    needle = marker.encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_demo_once_renders_the_batch_and_stops_everything(tmp_path: Path) -> None:
    """Also: a redis-server an earlier run left on ./run/redis (its supervisor killed) is found and stopped before
    the demo starts its own on the same append-only directory."""
    stray = RedisServer(tmp_path / "run" / "redis", persist=True, fsync="everysec").start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUK_")}  # tiny checkpoint, demo settings
    port_marker = f"AUK_API_PORT={free_port()}"
    env.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    env["AUK_API_PORT"] = port_marker.split("=")[1]
    proc = subprocess.Popen([sys.executable, "-m", "auk_dev.demo", "--once", "--workdir", str(tmp_path / "run")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stray.stop()
    assert proc.returncode == 0, output[-4000:]
    assert _processes_with_env(port_marker) == []  # redis-server, weed, the worker and the API all stopped
    assert f"found redis-server (pid {stray.proc.pid}) still running on {tmp_path / 'run' / 'redis'}" in output
    assert stray.proc.returncode is not None and not _alive(stray.proc.pid)
    logs = next(line for line in output.splitlines() if line.startswith("logs "))
    assert "redis/redis.log" in logs and "s3/weed.log" in logs, logs
    for name in ("API", "worker", "SeaweedFS", "redis-server"):  # each named as it is stopped, and how
        assert re.search(rf"stopping (the )?{name} \(pid \d+\): SIGTERM", output), (name, output[-3000:])
        how = r"exit status -?\d+|shut down on SIGTERM|killed \(SIGKILL\)"
        assert re.search(rf"^  {name} stopped \(({how})\)$", output, re.MULTILINE), (name, output[-3000:])
    assert "  worker stopped (exit status 0)" in output and "  redis-server stopped (exit status 0)" in output

    reported = REPORTED.findall(output)
    assert [r[0] for r in reported] == ["demo-1", "demo-2", "demo-3", "demo-4"], output[-4000:]
    assert "noise" in output  # the tiny checkpoint says what its audio is

    summary = json.loads((tmp_path / "run" / "out" / "demo-results.json").read_text())
    by_id = {entry["custom_id"]: entry for entry in summary if "custom_id" in entry}
    for custom_id, path, seconds, bucket, key in reported:
        wav = Path(path)
        assert wav.parent == tmp_path / "run" / "out"
        info = sf.info(str(wav))
        gen_seconds = by_id[custom_id]["gen_seconds"]
        assert math.isclose(float(seconds), gen_seconds)
        assert info.samplerate == 24_000 and info.channels == 1
        assert info.frames == math.ceil(50 * gen_seconds) * 480
        assert (bucket, key) == (by_id[custom_id]["bucket"], by_id[custom_id]["key"])
        assert key.startswith("demo/jobs/")

    manifest = [entry for entry in summary if "manifest" in entry]
    assert len(manifest) == 1
    lines = [json.loads(line) for line in Path(manifest[0]["manifest"]).read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["demo-1", "demo-2", "demo-3", "demo-4"]
    assert all(line["status"] == "succeeded" for line in lines)
    assert {line["key"] for line in lines} == {r[4] for r in reported}

    credentials = (tmp_path / "run" / "demo.env").read_text()
    assert "AUK_API_KEY=auk-demo-" in credentials
    assert oct((tmp_path / "run" / "demo.env").stat().st_mode & 0o777) == "0o600"


class _Output:
    """The demo's stdout, read on a thread so that the test can wait for a line while it runs."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in self.lines):
            assert time.monotonic() < deadline, f"no {needle!r} in the demo's output:\n{self.text()[-4000:]}"
            time.sleep(0.1)


def _wait_status(status_path: Path, child: str, restarts: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = json.loads(status_path.read_text())["children"][child]
        if status["restarts"] >= restarts and status["running"]:
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


def _render(http: httpx.Client, seed: int) -> dict:
    job = http.post("/v1/jobs", json={"instruction": "Hello.", "gen_seconds": 1.0, "num_inference_steps": 4,
                                      "seed": seed}).raise_for_status().json()  # fmt: skip
    deadline = time.monotonic() + 60
    while job["status"] not in ("succeeded", "failed", "canceled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
        job = http.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
    return job


def test_demo_uses_the_users_settings_and_restarts_what_dies(tmp_path: Path) -> None:
    """``make run`` with the user's key and port: the key works (and no other); the worker killed by SIGKILL comes
    back and renders the next job; Redis killed by SIGKILL comes back from its append-only file with every record."""
    port = free_port()
    user_key = "my-own-key-0123456789"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUK_")}
    env.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "AUK_API_PORT": str(port),
                "AUK_API_KEYS": f"{user_key},second-key-0123456789", "AUK_PIPELINE": "instant",
                "AUK_S3_PREFIX": "mine", "AUK_LOG_FORMAT": "text"})  # fmt: skip
    workdir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "auk_dev.demo", "--workdir", str(workdir)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out = _Output(proc)
    try:
        out.wait_for("the service keeps running", timeout=120)
        text = out.text()
        assert "settings from your environment: AUK_API_KEYS, AUK_API_PORT, AUK_LOG_FORMAT, AUK_PIPELINE" in text
        made_up = next(line for line in out.lines if line.startswith("settings made up"))
        assert "AUK_API_KEYS" not in made_up and "AUK_S3_PREFIX" not in made_up and "AUK_S3_BUCKET" in made_up
        assert f"API key    {user_key}" in text and "auk-demo-" not in text
        assert f"AUK_API_KEY={user_key}" in (workdir / "demo.env").read_text()
        assert re.search(r"= s3://auk/mine/jobs/\w+\.wav", text), text[-3000:]  # the user's prefix
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/jobs", headers={"Authorization": "Bearer not-a-key"}).status_code == 401
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {user_key}"}, timeout=30) as http:
            assert http.get("/v1/jobs").status_code == 200
            before = _render(http, seed=1)
            assert before["status"] == "succeeded"

            status_path = workdir / "status.json"
            worker = json.loads(status_path.read_text())["children"]["worker"]
            os.kill(worker["pid"], signal.SIGKILL)
            back = _wait_status(status_path, "worker", restarts=1, timeout=30)
            assert back["pid"] != worker["pid"] and back["last_exit"] == -signal.SIGKILL
            out.wait_for("supervisor: worker restarted", timeout=5)
            out.wait_for("status: redis up (restarts 0), storage up (restarts 0), worker up (restarts 1)", timeout=5)
            assert _render(http, seed=2)["status"] == "succeeded"  # the restarted worker takes jobs

            time.sleep(1.5)  # the append-only file is fsynced every second
            redis_pid = json.loads(status_path.read_text())["children"]["redis"]["pid"]
            os.kill(redis_pid, signal.SIGKILL)
            _wait_status(status_path, "redis", restarts=1, timeout=30)
            again = http.get(f"/v1/jobs/{before['id']}")
            assert again.status_code == 200 and again.json()["status"] == "succeeded"
            assert again.json()["result"]["key"] == before["result"]["key"]
            assert _render(http, seed=3)["status"] == "succeeded"  # the worker and the API found Redis again
        assert (workdir / "redis" / "appendonlydir").is_dir()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.thread.join(timeout=5)
    assert proc.returncode == 0, out.text()[-4000:]
    assert "status: redis up (restarts 1), storage up (restarts 0), worker up (restarts 1), api up (restarts 0)" \
        in out.text()  # fmt: skip
    assert _processes_with_env(f"AUK_API_PORT={port}") == []


def test_demo_lists_only_what_it_started_on_the_ports_it_was_given(tmp_path: Path, redis_server) -> None:
    """``make run`` with the user's Redis (``AUK_REDIS_URL``) and a chosen S3 port: no redis-server is started,
    stopped or listed among the logs; SeaweedFS listens on the port given."""
    s3_port = free_port(also_free_offset=GRPC_OFFSET)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUK_")}
    env.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "AUK_API_PORT": str(free_port()),
                "AUK_PIPELINE": "instant", "AUK_REDIS_URL": redis_server.url})  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "auk_dev.demo", "--once", "--workdir", str(tmp_path / "run"),
                             "--s3-port", str(s3_port)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-4000:]
    assert f"started SeaweedFS S3 on http://127.0.0.1:{s3_port} " in output, output[-3000:]
    logs = next(line for line in output.splitlines() if line.startswith("logs "))
    assert "redis" not in logs and "s3/weed.log" in logs, logs
    assert "redis-server" not in output and not (tmp_path / "run" / "redis").exists()


def test_a_run_stopped_hard_is_cleaned_up_by_the_next(tmp_path: Path) -> None:
    """``make run`` killed with SIGKILL leaves its children running (each in its own session); the next ``make run``
    on the same directory finds them by the mark in their environment, stops them (API and worker first, Redis
    last) and runs on its own servers; none of the first run's processes is left."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUK_")}
    env.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "AUK_API_PORT": str(port),
                "AUK_PIPELINE": "instant"})  # fmt: skip
    workdir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "auk_dev.demo", "--workdir", str(workdir)], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out = _Output(first)
    try:
        out.wait_for("the service keeps running", timeout=120)
    finally:
        first.kill()  # the supervisor dies; its children do not
        first.wait()
    left = json.loads((workdir / "status.json").read_text())["children"]
    assert all(_alive(child["pid"]) for child in left.values()), left
    second = subprocess.run([sys.executable, "-m", "auk_dev.demo", "--once", "--workdir", str(workdir)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-4000:]
    # redis-server rewrites the memory its environment was in (its process title): it is found by its directory
    found = re.findall(r"found (\S+) \(pid (\d+)\) (?:of an earlier run|still running) on", output)
    assert {int(pid) for _, pid in found} == {child["pid"] for child in left.values()}, (found, left)
    assert [name for name, _ in found][-2:] in (["weed", "redis-server"], ["redis-server", "weed"])  # servers last
    assert not any(_alive(child["pid"]) for child in left.values())
    assert _processes_with_env(f"AUK_API_PORT={port}") == []
