"""Webhooks end to end: the real API (its dispatcher running in the API process), an instant-pipeline worker, and a
real HTTP receiver on loopback (allowed by ``AUK_WEBHOOK_ALLOW=127.0.0.1``) that verifies every signature with the
secret the API hands out, fails on purpose, and records the retries. Retry delays are shrunk to tenths of a second.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import soundfile as sf

from auk_worker.errors import ConfigError
from auk_worker.service.connect.settings import Settings
from auk_worker.service.delivery.webhooks.signing import verify
from tests.service.batch_service import KEY_A, KEY_B, BatchService, batch_service
from tests.service.conftest import BUCKET
from tests.service.test_webhooks import Receiver


@pytest.fixture(scope="module")
def svc(redis_server, s3_server, tmp_path_factory) -> Iterator[BatchService]:
    with batch_service(redis_server, s3_server, tmp_path_factory.mktemp("hooks"), "test-hooks",
                       WEBHOOK_ALLOW="127.0.0.1", WEBHOOK_RETRY_BASE="0.3", WEBHOOK_RETRY_CAP="1",
                       WEBHOOK_MAX_ATTEMPTS="6") as service:  # fmt: skip
        service.start_worker("hooks-base")
        yield service


def secret_of(svc: BatchService, key: str = KEY_A) -> str:
    with svc.client(key) as http:
        return http.get("/v1/webhooks/secret").json()["secret"]


def wait_delivered(svc: BatchService, path: str, key: str = KEY_A) -> dict:
    with svc.client(key) as http:
        return svc.wait(f"{path} webhook delivered", lambda: (r := http.get(path).json())["webhook"]["state"]
                        in ("delivered", "failed") and r, timeout=30)  # fmt: skip


def test_a_job_webhook_is_retried_until_delivered_and_every_attempt_is_signed(svc: BatchService) -> None:
    secret = secret_of(svc)
    assert secret.startswith("whsec_") and secret_of(svc) == secret and secret_of(svc, KEY_B) != secret
    with Receiver(lambda: secret, answer=lambda n: 500 if n <= 2 else 200) as receiver:
        with svc.client() as http:
            created = http.post("/v1/jobs", json={"instruction": "Ping me.", "gen_seconds": 0.4,
                                                  "webhook_url": receiver.url("/jobs")})  # fmt: skip
            assert created.status_code == 202, created.text
            job = created.json()
            assert job["request"]["webhook_url"] == receiver.url("/jobs")
            assert job["webhook"]["state"] == "waiting" and job["webhook"]["attempts"] == 0
        assert svc.wait_job(job["id"])["status"] == "succeeded"
        done = wait_delivered(svc, f"/v1/jobs/{job['id']}")
    hook = done["webhook"]
    assert hook["state"] == "delivered" and hook["attempts"] == 3 and hook["last_status"] == 200, hook
    assert hook["next_attempt_at"] is None and hook["delivered_at"].endswith("Z")
    assert [s.answered for s in receiver.seen] == [500, 500, 200]
    assert all(s.verified is None for s in receiver.seen), [s.verified for s in receiver.seen]
    assert {s.headers["webhook-id"] for s in receiver.seen} == {f"msg_job_{job['id']}"}
    gaps = [b.at - a.at for a, b in zip(receiver.seen, receiver.seen[1:])]
    assert all(0 < gap < 3 for gap in gaps), gaps  # jittered backoff from 0.3 s, capped at 1 s
    event = json.loads(receiver.seen[-1].body)
    assert event["type"] == "job.succeeded" and event["data"]["id"] == job["id"]
    assert event["data"]["status"] == "succeeded" and event["data"]["result"]["duration_s"] == pytest.approx(0.4)
    audio = httpx.get(event["data"]["result"]["url"], timeout=30)  # the event's presigned URL works as sent
    assert audio.status_code == 200 and audio.content[:4] == b"RIFF"


def test_a_batch_webhook_arrives_once_its_manifest_is_stored(svc: BatchService) -> None:
    secret = secret_of(svc)
    lines = "\n".join(json.dumps({"instruction": f"Line {i}.", "gen_seconds": 0.2, "custom_id": f"hook-{i}"})
                      for i in range(3))  # fmt: skip
    with Receiver(lambda: secret) as receiver, svc.client() as http:
        created = http.post("/v1/batches", params={"webhook_url": receiver.url("/batches")}, content=lines,
                            headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
        assert created.status_code == 202, created.text
        batch_id = created.json()["id"]
        svc.wait_batch(batch_id)
        batch = wait_delivered(svc, f"/v1/batches/{batch_id}")
    assert batch["webhook"]["state"] == "delivered" and batch["webhook"]["attempts"] == 1
    assert len(receiver.seen) == 1 and receiver.seen[0].verified is None
    event = json.loads(receiver.seen[0].body)
    assert event["type"] == "batch.completed" and event["data"]["id"] == batch_id
    assert event["data"]["status"] == "done" and event["data"]["counts"]["succeeded"] == 3
    manifest = httpx.get(event["data"]["manifest"]["url"], timeout=30).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in manifest) == ["hook-0", "hook-1", "hook-2"]
    assert event["data"]["error_file"] is None  # every line succeeded


def test_a_canceled_job_sends_its_webhook_and_a_rotated_secret_still_verifies(svc: BatchService) -> None:
    old = secret_of(svc, KEY_B)
    with svc.client(KEY_B) as http:
        rotated = http.post("/v1/webhooks/secret/rotate").json()
        new = rotated["secret"]
        assert new != old and secret_of(svc, KEY_B) == new and rotated["previous_valid_for_s"] > 0
        with Receiver(lambda: old) as receiver:  # a receiver that has not switched yet
            # No Flash worker runs: the job stays queued until canceled.
            job = http.post("/v1/jobs", json={"instruction": "Never.", "gen_seconds": 1, "variant": "flash",
                                              "webhook_url": receiver.url()}).json()  # fmt: skip
            assert http.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "canceled"
            done = wait_delivered(svc, f"/v1/jobs/{job['id']}", key=KEY_B)
    assert done["webhook"]["state"] == "delivered" and receiver.seen[0].verified is None
    event = json.loads(receiver.seen[0].body)
    assert event["type"] == "job.canceled" and event["data"]["error"]["code"] == "canceled"
    verify(new, receiver.seen[0].headers, receiver.seen[0].body)  # signed with both secrets during the grace


@pytest.mark.parametrize("url, words", [
    ("http://10.1.2.3/hook", "private"),
    ("http://169.254.169.254/latest/meta-data", "cloud metadata"),
    ("http://[fe80::1]/hook", "link-local"),
    ("http://127.0.0.2:8080/hook", "loopback"),  # the allow-list names 127.0.0.1 only
    ("http://localhost/hook", "names this machine"),
    ("http://[::ffff:192.168.0.1]/hook", "private"),
    ("ftp://example.com/hook", "only http and https"),
    ("http://0x7f.1/hook", "not a canonical"),
])  # fmt: skip
def test_a_webhook_url_the_guard_refuses_is_a_422_and_nothing_is_written(svc: BatchService, url: str,
                                                                          words: str) -> None:
    jobs_before = set(svc.redis.scan_iter("auk:job:*"))
    batches_before = set(svc.redis.scan_iter("auk:batch:*"))
    with svc.client() as http:
        job = http.post("/v1/jobs", json={"instruction": "x", "gen_seconds": 1, "webhook_url": url})
        batch = http.post("/v1/batches", params={"webhook_url": url}, headers={"Content-Type": "text/plain"},
                          content=json.dumps({"instruction": "x", "gen_seconds": 1, "custom_id": "a"}))  # fmt: skip
    for response in (job, batch):
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["message"].startswith("webhook_url: ") and words in error["message"], error
        assert error["code"] in ("url_not_allowed", "invalid_url")
    assert set(svc.redis.scan_iter("auk:job:*")) == jobs_before
    assert set(svc.redis.scan_iter("auk:batch:*")) == batches_before


def test_a_batch_line_cannot_name_its_own_webhook(svc: BatchService) -> None:
    line = json.dumps({"instruction": "x", "gen_seconds": 1, "custom_id": "a", "webhook_url": "https://example.com/"})
    with svc.client() as http:
        refused = http.post("/v1/batches", content=line, headers={"Content-Type": "text/plain"})
    assert refused.status_code == 422
    assert "set it on the batch" in refused.json()["error"]["details"][0]["message"]


def test_webhook_settings_are_read_and_checked() -> None:
    """``AUK_WEBHOOK_*`` as the API's and the standalone dispatcher's settings (its run: test_webhooks.py)."""
    settings = Settings.from_env({"AUK_WEBHOOK_ALLOW": "127.0.0.1, hooks.internal", "AUK_WEBHOOK_RETRY_BASE": "2",
                                  "AUK_WEBHOOK_THREADS": "0"})  # fmt: skip
    assert settings.webhook_allow == "127.0.0.1, hooks.internal" and settings.webhook_retry_base_s == 2.0
    assert settings.webhook_threads == 0 and settings.webhook_max_attempts == 15
    with pytest.raises(ConfigError, match="AUK_WEBHOOK_ALLOW"):
        Settings.from_env({"AUK_WEBHOOK_ALLOW": "not a host!"})
    with pytest.raises(ConfigError, match="AUK_WEBHOOK_TIMEOUT"):
        Settings.from_env({"AUK_WEBHOOK_TIMEOUT": "0"})


def test_a_job_that_fails_at_the_worker_sends_job_failed(svc: BatchService) -> None:
    secret = secret_of(svc)
    buf = io.BytesIO()
    sf.write(buf, np.zeros(8000, np.float32) + 0.05, 16_000, format="WAV")
    with Receiver(lambda: secret) as receiver, svc.client() as http:
        upload = http.post("/v1/uploads", files={"file": ("ref.wav", buf.getvalue(), "audio/wav")}).json()
        job = http.post("/v1/jobs", json={"instruction": "x", "variant": "flash", "webhook_url": receiver.url(),
                                          "audio": {"upload_id": upload["upload_id"]}}).json()  # fmt: skip
        # The clip goes before a Flash worker exists to read it: the job fails at the worker.
        svc.s3.client().delete_object(Bucket=BUCKET, Key=f"{svc.prefix}/uploads/{upload['upload_id']}")
        svc.start_worker("hooks-flash", AUK_VARIANT="flash")
        assert svc.wait_job(job["id"])["status"] == "failed"
        done = wait_delivered(svc, f"/v1/jobs/{job['id']}")
    assert done["webhook"]["state"] == "delivered" and len(receiver.seen) == 1
    event = json.loads(receiver.seen[0].body)
    assert event["type"] == "job.failed" and event["data"]["error"]["code"] == "audio_not_found"
    assert receiver.seen[0].verified is None
