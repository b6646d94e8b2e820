"""Operating the service, end to end: the real API and a real worker (instant pipeline) over HTTP, with the session's
redis-server and SeaweedFS. Prometheus metrics of both scraped while jobs run; JSON log lines parsed; presigned URLs
signed for the public endpoint and opened there; audio streamed through ``GET /v1/jobs/{id}/audio``; retention with
short periods through the running API."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.service.conftest import BUCKET
from tests.service.harness import ApiProcess, RedisServer, S3Server, WorkerProcess, connection_env, free_port

KEY_A, KEY_B = "ops-key-alpha-0123456789", "ops-key-bravo-0123456789"
STEP_DELAY = 0.15  # seconds per instant step: a 4-step job takes 0.6 s, long enough to see it queued and running


@dataclass
class Ops:
    api: ApiProcess
    worker: WorkerProcess
    worker_metrics: str
    public_endpoint: str
    redis: redis.Redis

    def http(self, key: str | None = KEY_A) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.api.url, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def ops(redis_server: RedisServer, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ops]:
    logdir = tmp_path_factory.mktemp("ops")
    client = redis_server.client()
    client.flushdb()
    # The service reaches SeaweedFS as 127.0.0.1; callers are told "localhost", a name the service never uses.
    public = s3_server.endpoint.replace("127.0.0.1", "localhost")
    env = connection_env(redis_server, s3_server, S3_BUCKET=BUCKET, S3_PREFIX="test-ops", VARIANT="base",
                         PIPELINE="instant", LOG_FORMAT="json", S3_PUBLIC_ENDPOINT=public,
                         RETAIN_RECORDS="4s", RETAIN_RESULTS="4s", RETAIN_SWEEP_INTERVAL="1")  # fmt: skip
    metrics_port = free_port()
    worker = WorkerProcess({**env, "AUK_METRICS_PORT": str(metrics_port), "AUK_INSTANT_STEP_DELAY": str(STEP_DELAY)},
                           "ops-worker", logdir).start()  # fmt: skip
    api = ApiProcess({**env, "AUK_API_KEYS": f"{KEY_A},{KEY_B}"}, free_port(), logdir / "api.log")
    try:
        api.start()
        worker.wait_state(client, "ready", timeout=60)
        yield Ops(api, worker, f"http://127.0.0.1:{metrics_port}/metrics", public, client)
    finally:
        worker.terminate(timeout=20)
        api.stop()
        client.close()


def submit(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/jobs", json={"instruction": "Say hello.", "gen_seconds": 1.0,
                                           "num_inference_steps": 4, **body})  # fmt: skip
    assert response.status_code == 202, response.text
    return response.json()


def wait_job(http: httpx.Client, job_id: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "canceled"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus exposition as {(name, sorted labels): value}."""
    text = httpx.get(url, timeout=10).raise_for_status().text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# ------------------------------------------------------------------------------------------------------- metrics


def listening_addresses(port: int) -> set[str]:
    """The IPv4 and IPv6 addresses a socket LISTENs on at ``port`` (from /proc/net/tcp and tcp6, hex as the kernel
    writes them: 0100007F is 127.0.0.1, 00000000 every interface)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_worker_metrics_listen_on_loopback_only(ops: Ops) -> None:
    port = int(ops.worker_metrics.rsplit(":", 1)[1].split("/")[0])
    assert listening_addresses(port) == {"0100007F"}, listening_addresses(port)


def test_metrics_of_the_api_and_the_worker_move_with_the_jobs(ops: Ops) -> None:
    api_url = f"{ops.api.url}/metrics"
    api0, worker0 = scrape(api_url), scrape(ops.worker_metrics)
    assert value(api0, "auk_redis_up") == 1 and value(api0, "auk_workers", state="ready") == 1
    assert value(worker0, "auk_worker_info", worker="ops-worker", variant="base", pipeline="instant") == 1
    assert ("auk_worker_model_load_seconds", ()) in worker0 and ("auk_worker_warmup_seconds", ()) in worker0
    assert 0 <= value(worker0, "auk_worker_heartbeat_age_seconds") < 5

    with ops.http() as http:
        jobs = [submit(http, seed=i) for i in range(4)]
        canceled = submit(http, seed=99)  # behind the four: still queued when canceled
        assert http.post(f"/v1/jobs/{canceled['id']}/cancel").status_code == 200
        # While they run: the first is running, the rest wait in the interactive queue.
        deadline = time.monotonic() + 2
        while value(during := scrape(api_url), "auk_workers", state="busy") != 1:
            assert time.monotonic() < deadline, "the worker never showed busy"
            time.sleep(0.02)
        assert value(during, "auk_queue_messages", queue="auk.base.interactive") >= 1
        assert value(during, "auk_jobs_unfinished") >= 2
        assert value(during, "auk_jobs_submitted_total") - value(api0, "auk_jobs_submitted_total") == 5
        done = [wait_job(http, job["id"]) for job in jobs]
        assert all(job["status"] == "succeeded" for job in done)
        assert http.get("/v1/jobs/not-a-job").status_code == 404
    deadline = time.monotonic() + 10
    while value(scrape(ops.worker_metrics), "auk_worker_jobs_total", outcome="skipped") <= value(
            worker0, "auk_worker_jobs_total", outcome="skipped"):  # the canceled job's message, met and dropped
        assert time.monotonic() < deadline
        time.sleep(0.1)

    api1, worker1 = scrape(api_url), scrape(ops.worker_metrics)

    def moved(after: dict, before: dict, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved(worker1, worker0, "auk_worker_jobs_total", outcome="succeeded") == 4
    assert moved(worker1, worker0, "auk_worker_jobs_total", outcome="skipped") == 1
    assert moved(worker1, worker0, "auk_worker_jobs_total", outcome="failed") == 0
    for stage in ("fetch", "render", "upload"):
        assert moved(worker1, worker0, "auk_worker_stage_seconds_count", stage=stage) == 4
    # 4 steps of STEP_DELAY each: every render took at least that long, and the histogram's sum says so.
    assert moved(worker1, worker0, "auk_worker_stage_seconds_sum", stage="render") >= 4 * 4 * STEP_DELAY
    assert moved(worker1, worker0, "auk_worker_render_busy_seconds_total") >= 4 * 4 * STEP_DELAY
    assert moved(worker1, worker0, "auk_worker_job_seconds_count") == 4
    assert moved(api1, api0, "auk_api_requests_total", method="POST", route="/v1/jobs", status="202") == 5
    assert moved(api1, api0, "auk_api_requests_total", method="POST", route="/v1/jobs/{job_id}/cancel",
                 status="200") == 1  # fmt: skip
    assert moved(api1, api0, "auk_api_requests_total", method="GET", route="/v1/jobs/{job_id}", status="404") == 1
    assert moved(api1, api0, "auk_api_request_duration_seconds_count", method="POST", route="/v1/jobs") == 5
    assert moved(api1, api0, "auk_jobs_finished_total", status="succeeded") == 4
    assert moved(api1, api0, "auk_jobs_finished_total", status="canceled") == 1
    assert value(api1, "auk_queue_messages", queue="auk.base.interactive") == 0
    assert value(api1, "auk_jobs_unfinished") == 0


# ------------------------------------------------------------------------------------------------------- logs


def _json_lines(path: Path) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every line is one JSON object, or this raises


def test_logs_are_one_json_object_a_line_with_the_job_and_its_stages(ops: Ops) -> None:
    with ops.http() as http:
        job = wait_job(http, submit(http, seed=7)["id"])
    assert job["status"] == "succeeded"
    time.sleep(0.2)
    worker_lines = _json_lines(ops.worker.log)
    api_lines = _json_lines(ops.api.log)
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in worker_lines + api_lines)
    assert all(line["worker"] == "ops-worker" for line in worker_lines)
    finished = [line for line in worker_lines if line.get("job_id") == job["id"] and "succeeded" in line["message"]]
    assert len(finished) == 1, [line for line in worker_lines if line.get("job_id") == job["id"]]
    line = finished[0]
    assert line["batch_id"] is None and line["duration_s"] == 1.0
    assert {"fetch", "render", "upload"} <= set(line["stages"]) and line["stages"]["render"] >= 4 * STEP_DELAY
    started = [line for line in worker_lines if line.get("job_id") == job["id"] and "started" in line["message"]]
    assert started, "lines written while the job runs carry its id"
    assert any(f"/v1/jobs/{job['id']}" in line["message"] for line in api_lines)  # uvicorn's access lines too


# ------------------------------------------------------------------------------------------------------- results


def test_presigned_urls_name_the_public_endpoint_and_open_there(ops: Ops) -> None:
    with ops.http() as http:
        job = wait_job(http, submit(http, seed=11)["id"])
        url = job["result"]["url"]
        assert url.startswith(f"{ops.public_endpoint}/{BUCKET}/test-ops/jobs/{job['id']}.wav?"), url
        direct = httpx.get(url, timeout=10)
        assert direct.status_code == 200 and direct.content[:4] == b"RIFF"
        # The signature covers the host: the same URL under the internal name is refused.
        internal = url.replace("localhost", "127.0.0.1", 1)
        assert httpx.get(internal, timeout=10).status_code == 403
        through_api = http.get(f"/v1/jobs/{job['id']}/audio")
        assert through_api.status_code == 200 and through_api.content == direct.content
        assert through_api.headers["content-type"] == "audio/wav"
        assert int(through_api.headers["content-length"]) == len(direct.content)


def test_audio_route_streams_ranges_and_guards_owner_and_state(ops: Ops) -> None:
    with ops.http() as http, ops.http(KEY_B) as other, ops.http(None) as anonymous:
        job = wait_job(http, submit(http, seed=12)["id"])
        whole = http.get(f"/v1/jobs/{job['id']}/audio").content
        part = http.get(f"/v1/jobs/{job['id']}/audio", headers={"Range": "bytes=4-103"})
        assert part.status_code == 206 and part.content == whole[4:104]
        assert part.headers["content-range"] == f"bytes 4-103/{len(whole)}"
        tail = http.get(f"/v1/jobs/{job['id']}/audio", headers={"Range": "bytes=-10"})
        assert tail.status_code == 206 and tail.content == whole[-10:]
        past = http.get(f"/v1/jobs/{job['id']}/audio", headers={"Range": f"bytes={len(whole) + 10}-"})
        assert past.status_code == 416

        foreign = other.get(f"/v1/jobs/{job['id']}/audio")
        assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "not_found"
        assert anonymous.get(f"/v1/jobs/{job['id']}/audio").status_code == 401
        assert http.get("/v1/jobs/0123456789abcdef/audio").status_code == 404

        slow = submit(http, seed=13, num_inference_steps=20)  # 3 s at the step delay: not finished yet
        pending = http.get(f"/v1/jobs/{slow['id']}/audio")
        assert pending.status_code == 409 and pending.json()["error"]["code"] == "not_finished"
        http.post(f"/v1/jobs/{slow['id']}/cancel")


# ------------------------------------------------------------------------------------------------------- retention


def test_retention_through_the_running_api(ops: Ops) -> None:
    """Records and results of 4 s: a finished job, its WAV and its listing entry go; a job still queued stays."""
    with ops.http() as http:
        job = wait_job(http, submit(http, seed=21)["id"])
        key = job["result"]["key"]
        blocker = submit(http, seed=22, num_inference_steps=40)  # 6 s: keeps the next one queued past the period
        waiting = submit(http, seed=23)
        assert httpx.get(job["result"]["url"], timeout=10).status_code == 200
        deadline = time.monotonic() + 15
        while http.get(f"/v1/jobs/{job['id']}").status_code != 404:
            assert time.monotonic() < deadline, "the finished record did not expire"
            time.sleep(0.25)
        while ops.redis.zscore(f"auk:owner:{_owner(KEY_A)}:jobs", job["id"]) is not None or _exists(ops, key):
            assert time.monotonic() < deadline, "the sweeper did not trim the index or delete the WAV"
            time.sleep(0.25)
        listed = {j["id"] for j in http.get("/v1/jobs", params={"limit": 500}).json()["data"]}
        assert job["id"] not in listed and waiting["id"] in listed
        assert http.get(f"/v1/jobs/{waiting['id']}").json()["status"] in ("queued", "running", "succeeded")
        http.post(f"/v1/jobs/{blocker['id']}/cancel")


def _owner(key: str) -> str:
    from auk_worker.service.records.jobs import owner_id

    return owner_id(key)


def _exists(ops: Ops, key: str) -> bool:
    from auk_worker.service.connect.settings import Settings
    from auk_worker.service.connect.storage import Storage

    return Storage(Settings.from_env(ops.api.env)).exists(key)
