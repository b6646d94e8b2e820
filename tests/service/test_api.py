"""The REST API end to end: the real API (``python -m api`` under uvicorn) over HTTP on a loopback port, with the
session's redis-server and SeaweedFS, and real worker processes (the tiny checkpoint for renders, the instant
pipeline for the Flash queue). Assertions read what the job records, the queues and the bucket hold.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import soundfile as sf

from auk_client import Client
from auk_worker.service.records.jobs import owner_id
from tests.service.conftest import BUCKET
from tests.service.harness import (
    REPO,
    RedisServer,
    S3Server,
    WorkerProcess,
    _stop,
    _wait,
    connection_env,
    free_port,
)

KEY_A, KEY_B, KEY_C = "key-alpha-0123456789", "key-bravo-0123456789", "key-charlie-0123456789"
PREFIX = "test-api"
INPUTS = "inputs/"  # the operator's input location in the bucket: audio.key is relative to it
MAX_UPLOAD = 256 * 1024
SR = 24_000
HOP = 480


@dataclass
class Service:
    url: str
    env: dict[str, str]
    redis: redis.Redis
    s3: S3Server
    worker: WorkerProcess
    logdir: Path

    def client(self, key: str | None = KEY_A) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def job_keys(self) -> set[str]:
        return set(self.redis.scan_iter("auk:job:*"))


def _api_process(env: dict[str, str], log: Path) -> subprocess.Popen:
    full = {**os.environ, **env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "api"], stdout=out, stderr=subprocess.STDOUT, env=full,
                                cwd=REPO)  # fmt: skip


@pytest.fixture(scope="module")
def service(
    redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """One API process and one worker on the tiny checkpoint, shared by this module's tests."""
    logdir = tmp_path_factory.mktemp("api")
    port = free_port()
    env = connection_env(
        redis_server, s3_server, S3_BUCKET=BUCKET, S3_PREFIX=PREFIX, VARIANT="base", PIPELINE="auk",
        CHECKPOINT=str(tiny_checkpoint), DEPLOY_CONFIG=str(REPO / "config" / "auk.yaml"), VISIBILITY_TIMEOUT="60",
        RETRY_BACKOFF="0.5", S3_INPUT_BUCKET=BUCKET, S3_INPUT_PREFIX=INPUTS,
    )
    client = redis_server.client()
    client.flushdb()
    # AUK_VARIANT_CHECK=off: test_cancel_a_queued_job_is_never_rendered queues a Flash job before any Flash worker
    # runs (test_recovery.py tests the refusal itself).
    api_env = {**env, "AUK_API_KEYS": f"{KEY_A},{KEY_B},{KEY_C}", "AUK_API_PORT": str(port),
               "AUK_MAX_UPLOAD_BYTES": str(MAX_UPLOAD), "AUK_VARIANT_CHECK": "off"}  # fmt: skip
    api = _api_process(api_env, logdir / "api.log")
    worker = WorkerProcess(env, "api-tiny", logdir).start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait("API", lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, 60, api, logdir / "api.log")
        worker.wait_state(client, "ready", timeout=120)
        yield Service(url=url, env=env, redis=client, s3=s3_server, worker=worker, logdir=logdir)
    finally:
        worker.terminate(timeout=20)
        _stop(api)
        client.close()


def wait_job(svc: Service, job_id: str, key: str = KEY_A, timeout: float = 90.0) -> dict:
    with svc.client(key) as http:
        deadline = time.monotonic() + timeout
        while True:
            job = http.get(f"/v1/jobs/{job_id}").json()
            if job["status"] in ("succeeded", "failed", "canceled"):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {job['status']}:\n{svc.worker.log_tail()}")
            time.sleep(0.1)


def fetch_wav(url: str) -> tuple[np.ndarray, int]:
    response = httpx.get(url, timeout=30)  # presigned: no credentials besides the URL's own signature
    assert response.status_code == 200, response.text
    samples, rate = sf.read(io.BytesIO(response.content), dtype="float32")
    return samples, rate


def wav_bytes(seconds: float, rate: int = 16_000, channels: int = 1, amplitude: float = 0.2) -> bytes:
    """A tone; 16-bit PCM, or float samples when ``amplitude`` is past full scale."""
    t = np.arange(int(seconds * rate)) / rate
    tone = (amplitude * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    buf = io.BytesIO()
    subtype = "PCM_16" if amplitude <= 1.0 else "FLOAT"
    sf.write(buf, np.repeat(tone[:, None], channels, axis=1), rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def expected_samples(seconds: float) -> int:
    return math.ceil(50 * seconds) * HOP


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


# ------------------------------------------------------------------------------------------------------- tests


def test_api_does_not_import_torch() -> None:
    code = ("import sys, api.app, api.routes.jobs, api.routes.batches, api.routes.uploads, auk_client.cli; "
            "print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_batch_is_done_only_once_its_manifest_is_stored() -> None:
    """Between the last job's end and the manifest's upload the batch is ``finishing``: a caller who polls for
    ``done`` always finds the manifest linked."""
    from api.errors import batch_state

    counts = {"queued": 0, "running": 1, "succeeded": 2, "failed": 1, "canceled": 0}
    assert batch_state(counts, 4, manifest_stored=False) == "running"
    ended = {**counts, "running": 0, "canceled": 1}
    assert batch_state(ended, 4, manifest_stored=False) == "finishing"
    assert batch_state(ended, 4, manifest_stored=True) == "done"


def test_one_error_family_maps_to_the_statuses() -> None:
    """Every caller fault is an InputError; api/errors.py maps each class (or its nearest mapped ancestor)."""
    from api.errors import status_for_error
    from auk_worker import errors

    statuses = {cls.__name__: status_for_error(cls("x")) for cls in (
        errors.MalformedBody, errors.Unauthorized, errors.NotFound, errors.Conflict, errors.TooLarge,
        errors.UnsupportedMediaType, errors.InputError, errors.AudioError, errors.InfraError, errors.ModelError)}
    assert statuses == {"MalformedBody": 400, "Unauthorized": 401, "NotFound": 404, "Conflict": 409, "TooLarge": 413,
                        "UnsupportedMediaType": 415, "InputError": 422, "AudioError": 422, "InfraError": 503,
                        "ModelError": 500}  # fmt: skip
    assert all(issubclass(cls, errors.InputError) for cls in (errors.MalformedBody, errors.Unauthorized,
               errors.NotFound, errors.Conflict, errors.TooLarge, errors.UnsupportedMediaType))  # fmt: skip


def test_api_refuses_to_start_without_keys(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUK_")}
    env.update({"PYTHONPATH": str(REPO), "AUK_S3_ENDPOINT": "http://127.0.0.1:9", "AUK_S3_ACCESS_KEY": "a",
                "AUK_S3_SECRET_KEY": "b", "AUK_API_PORT": str(free_port())})  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "api"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "AUK_API_KEYS" in out.stderr


def test_dependencies_down_is_503_not_500() -> None:
    """Redis and storage unreachable: readiness says which, and a request gets 503 with the cause, never a 500."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from auk_worker.service.connect.settings import Settings

    dead = f"127.0.0.1:{free_port()}"
    settings = Settings.from_env({"AUK_REDIS_URL": f"redis://{dead}/0", "AUK_S3_ENDPOINT": f"http://{dead}",
                                  "AUK_S3_ACCESS_KEY": "a", "AUK_S3_SECRET_KEY": "b", "AUK_API_KEYS": KEY_A})  # fmt: skip
    auth = {"Authorization": f"Bearer {KEY_A}"}
    with TestClient(create_app(settings), raise_server_exceptions=False) as http:
        ready = http.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["redis"] is False and ready.json()["storage"] is False
        job = http.post("/v1/jobs", json={"instruction": "x", "gen_seconds": 1}, headers=auth)
        assert job.status_code == 503 and "Redis" in error_of(job)["message"]
        assert job.headers["Retry-After"] == "5"
        upload = http.post("/v1/uploads", files={"file": ("a.wav", wav_bytes(0.5), "audio/wav")}, headers=auth)
        assert upload.status_code == 503 and "storage" in error_of(upload)["message"]


def test_health_readiness_and_docs(service: Service) -> None:
    with service.client(None) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        ready = http.get("/readyz")
        assert ready.status_code == 200
        body = ready.json()
        assert body["redis"] is True and body["storage"] is True
        assert body["workers_ready"] >= 1
        assert any(w["id"] == "api-tiny" and w["state"] in ("ready", "busy") for w in body["workers"])
        assert all(set(w) == {"id", "state", "variant", "age_s"} for w in body["workers"])  # never a job id
        assert http.get("/docs").status_code == 200
        paths = http.get("/openapi.json").json()["paths"]
        assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/batches", "/v1/uploads"} <= set(paths)
        refused = http.get("/v1/jobs")
        assert refused.status_code == 401 and "bearer" in error_of(refused)["message"].lower()
        wrong = http.get("/v1/jobs", headers={"Authorization": "Bearer not-a-key"})
        assert wrong.status_code == 401


def test_job_renders_a_wav_of_the_right_length(service: Service) -> None:
    with service.client() as http:
        created = http.post("/v1/jobs", json={"instruction": "Say hello slowly.", "gen_seconds": 1.3, "seed": 7,
                                              "num_inference_steps": 4})  # fmt: skip
        assert created.status_code == 202, created.text
        job = created.json()
        assert job["status"] == "queued" and job["request"]["gen_seconds"] == 1.3
    # The record exists before the task runs, on the interactive queue of its variant.
    assert service.redis.hget(f"auk:job:{job['id']}", "queue") == "auk.base.interactive"
    done = wait_job(service, job["id"])
    assert done["status"] == "succeeded", done["error"]
    result = done["result"]
    assert result["bucket"] == BUCKET and result["key"] == f"{PREFIX}/jobs/{job['id']}.wav"
    assert result["sample_rate"] == SR and result["seed"] == 7
    assert done["progress"] == {"step": 4, "total": 4}
    samples, rate = fetch_wav(result["url"])
    assert rate == SR and samples.ndim == 1 and len(samples) == expected_samples(1.3)
    assert result["duration_s"] == pytest.approx(len(samples) / SR)
    assert np.isfinite(samples).all()


def test_upload_then_job_defaults_to_the_clip_length(service: Service) -> None:
    with service.client() as http:
        up = http.post("/v1/uploads", files={"file": ("ref.wav", wav_bytes(0.8, 16_000, channels=2), "audio/wav")})
        assert up.status_code == 201, up.text
        info = up.json()
        assert info["duration_s"] == pytest.approx(0.8) and info["sample_rate"] == 16_000 and info["channels"] == 2
        stored = service.s3.client().get_object(Bucket=BUCKET, Key=f"{PREFIX}/uploads/{info['upload_id']}")
        assert stored["Body"].read() == wav_bytes(0.8, 16_000, channels=2)  # the original bytes
        job = http.post("/v1/jobs", json={"instruction": "Continue in this voice.", "num_inference_steps": 2,
                                          "audio": {"upload_id": info["upload_id"]}}).json()  # fmt: skip
        # Another key cannot use this upload.
        foreign = service.client(KEY_B).post("/v1/jobs", json={"instruction": "x",
                                                               "audio": {"upload_id": info["upload_id"]}})  # fmt: skip
        assert foreign.status_code == 422 and "upload_id" in error_of(foreign)["message"]
    done = wait_job(service, job["id"])
    assert done["status"] == "succeeded", done["error"]
    samples, _ = fetch_wav(done["result"]["url"])
    assert len(samples) == expected_samples(0.8)


def test_job_from_an_input_bucket_key(service: Service) -> None:
    s3 = service.s3.client()
    s3.put_object(Bucket=BUCKET, Key="inputs/ref-0.5s.flac", Body=_flac(0.5))
    s3.put_object(Bucket=BUCKET, Key="inputs/readme.txt", Body=b"not a sound at all")
    with service.client() as http:
        job = http.post("/v1/jobs", json={"instruction": "Same voice.", "num_inference_steps": 1, "gen_seconds": 0.3,
                                          "audio": {"key": "ref-0.5s.flac"}})  # fmt: skip
        assert job.status_code == 202, job.text
        assert job.json()["request"]["clip"]["duration_s"] == pytest.approx(0.5)
        assert job.json()["request"]["clip"]["key"] == f"{INPUTS}ref-0.5s.flac"
        text = http.post("/v1/jobs", json={"instruction": "x", "audio": {"key": "readme.txt"}})
        assert text.status_code == 422 and "not audio" in error_of(text)["message"]
    done = wait_job(service, job.json()["id"])
    assert done["status"] == "succeeded", done["error"]
    assert len(fetch_wav(done["result"]["url"])[0]) == expected_samples(0.3)


def _flac(seconds: float, rate: int = 22_050) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(seconds * rate), np.float32) + 0.01, rate, format="FLAC")
    return buf.getvalue()


def test_batch_of_twenty_goes_to_done_with_a_manifest(service: Service) -> None:
    lines = [json.dumps({"instruction": f"Line number {i}.", "gen_seconds": 0.1 + 0.01 * i, "custom_id": f"row-{i}",
                         "num_inference_steps": 1, "seed": i}) for i in range(20)]  # fmt: skip
    with service.client() as http:
        created = http.post("/v1/batches", content="\n".join(lines) + "\n",
                            headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
        assert created.status_code == 202, created.text
        batch = created.json()
        assert batch["total"] == 20
        deadline = time.monotonic() + 180
        while (state := http.get(f"/v1/batches/{batch['id']}").json())["status"] != "done":
            assert time.monotonic() < deadline, f"batch stuck at {state['counts']}\n{service.worker.log_tail()}"
            time.sleep(0.2)
        assert state["counts"]["succeeded"] == 20, state
        listed = http.get("/v1/jobs", params={"batch_id": batch["id"], "limit": 50}).json()["data"]
        assert len(listed) == 20 and {job["batch_id"] for job in listed} == {batch["id"]}
        # The batch's jobs went to the bulk queue.
        assert {service.redis.hget(f"auk:job:{job['id']}", "queue") for job in listed} == {"auk.base.bulk"}
    assert state["manifest"]["key"] == f"{PREFIX}/jobs/batch-{batch['id']}.manifest.jsonl"
    manifest_text = httpx.get(state["manifest"]["url"], timeout=30).text
    entries = [json.loads(line) for line in manifest_text.splitlines() if line.strip()]
    assert sorted(e["custom_id"] for e in entries) == sorted(f"row-{i}" for i in range(20))
    s3 = service.s3.client()
    for entry in entries:
        assert entry["status"] == "succeeded" and entry["key"].endswith(".wav")
        body = s3.get_object(Bucket=BUCKET, Key=entry["key"])["Body"].read()
        samples, rate = sf.read(io.BytesIO(body), dtype="float32")
        i = int(entry["custom_id"].split("-")[1])
        assert rate == SR and len(samples) == expected_samples(0.1 + 0.01 * i)


def test_a_batch_posted_again_under_its_idempotency_key_is_the_same_batch(service: Service) -> None:
    lines = "".join(json.dumps({"custom_id": f"n-{i}", "instruction": f"Night line {i}.", "gen_seconds": 0.2,
                                "num_inference_steps": 2}) + "\n" for i in range(3))  # fmt: skip
    jsonl = {"Content-Type": "application/x-ndjson"}
    owner_batches = f"auk:owner:{owner_id(KEY_A)}:batches"
    before = service.redis.zcard(owner_batches)
    with service.client() as http:
        first = http.post("/v1/batches", content=lines, headers={**jsonl, "Idempotency-Key": "night-7"})
        assert first.status_code == 202, first.text
        batch_id = first.json()["id"]
        # Sent again as it was (after a 503 or a dropped connection): the same batch, nothing enqueued twice;
        # two identical posts at once make one batch too.
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda _: http.post("/v1/batches", content=lines,
                                                      headers={**jsonl, "Idempotency-Key": "night-7"}), range(4)))
        assert [r.status_code for r in again] == [200] * 4
        assert {r.json()["id"] for r in again} == {batch_id} and again[0].json()["total"] == 3
        racing = list(ThreadPoolExecutor(4).map(
            lambda _: http.post("/v1/batches", content=lines, headers={**jsonl, "Idempotency-Key": "night-8"}),
            range(4)))  # fmt: skip
        assert sorted(r.status_code for r in racing) == [200, 200, 200, 202], [r.text for r in racing]
        assert len({r.json()["id"] for r in racing}) == 1
        # The same key with other lines, or another webhook, is refused by name.
        changed = http.post("/v1/batches", content=lines.replace("Night line 0", "Day line 0"),
                            headers={**jsonl, "Idempotency-Key": "night-7"})  # fmt: skip
        assert changed.status_code == 422 and error_of(changed)["code"] == "idempotency_key_reused"
        assert batch_id in error_of(changed)["message"]
        hooked = http.post("/v1/batches", content=lines, params={"webhook_url": "https://example.com/hook"},
                           headers={**jsonl, "Idempotency-Key": "night-7"})  # fmt: skip
        assert hooked.status_code == 422 and error_of(hooked)["code"] == "idempotency_key_reused"
    assert service.redis.zcard(owner_batches) == before + 2
    # Another API key's same idempotency key is its own batch; the client library sends the header.
    with Client(service.url, KEY_B) as other:
        theirs = other.create_batch(lines.encode(), idempotency_key="night-7")
        assert theirs.id != batch_id
        assert other.create_batch(lines.encode(), idempotency_key="night-7").id == theirs.id
    with service.client() as http:
        done = _wait_batch(http, batch_id)
    assert done["counts"]["succeeded"] == 3 and done["total"] == 3


def _wait_batch(http: httpx.Client, batch_id: str, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = http.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] == "done":
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not done within {timeout} s: {batch}")


def test_idempotency_key_makes_one_job_and_other_keys_see_nothing(service: Service) -> None:
    body = {"instruction": "Only once.", "gen_seconds": 0.5, "num_inference_steps": 2}
    owner_jobs = f"auk:owner:{owner_id(KEY_A)}:jobs"
    before = service.redis.zcard(owner_jobs)
    with service.client() as http:
        first = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "nightly-42"})
        second = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "nightly-42"})
        assert first.status_code == 202 and second.status_code == 200
        assert first.json()["id"] == second.json()["id"]
        # The same key with a different request is refused by name, not answered with the first job.
        changed = http.post("/v1/jobs", json={**body, "instruction": "Something else."},
                            headers={"Idempotency-Key": "nightly-42"})  # fmt: skip
        assert changed.status_code == 422 and error_of(changed)["code"] == "idempotency_key_reused"
        assert first.json()["id"] in error_of(changed)["message"]
        assert service.redis.zcard(owner_jobs) == before + 1
        job_id = first.json()["id"]
        # The same idempotency key under another API key is another job.
        other = service.client(KEY_B).post("/v1/jobs", json=body, headers={"Idempotency-Key": "nightly-42"})
        assert other.status_code == 202 and other.json()["id"] != job_id
    with service.client(KEY_B) as intruder:
        read = intruder.get(f"/v1/jobs/{job_id}")
        assert read.status_code == 404 and error_of(read)["code"] == "not_found"
        assert job_id not in {job["id"] for job in intruder.get("/v1/jobs", params={"limit": 500}).json()["data"]}
        cancel = intruder.post(f"/v1/jobs/{job_id}/cancel")
        assert cancel.status_code == 404
    assert wait_job(service, job_id)["status"] == "succeeded"  # untouched by the other key's cancel
    assert wait_job(service, other.json()["id"], key=KEY_B)["status"] == "succeeded"


def test_listing_is_newest_first_and_paginated(service: Service) -> None:
    ids = []
    with service.client(KEY_C) as http:
        for i in range(5):
            ids.append(http.post("/v1/jobs", json={"instruction": f"n{i}", "gen_seconds": 0.2,
                                                   "num_inference_steps": 1}).json()["id"])  # fmt: skip
            time.sleep(0.005)
        seen, cursor = [], None
        while True:
            page = http.get("/v1/jobs", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
            assert len(page["data"]) <= 2
            seen.extend(job["id"] for job in page["data"])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == ids[::-1]
        bad = http.get("/v1/jobs", params={"status": "exploded"})
        assert bad.status_code == 422 and "status" in error_of(bad)["message"]
        # A cursor is "<created ms>-<job id>": anything else is the caller's error, never the job store's.
        for cursor in ("nan-x", "inf-x", "1e400-x", "1.5-x", "-5-x", "12", "12-", "1" * 40 + "-x"):
            bad = http.get("/v1/jobs", params={"cursor": cursor})
            assert bad.status_code == 422 and "cursor" in error_of(bad)["message"], (cursor, bad.text)
    for job_id in ids:
        wait_job(service, job_id, key=KEY_C)
    with service.client(KEY_C) as http:
        done = http.get("/v1/jobs", params={"status": "succeeded", "limit": 100}).json()["data"]
        assert {job["id"] for job in done} == set(ids)


BAD_JOBS = [
    # (body as raw bytes or JSON, content type, status, words the message must contain)
    (b'{"instruction": "x", "gen_seconds": ', "application/json", 400, ["not valid JSON"]),
    (b'["instruction"]', "application/json", 400, ["JSON object"]),
    (b"", "application/json", 400, ["empty"]),
    (b'{"instruction": "\xff"}', "application/json", 400, ["not valid JSON", "UTF-8", "byte 17"]),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 400, ["not valid JSON", "nested too deeply"]),
    ({"instruction": "x", "gen_seconds": 2, "temperature": 0.7}, None, 422, ["temperature", "unknown field"]),
    ({"gen_seconds": 2}, None, 422, ["instruction", "required"]),
    ({"text": " \u200b\t "}, None, 422, ["text", "empty once cleaned"]),
    ({"instruction": "x", "gen_seconds": 31}, None, 422, ["gen_seconds", "30"]),
    ({"instruction": "x", "gen_seconds": 2, "variant": "turbo"}, None, 422, ["variant"]),
    ({"instruction": "x", "audio": {"upload_id": "a", "key": "b"}}, None, 422, ["exactly one"]),
    ({"instruction": "x", "audio": {"key": "no/such/clip.wav"}}, None, 422, ["no/such/clip.wav"]),
    ({"instruction": "x", "audio": {"key": "../../clip.wav"}}, None, 422, ["not a plain object key"]),
    ({"instruction": "x", "audio": {"key": "a\nb.wav"}}, None, 422, ["control characters"]),
    # Numbers are strict: no strings or booleans read as numbers, NaN refused by name.
    ({"instruction": "x", "gen_seconds": "2"}, None, 422, ["gen_seconds", "valid number"]),
    ({"instruction": "x", "gen_seconds": True}, None, 422, ["gen_seconds", "valid number"]),
    (b'{"instruction": "x", "gen_seconds": NaN}', "application/json", 422, ["gen_seconds", "finite"]),
    ({"instruction": "x", "gen_seconds": 2, "num_inference_steps": "8"}, None, 422, ["num_inference_steps"]),
    ({"instruction": "x", "gen_seconds": 2, "seed": False}, None, 422, ["seed"]),
    (b'{"instruction": "x", "gen_seconds": ' + b"9" * 5000 + b"}", "application/json", 400,
     ["not valid JSON", "too many digits"]),
    # Fifty thousand unknown fields: the first twenty are named, with a count of the rest.
    ({"instruction": "x", "gen_seconds": 2, **{f"k{i}": 0 for i in range(50_000)}}, None, 422,
     ["k0: unknown field", "k19: unknown field", "and 49980 more"]),
]


def test_bad_input_is_a_4xx_naming_the_problem_and_the_worker_stays_up(service: Service) -> None:
    jobs_before = service.job_keys()
    batches_before = set(service.redis.scan_iter("auk:batch:*"))
    with service.client() as http:
        for body, content_type, status, words in BAD_JOBS:
            if isinstance(body, bytes):
                response = http.post("/v1/jobs", content=body, headers={"Content-Type": content_type})
            else:
                response = http.post("/v1/jobs", json=body)
            assert response.status_code == status, (body, response.text[:500])
            assert len(response.content) < 8_000, len(response.content)  # an answer, not a transcript
            message = error_of(response)["message"]
            for word in words:
                assert word in message, (body, message)

        # Clip plus target over 30 s: the message gives the numbers.
        up = http.post("/v1/uploads", files={"file": ("ref.wav", wav_bytes(2.0), "audio/wav")}).json()
        long = http.post("/v1/jobs", json={"instruction": "x", "audio": {"upload_id": up["upload_id"]},
                                           "gen_seconds": 29})  # fmt: skip
        assert long.status_code == 422
        assert "2.00 s" in error_of(long)["message"] and "29.00 s" in error_of(long)["message"]

        text_file = {"file": ("notes.txt", b"just some text, not a sound", "text/plain")}
        not_audio = http.post("/v1/uploads", files=text_file)
        assert not_audio.status_code == 422 and "not audio" in error_of(not_audio)["message"]
        empty = http.post("/v1/uploads", files={"file": ("empty.wav", b"", "audio/wav")})
        assert empty.status_code == 422 and "empty" in error_of(empty)["message"]
        huge = http.post("/v1/uploads", files={"file": ("huge.wav", b"\0" * (MAX_UPLOAD + 1), "audio/wav")})
        assert huge.status_code == 413 and str(MAX_UPLOAD) in error_of(huge)["message"]
        no_file = http.post("/v1/uploads", files={"other": ("a.wav", wav_bytes(0.5), "audio/wav")})
        assert no_file.status_code == 422 and "file" in error_of(no_file)["message"]
        no_name = http.post("/v1/uploads", files={"file": ("", wav_bytes(0.5), "audio/wav")})
        assert no_name.status_code == 422 and "file: must be a file" in error_of(no_name)["message"], no_name.text
        loud = wav_bytes(0.5, amplitude=1e30)
        too_loud = http.post("/v1/uploads", files={"file": ("loud.wav", loud, "audio/wav")})
        assert too_loud.status_code == 422 and "peak amplitude" in error_of(too_loud)["message"]

        # A batch with bad lines: each reported by number, nothing written, nothing enqueued.
        bulk_before = service.redis.llen("auk.base.bulk")
        lines = [
            json.dumps({"instruction": "fine", "gen_seconds": 1, "custom_id": "a"}),
            "{not json",
            json.dumps({"instruction": "fine", "gen_seconds": 1, "custom_id": "a"}),
            json.dumps({"text": " \u200b ", "custom_id": "c"}),
            json.dumps({"instruction": "no id", "gen_seconds": 1}),
            json.dumps({"instruction": "too long", "gen_seconds": 45, "custom_id": "e"}),
            "[" * 5000 + "]" * 5000,
            '{"instruction": "x", "custom_id": "g", "gen_seconds": ' + "9" * 5000 + "}",
            # Valid: JSON strings may hold U+2028, which str.splitlines would break the line at.
            json.dumps({"instruction": "a\u2028b", "gen_seconds": 1, "custom_id": "h"}, ensure_ascii=False),
        ]
        bad_batch = http.post("/v1/batches", content="\n".join(lines), headers={"Content-Type": "text/plain"})
        assert bad_batch.status_code == 422, bad_batch.text
        error = error_of(bad_batch)
        by_line = {item["line"]: item["message"] for item in error["details"]}
        assert set(by_line) == {2, 3, 4, 5, 6, 7, 8}
        assert "nested too deeply" in by_line[7] and "too many digits" in by_line[8]
        assert "JSON" in by_line[2] and "repeats line 1" in by_line[3]
        assert "empty once cleaned" in by_line[4] and "custom_id" in by_line[5] and "gen_seconds" in by_line[6]
        assert service.redis.llen("auk.base.bulk") == bulk_before
        assert set(service.redis.scan_iter("auk:batch:*")) == batches_before
        assert service.job_keys() == jobs_before  # no job record was created by any bad request

        wrong_type = http.post("/v1/batches", content=b"<xml/>", headers={"Content-Type": "application/xml"})
        assert wrong_type.status_code == 415 and "JSONL" in error_of(wrong_type)["message"]

    # The worker never saw any of it: still alive, heartbeat ready, and it renders a normal job.
    assert service.worker.proc.poll() is None
    assert service.worker.heartbeat(service.redis)["state"] in ("ready", "busy")
    with service.client() as http:
        job = http.post("/v1/jobs", json={"instruction": "Still here.", "gen_seconds": 0.4,
                                          "num_inference_steps": 2}).json()  # fmt: skip
    done = wait_job(service, job["id"])
    assert done["status"] == "succeeded"
    assert len(fetch_wav(done["result"]["url"])[0]) == expected_samples(0.4)


def test_cancel_a_queued_job_is_never_rendered(service: Service) -> None:
    # No Flash worker runs yet, so a Flash job stays queued until one starts.
    with service.client() as http:
        job = http.post("/v1/jobs", json={"instruction": "Never.", "gen_seconds": 1, "variant": "flash"}).json()
        assert service.redis.llen("auk.flash.interactive") == 1
        canceled = http.post(f"/v1/jobs/{job['id']}/cancel")
        assert canceled.status_code == 200 and canceled.json()["status"] == "canceled"
        again = http.post(f"/v1/jobs/{job['id']}/cancel")
        assert again.status_code == 409 and "already canceled" in error_of(again)["message"]
    # A Flash worker now takes the message and must skip it.
    flash = WorkerProcess({**service.env, "AUK_VARIANT": "flash", "AUK_PIPELINE": "instant"}, "api-flash",
                          service.logdir).start()  # fmt: skip
    try:
        flash.wait_state(service.redis, "ready", timeout=60)
        _wait("flash queue drained", lambda: service.redis.llen("auk.flash.interactive") == 0, 30)
        _wait("message acknowledged", lambda: service.redis.hlen("unacked") == 0, 30)
    finally:
        flash.terminate(timeout=20)
    record = wait_job(service, job["id"])
    assert record["status"] == "canceled" and record["attempts"] == 0 and record["result"] is None
    assert service.s3.keys(BUCKET, f"{PREFIX}/jobs/{job['id']}") == []


def test_client_cli_submit_wait_fetch(service: Service, tmp_path: Path, monkeypatch, capsys) -> None:
    from auk_client.cli import main_client

    monkeypatch.setenv("AUK_API_URL", service.url)
    monkeypatch.setenv("AUK_API_KEY", KEY_A)
    clip = tmp_path / "ref.wav"
    clip.write_bytes(wav_bytes(0.6))
    assert main_client("submit", ["--instruction", "From the CLI.", "--audio", str(clip), "--gen-seconds", "0.5",
                                  "--steps", "2"]) == 0  # fmt: skip
    job = json.loads(capsys.readouterr().out)
    assert job["request"]["audio"]["upload_id"]
    assert main_client("wait", [job["id"], "--interval", "0.1", "--timeout", "90", "--quiet"]) == 0
    capsys.readouterr()
    assert main_client("fetch", [job["id"], "-o", str(tmp_path / "out")]) == 0
    samples, rate = sf.read(tmp_path / "out" / f"{job['id']}.wav")
    assert rate == SR and len(samples) == expected_samples(0.5)
    capsys.readouterr()

    batch_file = tmp_path / "jobs.jsonl"
    batch_file.write_text("\n".join(json.dumps({"instruction": f"b{i}", "gen_seconds": 0.2, "custom_id": f"cli/{i}",
                                                "num_inference_steps": 1}) for i in range(3)))  # fmt: skip
    assert main_client("submit", ["--batch", str(batch_file), "--idempotency-key", "cli-night"]) == 0
    batch = json.loads(capsys.readouterr().out)
    assert main_client("submit", ["--batch", str(batch_file), "--idempotency-key", "cli-night"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == batch["id"]  # run again: the same batch
    assert main_client("wait", [batch["id"], "--interval", "0.1", "--timeout", "90", "--quiet"]) == 0
    assert main_client("fetch", [batch["id"], "-o", str(tmp_path / "batch")]) == 0
    assert sorted(p.name for p in (tmp_path / "batch").iterdir()) == sorted(
        ["cli_0.wav", "cli_1.wav", "cli_2.wav", f"batch-{batch['id']}.manifest.jsonl"]
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": " ", "custom_id": "only"}\n')
    capsys.readouterr()
    assert main_client("submit", ["--batch", str(bad)]) == 1
    assert "line 1: text is empty once cleaned" in capsys.readouterr().err
    assert main_client("status", ["no-such-id"]) == 1


def _with_inputs(settings):
    import dataclasses

    return dataclasses.replace(settings, s3_input_bucket=BUCKET, s3_input_prefix=INPUTS)


def test_a_key_the_storage_refuses_is_the_callers_error(settings) -> None:
    """A key the S3 server answers with 400 (here one with a '..' segment, sent past the schema that refuses it)
    is a 422 naming the key, not a 503 that would invite retries."""
    from api.deps import build_services
    from api.submit import ClipResolver
    from auk_worker.errors import InputError
    from auk_worker.service.records.requests import AudioRef, JobRequest

    audio = AudioRef.model_construct(upload_id=None, key="clips/../x.wav")
    request = JobRequest.model_construct(instruction="x", audio=audio, gen_seconds=None)
    with pytest.raises(InputError, match="refuses the key 'clips/../x.wav'") as refused:
        ClipResolver(build_services(_with_inputs(settings)), "owner").resolve(request)
    assert refused.value.code == "invalid_key"


def test_a_bad_key_named_on_many_batch_lines_is_fetched_once(settings) -> None:
    """A batch of 2,000 lines naming one large undecodable object took 135 s: every line fetched and decoded it
    again. The resolver now keeps a key's error as it keeps a good key's clip."""
    from api.deps import build_services
    from api.submit import ClipResolver
    from auk_worker.errors import AudioError, InputError
    from auk_worker.service.records.requests import AudioRef, JobRequest

    svc = build_services(_with_inputs(settings))
    svc.storage.client.put_object(Bucket=BUCKET, Key=f"{INPUTS}probe/garbage.wav", Body=b"\x07" * 4096)
    fetched = []
    get_bytes = svc.storage.get_bytes
    svc.storage.get_bytes = lambda bucket, key: fetched.append(key) or get_bytes(bucket, key)
    resolver = ClipResolver(svc, "owner")
    for key, error in (("probe/garbage.wav", AudioError), ("probe/missing.wav", InputError)):
        request = JobRequest.model_construct(instruction="x", audio=AudioRef.model_construct(upload_id=None, key=key),
                                             gen_seconds=1.0)  # fmt: skip
        messages = set()
        for _ in range(50):
            with pytest.raises(error) as raised:
                resolver.resolve(request)
            messages.add(raised.value.message)
        assert len(messages) == 1, messages  # the same error every time
    assert fetched == [f"{INPUTS}probe/garbage.wav"]  # fetched once; the missing key never got past its HEAD
