"""``audio.key`` reaches only the operator's input location: the real API over HTTP, the session's Redis and
SeaweedFS, an instant-pipeline worker.

A key's uploads and results live under ``AUK_S3_PREFIX`` in the result bucket; ``audio.key`` is read relative to
``AUK_S3_INPUT_PREFIX`` in ``AUK_S3_INPUT_BUCKET``, which settings keep apart from them. So another key's result
or upload, named by its object key, is just a missing input (the same answer as a key that never existed), and with
no input location configured ``audio.key`` is refused by name.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from auk_worker.errors import ConfigError
from auk_worker.service.connect.settings import Settings
from tests.service.conftest import BUCKET
from tests.service.harness import ApiProcess, free_port

KEY_A, KEY_B = "key-input-alpha-0123456789", "key-input-bravo-0123456789"
INPUTS = "operator-inputs/"


def wav_bytes(seconds: float, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, (0.2 * np.sin(np.arange(int(seconds * rate)) / 9)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def _api(env: dict[str, str], tmp_path: Path, name: str, **extra: str) -> ApiProcess:
    api_env = {**env, "AUK_API_KEYS": f"{KEY_A},{KEY_B}", **extra}
    return ApiProcess(api_env, free_port(), tmp_path / f"{name}.log").start()


@pytest.fixture
def api(service_env: dict[str, str], tmp_path: Path) -> Iterator[ApiProcess]:
    proc = _api(service_env, tmp_path, "api", AUK_S3_INPUT_BUCKET=BUCKET, AUK_S3_INPUT_PREFIX=INPUTS)
    yield proc
    proc.stop()


def _client(api: ApiProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _wait(http: httpx.Client, job_id: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while (job := http.get(f"/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed", "canceled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    return job


def test_another_keys_results_and_uploads_are_not_input(api, service_env, start_worker, storage) -> None:
    start_worker("input-w1")
    prefix = service_env["AUK_S3_PREFIX"]
    with _client(api, KEY_A) as alpha, _client(api, KEY_B) as bravo:
        upload = alpha.post("/v1/uploads", files={"file": ("me.wav", wav_bytes(0.5), "audio/wav")}).json()
        job = alpha.post("/v1/jobs", json={"instruction": "mine", "gen_seconds": 0.4,
                                           "audio": {"upload_id": upload["upload_id"]}}).json()  # fmt: skip
        done = _wait(alpha, job["id"])
        assert done["status"] == "succeeded", done
        result_key = done["result"]["key"]
        assert result_key == f"{prefix}/jobs/{job['id']}.wav" and storage.exists(result_key)
        upload_object = f"{prefix}/uploads/{upload['upload_id']}"
        assert storage.exists(upload_object)

        # B names A's result and A's upload by object key: both are missing inputs, answered exactly as a key
        # that never existed (nothing tells B that the objects exist), and no job record is written.
        answers = {}
        for key in (result_key, upload_object, f"{prefix}/jobs/no-such-job.wav"):
            refused = bravo.post("/v1/jobs", json={"instruction": "theirs", "gen_seconds": 0.4, "audio": {"key": key}})
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            answers[key] = (error["code"], error["message"].replace(key, "<key>"))
        assert set(answers.values()) == {("audio_not_found", "audio.key: no object '<key>' in the input location")}
        # So does A itself: its own results are not an input either; its upload is reached by its id.
        own = alpha.post("/v1/jobs", json={"instruction": "again", "gen_seconds": 0.4, "audio": {"key": result_key}})
        assert own.status_code == 422 and own.json()["error"]["code"] == "audio_not_found"
        listed = bravo.get("/v1/jobs", params={"limit": 100}).json()["data"]
        assert listed == []

        # An object the operator put in the input location is reachable by every key, relative to the prefix.
        storage.client.put_object(Bucket=BUCKET, Key=f"{INPUTS}voices/ref.wav", Body=wav_bytes(0.6))
        shared = bravo.post("/v1/jobs", json={"instruction": "shared", "gen_seconds": 0.3,
                                              "audio": {"key": "voices/ref.wav"}})  # fmt: skip
        assert shared.status_code == 202, shared.text
        assert shared.json()["request"]["clip"]["key"] == f"{INPUTS}voices/ref.wav"
        finished = _wait(bravo, shared.json()["id"])
        assert finished["status"] == "succeeded", finished


def test_audio_key_is_refused_without_an_input_location(service_env, tmp_path, storage) -> None:
    api = _api(service_env, tmp_path, "api-no-inputs")
    try:
        storage.client.put_object(Bucket=BUCKET, Key=f"{INPUTS}voices/ref.wav", Body=wav_bytes(0.6))
        with _client(api, KEY_A) as http:
            refused = http.post("/v1/jobs", json={"instruction": "x", "gen_seconds": 0.3,
                                                  "audio": {"key": f"{INPUTS}voices/ref.wav"}})  # fmt: skip
            assert refused.status_code == 422
            error = refused.json()["error"]
            assert error["code"] == "audio_key_disabled" and "audio.upload_id" in error["message"]
    finally:
        api.stop()


@pytest.mark.parametrize(("prefix", "input_bucket", "input_prefix"), [
    ("svc", BUCKET, ""), ("svc", BUCKET, "svc/inputs"), ("svc/inner", BUCKET, "svc"), ("", BUCKET, "inputs"),
])  # fmt: skip
def test_an_input_location_over_the_service_data_is_refused(prefix, input_bucket, input_prefix) -> None:
    env = {"AUK_S3_BUCKET": BUCKET, "AUK_S3_PREFIX": prefix, "AUK_S3_INPUT_BUCKET": input_bucket,
           "AUK_S3_INPUT_PREFIX": input_prefix}  # fmt: skip
    with pytest.raises(ConfigError, match="overlaps"):
        Settings.from_env(env)


def test_an_input_location_apart_from_the_service_data_is_accepted() -> None:
    apart = Settings.from_env({"AUK_S3_BUCKET": BUCKET, "AUK_S3_PREFIX": "svc", "AUK_S3_INPUT_BUCKET": BUCKET,
                               "AUK_S3_INPUT_PREFIX": "inputs"})  # fmt: skip
    assert (apart.s3_input_bucket, apart.s3_input_prefix) == (BUCKET, "inputs/")
    other = Settings.from_env({"AUK_S3_BUCKET": BUCKET, "AUK_S3_INPUT_BUCKET": "operator-inputs"})
    assert (other.s3_input_bucket, other.s3_input_prefix) == ("operator-inputs", "")
    assert Settings.from_env({}).s3_input_bucket is None
    with pytest.raises(ConfigError, match="AUK_S3_INPUT_BUCKET"):
        Settings.from_env({"AUK_S3_INPUT_PREFIX": "inputs"})
