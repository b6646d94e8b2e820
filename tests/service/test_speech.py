"""``POST /v1/audio/speech``, voices and output formats end to end: the real API under uvicorn over HTTP, the
session's redis-server and SeaweedFS, a real worker process (the model-free instant pipeline: its audio is silence
of the exact length, which is what the format checks decode). The speech endpoint is called with the official
``openai`` SDK and with plain HTTP in vLLM-Omni's documented AuK request shape.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import av
import numpy as np
import openai
import pytest
import redis
import soundfile as sf
from openai._streaming import SSEDecoder

from auk_client import ApiError, Client
from auk_worker.longform.duration import Estimator
from auk_worker.longform.instructions import SPEAK, write_instruction
from auk_worker.voice_catalogue import load_catalogue
from tests.service.conftest import BUCKET
from tests.service.harness import ApiProcess, RedisServer, S3Server, WorkerProcess, connection_env, free_port

KEY_A, KEY_B = "speech-key-alpha-0123", "speech-key-bravo-0123"
PREFIX = "test-speech"
SR, HOP = 24_000, 480
FORMATS = ("wav", "wav_float", "flac", "mp3", "opus", "aac", "pcm")
# The 4xx codes README's error table lists.
LISTED_CODES = {"malformed_body", "malformed_json", "unauthorized", "not_found", "method_not_allowed", "body_timeout",
                "too_large", "unsupported_media_type", "invalid_request", "invalid_audio", "unknown_upload",
                "unknown_voice", "audio_not_found", "unsupported_field", "unsupported_format", "url_not_allowed",
                "invalid_url", "fetch_failed"}  # fmt: skip
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


def written(request: dict) -> str:
    """The instruction the service wrote for a job's text (a one-pass plan's)."""
    assert request["plan"]["kind"] == "single"
    return request["plan"]["instruction"]


def instruct(description: str, text: str, style: str | None = None) -> str:
    return write_instruction(SPEAK, text, description=description, style=style)


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int, int]:
    """(samples [t, channels], rate, channels) of an encoded answer; raw PCM is 16-bit mono at 24 kHz; AAC (which
    libsndfile cannot read) through FFmpeg (PyAV)."""
    if fmt == "pcm":
        samples = np.frombuffer(data, dtype="<i2").astype(np.float32)[:, None] / 32768
        return samples, SR, 1
    if fmt == "aac":
        return decode_ffmpeg(data, "aac")
    samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return samples, rate, samples.shape[1]


def decode_ffmpeg(data: bytes, demuxer: str | None = None) -> tuple[np.ndarray, int, int]:
    """FFmpeg's decode (PyAV): (samples [t, channels], rate, channels); Opus decodes at 48 kHz there."""
    with av.open(io.BytesIO(data), format=demuxer) as container:  # a short ADTS stream is not probed: name it
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() for frame in container.decode(stream)]
        rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
    samples = np.concatenate(frames, axis=1).T if frames else np.zeros((0, channels), np.float32)
    return samples, rate, channels


def expected_aac_samples(seconds: float) -> int:
    """An ADTS stream has no place for the encoder's delay and padding: its decode is whole 1024-sample frames,
    priming first."""
    return (math.ceil(expected_samples(seconds) / 1024) + 1) * 1024


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


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "aac", "pcm"])
def test_openai_sdk_answers_each_format(service: Service, fmt: str) -> None:
    """``client.audio.speech.create`` with each OpenAI format and a built-in voice: the bytes decode to mono
    24 kHz of the asked length, the job behind them is recorded and its stored copy follows the answer."""
    sdk = service.sdk()
    response = sdk.audio.speech.create(model="tts-1", voice="coral", input="Hello from the SDK.",
                                       response_format=fmt,
                                       extra_body={"duration_seconds": 0.7, "num_inference_steps": 2})  # fmt: skip
    samples, rate, channels = decode(response.content, fmt)
    length = expected_aac_samples(0.7) if fmt == "aac" else expected_samples(0.7)
    assert (rate, channels, len(samples)) == (SR, 1, length)
    job_id = response.response.headers["x-job-id"]
    timing = response.response.headers["server-timing"]
    assert all(f"{name};dur=" in timing for name in ("queue", "render", "encode", "transfer", "total"))
    with service.client() as auk:
        job = auk.wait_job(job_id, interval=0.05, timeout=30)
    assert job.status == "succeeded" and job.result.format == fmt
    assert job.result.key.endswith(f".{'pcm' if fmt == 'pcm' else fmt}")
    coral = load_catalogue().get("coral")
    assert written(job.request) == instruct(coral.description, "Hello from the SDK.")
    assert job.request["seed"] == coral.seed and job.request["voice"] == "coral"
    assert job.request["priority"] == "interactive" and job.request["num_inference_steps"] == 2
    stored = httpx.get(job.result.url, timeout=30)
    assert stored.content == response.content  # the stored copy is the answer's bytes
    assert stored.headers["content-type"].split(";")[0] == response.response.headers["content-type"].split(";")[0]


def test_openai_sdk_streaming_response_and_voice(service: Service, tmp_path: Path) -> None:
    """``with_streaming_response`` with a saved voice as ``voice``: a zero-shot render of the text's estimated
    length (no transcript: the speaking rate, not the clip's length)."""
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
    assert (rate, channels, len(samples)) == (SR, 1, expected_samples(Estimator()("Hello there.")))


@pytest.mark.parametrize(("extra", "named"), [
    ({"speed": 1.5}, "speed"),  # a whole instruction has no text whose length a speed could scale
    ({"speed": 5.0}, "speed"),
    ({"response_format": "aiff"}, "aiff"),
    ({"extra_body": {"language": "Klingon"}}, "language"),
    ({"response_format": "flac", "extra_body": {"stream": True}}, "stream"),
    ({"response_format": "flac", "stream_format": "audio"}, "stream_format"),
    ({"extra_body": {"stream_format": "video"}}, "stream_format"),
    ({"extra_body": {"sample_rate": 16000}}, "sample_rate"),
    ({"extra_body": {"extra_params": {"t_grid": [0, 1]}}}, "extra_params.t_grid"),
    ({"extra_body": {"x_vector_only_mode": True}}, "x_vector_only_mode"),
    ({"extra_body": {"speaker_embedding": [0.1, 0.2]}}, "speaker_embedding"),
    ({"voice": "no-such-voice"}, "alloy"),  # an unknown voice is answered with the names there are
    ({"model": "whisper-1"}, "model"),
    ({"extra_body": {"duration_seconds": "3"}}, "duration_seconds"),  # a string, refused as /v1/jobs refuses it
    ({"extra_body": {"duration_seconds": -1}}, "duration_seconds"),
    ({"extra_body": {"duration_seconds": 40}}, "duration_seconds"),
])  # fmt: skip
def test_what_cannot_be_honoured_is_refused_by_name(service: Service, extra: dict, named: str) -> None:
    """Each refusal is a 4xx whose message names the field as the caller wrote it: never the job's own names."""
    args = {"model": "auk", "voice": "", "input": INSTRUCT, "response_format": "wav",
            "extra_body": {"duration_seconds": 0.5}}  # fmt: skip
    body = {**args["extra_body"], **extra.pop("extra_body", {})}
    with pytest.raises(openai.APIStatusError) as refused:
        service.sdk().audio.speech.create(**{**args, **extra, "extra_body": body})
    assert 400 <= refused.value.status_code < 500
    error = refused.value.response.json()["error"]
    assert named in error["message"] and "gen_seconds" not in error["message"]
    assert error["code"] in LISTED_CODES


# ---------------------------------------------------------------------------------------------- voices and text


def test_an_unchanged_openai_program(service: Service) -> None:
    """OpenAI's quick start as written (model, voice, input, nothing else): an MP3, OpenAI's default, in the
    built-in voice's description and seed, its length estimated from the text."""
    text = "Today is a wonderful day to build something people love!"
    response = service.sdk().audio.speech.create(model="gpt-4o-mini-tts", voice="alloy", input=text)
    assert response.response.headers["content-type"] == "audio/mpeg"
    samples, rate, channels = decode(response.content, "mp3")
    estimate = Estimator()(text)
    assert (rate, channels, len(samples)) == (SR, 1, expected_samples(estimate))
    with service.client() as auk:
        job = auk.wait_job(response.response.headers["x-job-id"], interval=0.05, timeout=30)
    alloy = load_catalogue().get("alloy")
    assert written(job.request) == instruct(alloy.description, text)
    assert (job.request["seed"], job.request["plan"]["gen_seconds"], job.result.format) == (alloy.seed, estimate, "mp3")


def test_speed_style_language_and_transcript(service: Service) -> None:
    text = "The quick brown fox jumps over the lazy dog near the river bank."
    natural = Estimator()(text)
    nova = load_catalogue().get("nova")
    body = {"input": text, "voice": "nova", "response_format": "pcm"}
    with service.http() as http:
        fast = http.post("/v1/audio/speech", json={**body, "speed": 2.0, "instructions": "Speak cheerfully."})
        assert fast.status_code == 200, fast.text
        assert len(fast.content) == expected_samples(natural / 2) * 2  # the speed halves the estimate
        job = http.get(f"/v1/jobs/{fast.headers['x-job-id']}").json()
        assert written(job["request"]) == instruct(nova.description, text, "Speak cheerfully.")
        assert "Speak cheerfully." in written(job["request"])
        # A duration that agrees with the speed is taken as given; one that does not is refused, naming both.
        agreed = http.post("/v1/audio/speech", json={**body, "speed": 2.0, "duration_seconds": round(natural / 1.8, 2)})
        assert agreed.status_code == 200 and len(agreed.content) == expected_samples(round(natural / 1.8, 2)) * 2
        refused = http.post("/v1/audio/speech", json={**body, "speed": 2.0, "duration_seconds": round(natural * 2, 2)})
        assert refused.status_code == 422
        assert "speed 2" in refused.json()["error"]["message"] and "duration_seconds" in refused.text
        # Chinese text in Chinese (named, or read so by auto) takes AuK's Chinese sentence and rate.
        chinese = http.post("/v1/audio/speech", json={"input": "今天天气真好", "voice": "vivian", "language": "Chinese",
                                                      "response_format": "pcm"})  # fmt: skip
        assert chinese.status_code == 200, chinese.text
        job = http.get(f"/v1/jobs/{chinese.headers['x-job-id']}").json()
        assert written(job["request"]).startswith("请基于下面的描述")
        assert job["request"]["plan"]["gen_seconds"] == Estimator(language="zh")("今天天气真好")
        # With a clip, its transcript and length set the estimate (upstream's ref_text rule).
        ref = "data:audio/wav;base64," + base64.b64encode(wav_bytes(1.0)).decode()
        said = "Hello, this is a cloned voice speaking."
        cloned = http.post("/v1/audio/speech", json={"task_type": "Base", "input": said, "ref_audio": ref,
                                                     "ref_text": "Original transcript.", "response_format": "pcm",
                                                     "language": "Auto", "x_vector_only_mode": False,
                                                     "max_new_tokens": 2048, "initial_codec_chunk_frames": 0})
        assert cloned.status_code == 200, cloned.text
        expected = Estimator(clip_seconds=1.0, ref_text="Original transcript.")(said)
        assert len(cloned.content) == expected_samples(expected) * 2
        job = http.get(f"/v1/jobs/{cloned.headers['x-job-id']}").json()
        assert written(job["request"]) == write_instruction(SPEAK, said, has_clip=True)


def test_voices_from_descriptions_and_names_on_every_path(service: Service) -> None:
    """A voice made from a description, named; the built-in and the caller's voices by name on the speech route,
    on a job and on batch lines; the listing shows both; an unknown name is refused with the names there are."""
    with service.client() as auk, service.http() as http, service.http(KEY_B) as other:
        made = http.post("/v1/voices", json={"description": "A hoarse old sailor, slow and gravelly.",
                                             "name": "sailor"})  # fmt: skip
        assert made.status_code == 201, made.text
        sailor = made.json()
        assert sailor["source"] == "description" and isinstance(sailor["seed"], int) and sailor["duration_s"] is None
        listing = http.get("/v1/voices").json()
        assert sailor["voice_id"] in [voice["voice_id"] for voice in listing["data"]]
        assert {"default", "alloy", "nova", "marin", "cedar"} <= {voice["name"] for voice in listing["builtin"]}
        for bad in ("-5", "0", "x", "501"):  # refused as /v1/jobs refuses its limit
            assert http.get(f"/v1/voices?limit={bad}").status_code == 422
            assert http.get(f"/v1/jobs?limit={bad}").status_code == 422
        assert http.post("/v1/voices", json={"description": "Anyone.", "name": "alloy"}).status_code == 422

        spoken = http.post("/v1/audio/speech", json={"input": "Ahoy there.", "voice": "sailor", "response_format": "wav"})
        assert spoken.status_code == 200, spoken.text
        job = http.get(f"/v1/jobs/{spoken.headers['x-job-id']}").json()
        assert written(job["request"]) == instruct(sailor["description"], "Ahoy there.")
        assert job["request"]["seed"] == sailor["seed"]
        # By id too, and another key knows neither.
        by_id = http.post("/v1/audio/speech", json={"input": "Ahoy.", "voice": sailor["voice_id"]})
        assert by_id.status_code == 200
        foreign = other.post("/v1/audio/speech", json={"input": "Ahoy.", "voice": "sailor"}).json()["error"]
        assert foreign["code"] == "unknown_voice" and "nova" in foreign["message"]
        assert "this key's voices" not in foreign["message"]  # another key's names are not shown

        queued = http.post("/v1/jobs", json={"input": "Good night.", "voice": "nova", "response_format": "flac"})
        assert queued.status_code == 202, queued.text
        lines = [{"input": "Line one.", "voice": "nova", "custom_id": "nova"},
                 {"input": "Line two.", "voice": "sailor", "custom_id": "sailor", "speed": 1.5},
                 {"input": "Line three.", "custom_id": "default", "format": "mp3"}]  # fmt: skip
        batch = auk.wait_batch(auk.create_batch(lines).id, interval=0.2, timeout=60)
        assert batch.counts["succeeded"] == 3
        by_line = {job.custom_id: job for job in auk.batch_jobs(batch.id)}
        catalogue = load_catalogue()
        assert written(by_line["nova"].request) == instruct(catalogue.get("nova").description, "Line one.")
        assert by_line["sailor"].request["seed"] == sailor["seed"]
        assert by_line["sailor"].request["plan"]["gen_seconds"] == Estimator(speed=1.5)("Line two.")
        assert by_line["default"].request["seed"] == catalogue.default.seed
        job = auk.wait_job(queued.json()["id"], interval=0.05, timeout=30)
        assert job.status == "succeeded" and job.request["seed"] == catalogue.get("nova").seed
        with pytest.raises(ApiError) as bad_line:
            auk.create_batch([{"input": "Hi.", "voice": "nobody", "custom_id": "x"}])
        assert bad_line.value.code == "invalid_batch" and "alloy" in str(bad_line.value.details)


# ---------------------------------------------------------------------------------------------- streaming


def finished_at(job: dict) -> float:
    return datetime.fromisoformat(job["finished_at"].replace("Z", "+00:00")).timestamp()


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus", "aac"])
def test_openai_sdk_streams_audio_in_pieces(service: Service, fmt: str) -> None:
    """``stream_format="audio"`` with ``with_streaming_response``: chunked transfer, more than one chunk, the first
    before the job's record says it ended; the pieces make one file of the format that decodes to the render's
    length (PCM and WAV to the stored copy's very samples)."""
    seconds = 6.0
    chunks, first_at = [], None
    with service.sdk().audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="A longer sentence, said in pieces.", response_format=fmt,
        stream_format="audio", extra_body={"duration_seconds": seconds},
    ) as response:
        assert response.headers["transfer-encoding"] == "chunked"
        job_id = response.headers["x-job-id"]
        for chunk in response.iter_bytes():
            first_at = first_at or time.time()
            chunks.append(chunk)
    assert len(chunks) > 1
    with service.client() as auk:
        job = auk.wait_job(job_id, interval=0.05, timeout=30)
        stored = auk.download(job)
    with service.http() as http:
        record = http.get(f"/v1/jobs/{job_id}").json()
    assert job.status == "succeeded" and first_at < finished_at(record)
    data = b"".join(chunks)
    if fmt in ("pcm", "wav"):
        assert decode(data, fmt)[0].tolist() == decode(stored, fmt)[0].tolist()
        assert len(decode(data, fmt)[0]) == expected_samples(seconds)
    else:  # no encoder-delay tag in a stream: priming and padding of at most a few frames
        samples, rate, channels = decode_ffmpeg(data)
        assert channels == 1 and rate in (SR, 48_000)
        assert 0 <= len(samples) - expected_samples(seconds) * rate // SR <= 4096 * rate // SR


def test_vllm_omni_stream_and_a_client_that_hangs_up(service: Service) -> None:
    """vLLM-Omni's published streaming request as it is (``stream: true``, PCM); then a client that reads one chunk
    and hangs up: the job goes on to store its file and record its end."""
    body = {"input": "Hello, how are you?", "voice": "vivian", "language": "English", "stream": True,
            "response_format": "pcm"}  # fmt: skip
    with service.http() as http:
        with http.stream("POST", "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200 and response.headers["transfer-encoding"] == "chunked"
            data = b"".join(response.iter_raw())
        assert len(data) == expected_samples(Estimator(language="en")(body["input"])) * 2
        with http.stream("POST", "/v1/audio/speech", json={**body, "duration_seconds": 8.0}) as response:
            job_id = response.headers["x-job-id"]
            next(response.iter_raw())
        with service.client() as auk:
            job = auk.wait_job(job_id, interval=0.05, timeout=30)
            assert job.status == "succeeded" and len(decode(auk.download(job), "pcm")[0]) == expected_samples(8.0)


def test_sse_events_parsed_by_the_sdks_decoder(service: Service) -> None:
    """``stream_format="sse"``: ``speech.audio.delta`` events (base64 audio) and a closing ``speech.audio.done``,
    read with the SDK's own server-sent-event decoder."""
    with service.sdk().audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="sage", input="Events, one after another.", response_format="pcm",
        stream_format="sse", extra_body={"duration_seconds": 3.0},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(event.data) for event in SSEDecoder().iter_bytes(response.iter_bytes())]
    kinds = [event["type"] for event in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"} and len(kinds) > 2
    assert set(events[-1]["usage"]) == {"input_tokens", "output_tokens", "total_tokens"}
    audio = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
    assert len(audio) == expected_samples(3.0) * 2


# ---------------------------------------------------------------------------------------------- vLLM-Omni's shape


PUBLISHED = [  # vLLM-Omni's speech examples (examples/online_serving/qwen3_tts/README.md), bodies as published
    {"input": "Hello, how are you?", "voice": "vivian", "language": "English"},
    {"input": "I am so excited!", "voice": "vivian", "instructions": "Speak with great enthusiasm"},
    {"task_type": "VoiceDesign", "input": "哥哥，你回来啦", "instructions": "体现撒娇稚嫩的萝莉女声，音调偏高"},
    {"input": "今天天气真好", "voice": "ryan", "instructions": "用开心的语气说"},
]


@pytest.mark.parametrize("body", PUBLISHED, ids=["custom-voice", "style", "voice-design", "chinese-style"])
def test_vllm_omni_published_examples(service: Service, body: dict) -> None:
    with service.http() as http:
        response = http.post("/v1/audio/speech", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "audio/mpeg" and decode(response.content, "mp3")[1] == SR
        job = http.get(f"/v1/jobs/{response.headers['x-job-id']}").json()
    instruction = written(job["request"])
    assert body["input"] in instruction and body.get("instructions", "") in instruction


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
            length = expected_aac_samples(seconds) if fmt == "aac" else expected_samples(seconds)
            assert (rate, channels, len(samples)) == (SR, 1, length), fmt
        manifest = auk.fetch_url(batch.manifest.url).decode()
        assert all(f".{'wav' if fmt == 'wav_float' else fmt}\"" in manifest for fmt in FORMATS)


# ---------------------------------------------------------------------------------------------- the voice cache


def test_a_voice_renders_bit_identical_from_the_workers_cache(service: Service, redis_server: RedisServer,
                                                              s3_server: S3Server, tmp_path: Path) -> None:  # fmt: skip
    """A real worker on the tiny Flash checkpoint (CPU): the same voice and seed twice through the speech endpoint
    give the same bytes, and the second render read the voice from the worker's cache (no reference encode); a
    built-in voice by name renders bit-identically run to run."""
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
            # A built-in voice by name: its fixed description and seed give the same bytes every time, and another
            # name gives other bytes (the test could fail on either side).
            with service.http() as http:
                named = [http.post("/v1/audio/speech", json={"model": "auk-flash", "voice": name, "input": "Hello.",
                                                             "response_format": "wav_float"})
                         for name in ("nova", "nova", "onyx")]  # fmt: skip
    finally:
        worker.terminate(timeout=30)
    assert [answer.status_code for answer in named] == [200, 200, 200]
    # The float samples themselves (libsndfile stamps a float WAV's PEAK chunk with the time it was written).
    first, again, other = (decode(answer.content, "wav_float")[0] for answer in named)
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert np.abs(first).max() > 0
    assert answers[0].audio == answers[1].audio
    samples, rate, _ = decode(answers[0].audio, "wav")
    assert rate == SR and len(samples) == expected_samples(0.4) and np.abs(samples).max() > 0
    assert jobs[0].result.timings["vae_encode"] > 0 and jobs[1].result.timings["vae_encode"] == 0
