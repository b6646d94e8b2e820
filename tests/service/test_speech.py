"""``POST /v1/audio/speech``, voices and output formats end to end: the real API under uvicorn over HTTP, the
session's redis-server and SeaweedFS, a real worker process (the model-free instant pipeline: its audio is silence
of the exact length, which is what the format checks decode). The speech endpoint is called with the official
``openai`` SDK and with plain HTTP in vLLM-Omni's documented AuK request shape.
"""

from __future__ import annotations

import base64
import http.server
import io
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import redis
import soundfile as sf

from auk_client import ApiError, Client
from tests.service.conftest import BUCKET
from tests.service.harness import ApiProcess, RedisServer, S3Server, WorkerProcess, connection_env, free_port

KEY_A, KEY_B = "speech-key-alpha-0123", "speech-key-bravo-0123"
PREFIX = "test-speech"
SR, HOP = 24_000, 480
FORMATS = ("wav", "wav_float", "flac", "mp3", "opus", "pcm")
ZERO_SHOT = 'Say the following with the same voice: "Hello there."'
INSTRUCT = 'Generate speech based on the following description: "A calm voice." The content to speak is: "Hi."'


@dataclass
class Service:
    url: str
    redis: redis.Redis
    s3: S3Server
    worker: WorkerProcess
    api: ApiProcess
    clip_url: str  # a WAV served on 127.0.0.1 (AUK_FETCH_ALLOW lists it)

    def http(self, key: str = KEY_A) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def client(self, key: str = KEY_A) -> Client:
        return Client(self.url, key)

    def sdk(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)


def wav_bytes(seconds: float, rate: int = 16_000, channels: int = 1) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    tone = (0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, np.repeat(tone[:, None], channels, axis=1), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def expected_samples(seconds: float) -> int:
    return math.ceil(50 * seconds) * HOP


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int, int]:
    """(samples [t, channels], rate, channels) of an encoded answer; raw PCM is 16-bit mono at 24 kHz."""
    if fmt == "pcm":
        samples = np.frombuffer(data, dtype="<i2").astype(np.float32)[:, None] / 32768
        return samples, SR, 1
    samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return samples, rate, samples.shape[1]


@pytest.fixture(scope="module")
def clip_server() -> Iterator[str]:
    """A plain HTTP server on 127.0.0.1 that serves one WAV (a remote ``ref_audio``)."""
    body = wav_bytes(0.8)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Type", "audio/wav")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/ref.wav"
    server.shutdown()


@pytest.fixture(scope="module")
def service(redis_server: RedisServer, s3_server: S3Server, clip_server: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:  # fmt: skip
    logdir = tmp_path_factory.mktemp("speech")
    env = connection_env(redis_server, s3_server, S3_BUCKET=BUCKET, S3_PREFIX=PREFIX, VARIANT="base",
                         PIPELINE="instant", VISIBILITY_TIMEOUT="30", RETRY_BACKOFF="0.5")  # fmt: skip
    client = redis_server.client()
    client.flushdb()
    api = ApiProcess({**env, "AUK_API_KEYS": f"{KEY_A},{KEY_B}", "AUK_FETCH_ALLOW": "127.0.0.1/32"}, free_port(),
                     logdir / "api.log")  # fmt: skip
    worker = WorkerProcess(env, "speech-instant", logdir)
    try:
        api.start()
        worker.start().wait_state(client, "ready", timeout=120)
        yield Service(api.url, client, s3_server, worker, api, clip_server)
    finally:
        worker.terminate(timeout=20)
        api.stop()
        client.close()


# ---------------------------------------------------------------------------------------------- the OpenAI SDK


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "pcm"])
def test_openai_sdk_answers_each_format(service: Service, fmt: str) -> None:
    """``client.audio.speech.create`` with each OpenAI format: the bytes decode to mono 24 kHz of the asked
    length, the job behind them is recorded and its stored copy follows the answer."""
    sdk = service.sdk()
    response = sdk.audio.speech.create(model="tencent/AuK", voice="", input="Hello from the SDK.",
                                       response_format=fmt,
                                       extra_body={"task_type": "CustomVoice", "duration_seconds": 0.7,
                                                   "num_inference_steps": 2})  # fmt: skip
    samples, rate, channels = decode(response.content, fmt)
    assert (rate, channels, len(samples)) == (SR, 1, expected_samples(0.7))
    job_id = response.response.headers["x-job-id"]
    timing = response.response.headers["server-timing"]
    assert all(f"{name};dur=" in timing for name in ("queue", "render", "encode", "transfer", "total"))
    with service.client() as auk:
        job = auk.wait_job(job_id, interval=0.05, timeout=30)
    assert job.status == "succeeded" and job.result.format == fmt
    assert job.result.key.endswith(f".{'pcm' if fmt == 'pcm' else fmt}")
    assert job.request["instruction"] == 'Say the following: "Hello from the SDK."'
    assert job.request["priority"] == "interactive" and job.request["num_inference_steps"] == 2
    stored = httpx.get(job.result.url, timeout=30)
    assert stored.content == response.content  # the stored copy is the answer's bytes
    assert stored.headers["content-type"].split(";")[0] == response.response.headers["content-type"].split(";")[0]


def test_openai_sdk_streaming_response_and_voice(service: Service, tmp_path: Path) -> None:
    """``with_streaming_response`` with a saved voice as ``voice``: a zero-shot render of the clip's length."""
    with service.client() as auk:
        voice = auk.create_voice(wav_bytes(0.9, rate=44_100, channels=2), name="narrator", filename="n.wav")
    sdk = service.sdk()
    out = tmp_path / "speech.flac"
    with sdk.audio.speech.with_streaming_response.create(
        model="auk", voice=voice.voice_id, input="Hello there.", response_format="flac",
        extra_body={"task_type": "Base"},
    ) as response:
        assert response.headers["content-type"] == "audio/flac"
        response.stream_to_file(out)
    samples, rate, channels = decode(out.read_bytes(), "flac")
    # Without duration_seconds the target is the clip's whole frames, as a job without gen_seconds.
    assert (rate, channels, len(samples)) == (SR, 1, (int(0.9 * 44_100) * SR // 44_100 // HOP) * HOP)


@pytest.mark.parametrize(("extra", "named"), [
    ({"speed": 1.5}, "speed"),
    ({"response_format": "aac"}, "aac"),
    ({"extra_body": {"speaker_embedding": [0.1, 0.2]}}, "speaker_embedding"),
    ({"extra_body": {"stream": True}}, "stream"),
    ({"extra_body": {"sample_rate": 16000}}, "sample_rate"),
    ({"extra_body": {"extra_params": {"t_grid": [0, 1]}}}, "extra_params.t_grid"),
    ({"voice": "alloy"}, "voice"),
    ({"model": "whisper-1"}, "model"),
])  # fmt: skip
def test_what_cannot_be_honoured_is_refused_by_name(service: Service, extra: dict, named: str) -> None:
    args = {"model": "auk", "voice": "", "input": INSTRUCT, "response_format": "wav",
            "extra_body": {"duration_seconds": 0.5}}  # fmt: skip
    body = {**args["extra_body"], **extra.pop("extra_body", {})}
    with pytest.raises(openai.APIStatusError) as refused:
        service.sdk().audio.speech.create(**{**args, **extra, "extra_body": body})
    assert 400 <= refused.value.status_code < 500
    assert named in refused.value.response.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------- vLLM-Omni's shape


def test_vllm_omni_request_shape_over_plain_http(service: Service) -> None:
    """vLLM-Omni's AuK serving shape: the whole instruction in ``instructions``, ``input`` empty, the reference
    clip as a base64 data URL, ``duration_seconds``, the knobs in ``extra_params`` and ``seed``."""
    ref = "data:audio/wav;base64," + base64.b64encode(wav_bytes(1.1)).decode()
    body = {"model": "tencent/AuK", "input": "", "instructions": ZERO_SHOT, "ref_audio": ref, "duration_seconds": 0.6,
            "response_format": "wav", "seed": 3, "extra_params": {"num_inference_steps": 4, "guidance_scale": 1.5}}
    with service.http() as http:
        response = http.post("/v1/audio/speech", json=body)
        assert response.status_code == 200, response.text
        samples, rate, channels = decode(response.content, "wav")
        assert (rate, channels, len(samples)) == (SR, 1, expected_samples(0.6))
        job_id = response.headers["x-job-id"]
        with service.client() as auk:
            job = auk.wait_job(job_id, interval=0.05, timeout=30)
        assert job.request["instruction"] == ZERO_SHOT and job.request["seed"] == 3
        assert job.request["clip"]["key"].startswith(f"{PREFIX}/clips/") and job.request["clip"]["sha256"]
        assert job.result.num_inference_steps == 4 and job.result.guidance_scale == 1.5
        # The same clip again is the same stored object (content-addressed per owner).
        again = http.post("/v1/audio/speech", json={**body, "ref_audio": ref.split(",", 1)[1]})
        assert again.status_code == 200 and again.content == response.content
        second = http.get(f"/v1/jobs/{again.headers['x-job-id']}").json()
        assert second["request"]["clip"]["key"] == job.request["clip"]["key"]
        # A job like any other: the other key cannot see it.
        with service.http(KEY_B) as other:
            assert other.get(f"/v1/jobs/{job_id}").status_code == 404


def test_remote_ref_audio_only_from_allowed_hosts(service: Service) -> None:
    with service.http() as http:
        body = {"instructions": ZERO_SHOT, "duration_seconds": 0.4, "response_format": "pcm"}
        allowed = http.post("/v1/audio/speech", json={**body, "ref_audio": service.clip_url})
        assert allowed.status_code == 200, allowed.text
        assert len(allowed.content) == expected_samples(0.4) * 2
        elsewhere = service.clip_url.replace("127.0.0.1", "127.0.0.2")
        refused = http.post("/v1/audio/speech", json={**body, "ref_audio": elsewhere})
        assert refused.status_code == 422
        assert refused.json()["error"]["code"] == "url_not_allowed" and "allow-list" in refused.text


def test_a_failed_job_answers_with_its_error(service: Service) -> None:
    """The worker cannot read the voice's clip (its object was removed behind the API's back): it fails the job
    and pushes the failure, and the speech request answers with the job's error rather than waiting."""
    with service.client() as auk:
        voice = auk.create_voice(wav_bytes(0.5), name="gone")
    service.s3.client().delete_object(Bucket=BUCKET, Key=f"{PREFIX}/voices/{voice.voice_id}")
    started = time.monotonic()
    with service.http() as http:
        response = http.post("/v1/audio/speech", json={"instructions": ZERO_SHOT, "voice": voice.voice_id})
    assert response.status_code == 422 and response.json()["error"]["code"] == "audio_not_found"
    assert time.monotonic() - started < 5
    job = httpx.get(f"{service.url}/v1/jobs/{response.headers['x-job-id']}",
                    headers={"Authorization": f"Bearer {KEY_A}"}).json()  # fmt: skip
    assert job["status"] == "failed"


# ---------------------------------------------------------------------------------------------- voices


def test_voices_are_owned_listed_and_deleted(service: Service) -> None:
    with service.client() as auk, service.client(KEY_B) as other:
        upload = auk.upload(wav_bytes(0.7, rate=22_050), "u.wav")
        from_upload = auk.create_voice(upload_id=upload.upload_id, name="from upload")
        from_file = auk.create_voice(wav_bytes(0.6), name="from file")
        assert from_upload.voice_id.startswith("voice_") and from_upload.sample_rate == 22_050
        assert [v.voice_id for v in auk.list_voices()][:2] == [from_file.voice_id, from_upload.voice_id]
        assert auk.get_voice(from_file.voice_id) == from_file
        assert other.list_voices() == []
        with pytest.raises(ApiError) as hidden:
            other.get_voice(from_file.voice_id)
        assert hidden.value.status == 404
        with pytest.raises(ApiError) as foreign:  # another key's voice is unknown to a job as well
            other.create_job(ZERO_SHOT, voice=from_file.voice_id, gen_seconds=0.3)
        assert foreign.value.status == 422 and foreign.value.code == "unknown_voice"
        with pytest.raises(ApiError) as foreign_upload:
            other.create_voice(upload_id=upload.upload_id)
        assert foreign_upload.value.code == "unknown_upload"

        job = auk.wait_job(auk.create_job(ZERO_SHOT, voice=from_upload.voice_id, gen_seconds=0.3,
                                          response_format="flac").id, interval=0.05, timeout=30)  # fmt: skip
        assert job.status == "succeeded" and job.request["clip"]["voice_id"] == from_upload.voice_id
        samples, rate, channels = decode(auk.download(job), "flac")
        assert (rate, channels, len(samples)) == (SR, 1, expected_samples(0.3))

        auk.delete_voice(from_upload.voice_id)
        with pytest.raises(ApiError):
            auk.get_voice(from_upload.voice_id)
        assert service.s3.keys(BUCKET, f"{PREFIX}/voices/{from_upload.voice_id}") == []
        with pytest.raises(ApiError) as bad:
            auk.create_voice(b"not audio at all", filename="x.wav")
        assert bad.value.status == 422


# ---------------------------------------------------------------------------------------------- formats


def test_every_format_on_jobs_and_batch_lines(service: Service) -> None:
    """``response_format`` (or ``format``) on a job and on batch lines: each stored object has its format's
    extension and content type and decodes back to mono 24 kHz of the asked length."""
    with service.client() as auk:
        jobs = {fmt: auk.create_job(INSTRUCT, gen_seconds=0.5, response_format=fmt, num_inference_steps=1)
                for fmt in FORMATS}  # fmt: skip
        lines = [{"instruction": INSTRUCT, "gen_seconds": 0.3, "format": fmt, "custom_id": f"line-{fmt}",
                  "num_inference_steps": 1} for fmt in FORMATS]  # fmt: skip
        batch = auk.wait_batch(auk.create_batch(lines).id, interval=0.2, timeout=60)
        assert batch.counts["succeeded"] == len(FORMATS)
        done = [auk.wait_job(job.id, interval=0.05, timeout=30) for job in jobs.values()]
        done += auk.batch_jobs(batch.id)
        for job in done:
            fmt = job.request["response_format"]
            assert job.status == "succeeded" and job.result.format == fmt
            extension = "wav" if fmt == "wav_float" else fmt
            assert job.result.key.endswith(f".{extension}")
            head = service.s3.client().head_object(Bucket=BUCKET, Key=job.result.key)
            assert head["ContentType"] == job.result.content_type
            samples, rate, channels = decode(auk.download(job), fmt)
            seconds = job.request["gen_seconds"]
            assert (rate, channels, len(samples)) == (SR, 1, expected_samples(seconds)), fmt
        manifest = auk.fetch_url(batch.manifest.url).decode()
        assert all(f".{'wav' if fmt == 'wav_float' else fmt}\"" in manifest for fmt in FORMATS)
        with pytest.raises(ApiError) as refused:
            auk.create_job(INSTRUCT, gen_seconds=0.5, response_format="aac")
        assert refused.value.status == 422 and "aac" in refused.value.message


# ---------------------------------------------------------------------------------------------- the voice cache


def test_a_voice_renders_bit_identical_from_the_workers_cache(service: Service, redis_server: RedisServer,
                                                              s3_server: S3Server, tmp_path: Path) -> None:  # fmt: skip
    """A real worker on the tiny Flash checkpoint (CPU): the same voice and seed twice through the speech endpoint
    give the same bytes, and the second render read the voice from the worker's cache (no reference encode)."""
    from auk_worker.tiny.checkpoint import make_tiny_checkpoint
    from tests.service.harness import REPO

    checkpoint = make_tiny_checkpoint(tmp_path / "flash", variant="flash")
    env = connection_env(redis_server, s3_server, S3_BUCKET=BUCKET, S3_PREFIX=PREFIX, VARIANT="flash",
                         PIPELINE="auk", CHECKPOINT=str(checkpoint),
                         DEPLOY_CONFIG=str(REPO / "config" / "auk-flash.yaml"))  # fmt: skip
    worker = WorkerProcess(env, "speech-tiny-flash", tmp_path).start()
    try:
        worker.wait_state(service.redis, "ready", timeout=300)
        with service.client() as auk:
            voice = auk.create_voice(wav_bytes(0.8, rate=32_000), name="tiny")
            answers = [auk.speech(ZERO_SHOT, voice=voice.voice_id, variant="flash", seed=5, duration_seconds=0.4)
                       for _ in range(2)]  # fmt: skip
            jobs = [auk.wait_job(answer.job_id, interval=0.05, timeout=60) for answer in answers]
    finally:
        worker.terminate(timeout=30)
    assert answers[0].audio == answers[1].audio
    samples, rate, _ = decode(answers[0].audio, "wav")
    assert rate == SR and len(samples) == expected_samples(0.4) and np.abs(samples).max() > 0
    assert jobs[0].result.timings["vae_encode"] > 0 and jobs[1].result.timings["vae_encode"] == 0
