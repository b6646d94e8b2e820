"""The OpenAPI document tells the truth: schemathesis, run against the live service (the real API under uvicorn over
HTTP, the session's redis-server and SeaweedFS, instant-pipeline workers for both variants), generates requests
from the document for every operation, valid and invalid, sends them with a real key, and checks each answer:
never a 5xx, a status the document lists, the content type it lists, a body that validates against its schema.

Beside it, fast checks on the document itself (built from the app, nothing started): the bearer scheme on the
``/v1`` routes only, no trace of FastAPI's default 422 shape, the error body on every error status of every
operation, and examples on the request bodies.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import soundfile as sf

from api.app import create_app
from api.routes.batches import BATCH_EXAMPLE
from auk_worker.service.connect.settings import Settings
from tests.service.conftest import BUCKET
from tests.service.harness import (
    REPO,
    VENV_BIN,
    ApiProcess,
    RedisServer,
    S3Server,
    WorkerProcess,
    connection_env,
    free_port,
)

KEY = "openapi-key-alpha-0123"
PREFIX = "test-openapi"
# Fuzzed cases per operation; the explicit examples and the coverage phase's boundary cases come on top.
MAX_EXAMPLES = int(os.environ.get("AUK_OPENAPI_EXAMPLES", "30"))
SEED = "20261204"
# The four the document must pass, plus: the response headers it declares required are sent (Retry-After on 429
# and 503, WWW-Authenticate on 401), and each operation that declares the bearer scheme refuses a missing or bad key.
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance",
          "response_headers_conformance", "ignored_auth")
UNAUTHENTICATED = {"/healthz", "/readyz", "/metrics", "/backlog", "/batches/{batch_id}", "/batches/{batch_id}/audio/{job_id}"}


# ------------------------------------------------------------------------------------------- the document alone


@pytest.fixture(scope="module")
def document() -> dict:
    """The app's document, built from settings that name servers nobody needs to reach: nothing connects."""
    settings = Settings.from_env({"AUK_API_KEYS": KEY, "AUK_S3_BUCKET": BUCKET, "AUK_S3_ENDPOINT": "http://127.0.0.1:9",
                                  "AUK_REDIS_URL": "redis://127.0.0.1:9/0", "AUK_S3_ACCESS_KEY": "a",
                                  "AUK_S3_SECRET_KEY": "b"})  # fmt: skip
    return create_app(settings).openapi()


def _operations(document: dict) -> Iterator[tuple[str, str, dict]]:
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            yield path, method, operation


def test_document_declares_bearer_on_v1_routes_only(document: dict) -> None:
    schemes = document["components"]["securitySchemes"]
    assert schemes == {"bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "API key",
                                  "description": schemes["bearer"]["description"]}}  # fmt: skip
    for path, method, operation in _operations(document):
        if path in UNAUTHENTICATED:
            assert "security" not in operation, (method, path)
        else:
            assert path.startswith("/v1/") and operation["security"] == [{"bearer": []}], (method, path)
            assert "401" in operation["responses"] and "429" in operation["responses"], (method, path)


def test_document_has_the_real_error_body_on_every_error_status(document: dict) -> None:
    assert "HTTPValidationError" not in str(document) and "ValidationError" not in document["components"]["schemas"]
    error = document["components"]["schemas"]["ErrorBody"]
    assert error["required"] == ["error"]
    detail = document["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"code", "message"}
    for path, method, operation in _operations(document):
        statuses = [int(code) for code in operation["responses"]]
        assert any(200 <= code < 300 for code in statuses), (method, path)
        if path in ("/healthz", "/readyz", "/metrics"):
            continue
        assert 404 in statuses or 422 in statuses or not operation.get("parameters"), (method, path)
        for code in statuses:
            if code < 400:
                continue
            response = operation["responses"][str(code)]
            schema = response["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, code)
            if code in (429, 503):
                assert "Retry-After" in response["headers"], (method, path, code)


def test_document_types_every_json_answer_and_gives_examples(document: dict) -> None:
    for path, method, operation in _operations(document):
        for code, response in operation["responses"].items():
            for media, body in response.get("content", {}).items():
                if media == "application/json":  # a named model, never an untyped object
                    assert "$ref" in body["schema"], (method, path, code)
    schemas = document["components"]["schemas"]
    assert schemas["JobRequest"]["examples"] and schemas["SpeechRequest"]["examples"]
    batch = document["paths"]["/v1/batches"]["post"]["requestBody"]["content"]["application/x-ndjson"]
    assert batch["example"].count("\n") == 2
    for path, method in (("/v1/audio/speech", "post"), ("/v1/jobs/{job_id}/audio", "get"),
                         ("/batches/{batch_id}/audio/{job_id}", "get")):  # fmt: skip
        audio = document["paths"][path][method]["responses"]["200"]["content"]
        assert {"audio/wav", "audio/flac", "audio/mpeg"} <= set(audio) and "application/json" not in audio, path
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert document["paths"]["/v1/jobs"]["post"]["responses"]["202"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobOut"}


def test_document_names_operations_and_links_them(document: dict) -> None:
    """operationIds are the routes' names (a generated client's methods); every link names a real operation and a
    parameter it takes."""
    by_id = {operation["operationId"]: operation for _, _, operation in _operations(document)}
    assert {"create_job", "get_job", "list_jobs", "cancel_job", "create_batch", "get_batch", "create_speech",
            "create_voice", "create_upload"} <= set(by_id)  # fmt: skip
    followed = set()
    for _, _, operation in _operations(document):
        for response in operation["responses"].values():
            for link in response.get("links", {}).values():
                target = by_id[link["operationId"]]
                names = {param["name"] for param in target.get("parameters", [])}
                assert set(link["parameters"]) <= names, link
                followed.add(link["operationId"])
    assert {"get_job", "cancel_job", "get_audio", "get_batch", "cancel_batch", "get_voice", "delete_voice"} <= followed


# ------------------------------------------------------------------------------------------- the live service


@dataclass
class Live:
    api: ApiProcess
    redis: redis.Redis


@pytest.fixture(scope="module")
def live(redis_server: RedisServer, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The API with one instant-pipeline worker per variant, so that every valid render request gets its audio, and
    no request-rate quota (its 429 is documented, but would leave the routes behind it untested)."""
    logdir = tmp_path_factory.mktemp("openapi")
    env = connection_env(redis_server, s3_server, S3_BUCKET=BUCKET, S3_PREFIX=PREFIX, VARIANT="base",
                         PIPELINE="instant", VISIBILITY_TIMEOUT="30", RETRY_BACKOFF="0.5")  # fmt: skip
    client = redis_server.client()
    client.flushdb()
    api = ApiProcess({**env, "AUK_API_KEYS": KEY, "AUK_SPEECH_TIMEOUT": "60",
                       "AUK_QUOTA_RATE": "0"}, free_port(), logdir / "api.log")
    workers = [WorkerProcess(env, "openapi-base", logdir), WorkerProcess({**env, "AUK_VARIANT": "flash"},
                                                                          "openapi-flash", logdir)]  # fmt: skip
    try:
        api.start()
        for worker in workers:
            worker.start().wait_state(client, "ready", timeout=120)
        yield Live(api, client)
    finally:
        for worker in workers:
            worker.terminate(timeout=20)
        api.stop()
        client.close()


def wav_bytes(seconds: float, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def seed_records(url: str) -> dict[str, list[str]]:
    """Real records for schemathesis to name beside the ids it makes up: an upload, two voices, a job, a batch.
    (Its generated clips are random bytes, so no upload or voice of its own ever succeeds.)"""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        upload = http.post("/v1/uploads", files={"file": ("ref.wav", wav_bytes(1.0), "audio/wav")})
        assert upload.status_code == 201, upload.text
        upload_id = upload.json()["upload_id"]
        voices = [http.post("/v1/voices", json={"upload_id": upload_id, "name": f"v{n}"}) for n in range(2)]
        assert all(voice.status_code == 201 for voice in voices), voices[0].text
        job = http.post("/v1/jobs", json={"instruction": "A calm narrator: \"One.\"", "gen_seconds": 1})
        batch = http.post("/v1/batches", content=BATCH_EXAMPLE, headers={"Content-Type": "application/x-ndjson"})
        assert job.status_code == 202 and batch.status_code == 202, (job.text, batch.text)
    return {"uploads": [upload_id], "voices": [voice.json()["voice_id"] for voice in voices],
            "jobs": [job.json()["id"]], "batches": [batch.json()["id"]]}  # fmt: skip


def schemathesis_config(records: dict[str, list[str]]) -> str:
    """``schemathesis.toml``: the seeded ids offered for half the path ids and upload ids it generates."""
    lines = [f"[dictionaries.{name}]\nvalues = {json.dumps(ids)}\n" for name, ids in records.items()]
    lines.append("[parameters]")
    for key, name in (("path.job_id", "jobs"), ("path.batch_id", "batches"), ("path.voice_id", "voices"),
                      ("body.upload_id", "uploads"), ("body.audio.upload_id", "uploads")):  # fmt: skip
        lines.append(f'"{key}" = {{ dictionary = "{name}", probability = 0.5 }}')
    return "\n".join(lines) + "\n"


def test_live_answers_match_the_document(live: Live, tmp_path: Path) -> None:
    """schemathesis over every operation (its examples, coverage, fuzzing and stateful phases, following the
    document's links; valid and invalid requests), each request sent with the key: no 5xx, and a status, content
    type and body the document lists. Its own command line runs it, seeded, so that a failure names the request
    that reproduces it."""
    config = tmp_path / "schemathesis.toml"
    config.write_text(schemathesis_config(seed_records(live.api.url)))
    command = [str(VENV_BIN / "schemathesis"), "--config-file", str(config), "run", f"{live.api.url}/openapi.json",
               "--header", f"Authorization: Bearer {KEY}", "--checks", ",".join(CHECKS),
               "--phases", "examples,coverage,fuzzing,stateful", "--mode", "all", "--max-examples", str(MAX_EXAMPLES),
               "--seed", SEED, "--workers", "1", "--generation-with-security-parameters", "false",
               "--generation-database", "none", "--request-timeout", "90", "--suppress-health-check", "all",
               "--no-color", "--report", "junit", "--report-dir", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "SCHEMATHESIS_HOOKS": "tests.service.schemathesis_hooks"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"{output[-12000:]}\n--- API log ---\n{live.api.log_tail(4000)}"
    tested = re.search(r"(\d+) generated", output)
    assert tested and int(tested.group(1)) >= 100, output[-3000:]
