"""Texts and recordings of any length end to end: the real API over HTTP (and the official ``openai`` SDK), the
session's redis-server and SeaweedFS, and a real worker process on the model-free instant pipeline (silence of the
exact length: what these tests check is the splitting, the grouping, the joined length, the record, cancel and
the stored files). Its deploy config is ``config/auk-bulk.yaml``, so a long job's segments render 8 to a group.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import openai
import pytest
import redis
import soundfile as sf

from tests.service.conftest import BUCKET
from tests.service.harness import REPO, ApiProcess, RedisServer, S3Server, WorkerProcess, connection_env, free_port

KEY = "longform-key-0123456789"
PREFIX = "test-longform"
SR, HOP = 24_000, 480
SENTENCES = [
    "The lighthouse keeper climbed the stairs each evening, counting every step.",
    "Storms came and went; the light never failed!",
    "Did anyone thank him?",
    "Ships passed in the dark, their crews asleep, trusting a lamp they would never see up close.",
]


def english(chars: int) -> str:
    """An English text of exactly ``chars`` characters, sentences numbered so that no two segments are alike."""
    out, i = [], 0
    while sum(len(s) + 1 for s in out) < chars:
        out.append(f"Night {i}. " + SENTENCES[i % len(SENTENCES)])
        i += 1
    return " ".join(out)[:chars].rstrip() + "."


@dataclass
class Service:
    url: str
    redis: redis.Redis
    s3: S3Server
    worker: WorkerProcess
    start_worker: Callable[[], WorkerProcess]

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)

    def wait(self, job_id: str, timeout: float = 120.0) -> dict:
        with self.http() as http:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                job = http.get(f"/v1/jobs/{job_id}").json()
                if job["status"] in ("succeeded", "failed", "canceled"):
                    return job
                time.sleep(0.1)
        raise TimeoutError(f"job {job_id} did not end in {timeout} s")

    def audio(self, job: dict) -> np.ndarray:
        data = httpx.get(job["result"]["url"], timeout=120).content
        samples, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert rate == SR
        return samples


@pytest.fixture(scope="module")
def service(redis_server: RedisServer, s3_server: S3Server,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:  # fmt: skip
    logdir = tmp_path_factory.mktemp("longform")
    env = connection_env(redis_server, s3_server, S3_BUCKET=BUCKET, S3_PREFIX=PREFIX, VARIANT="base",
                         PIPELINE="instant", VISIBILITY_TIMEOUT="60", RETRY_BACKOFF="0.5",
                         DEPLOY_CONFIG=str(REPO / "config" / "auk-bulk.yaml"))  # fmt: skip
    client = redis_server.client()
    client.flushdb()
    api = ApiProcess({**env, "AUK_API_KEYS": KEY}, free_port(), logdir / "api.log")
    started: list[WorkerProcess] = []

    def start_worker() -> WorkerProcess:
        # Each step sleeps 5 ms: a long job's groups take long enough to be canceled (or killed) between them.
        worker = WorkerProcess({**env, "AUK_INSTANT_STEP_DELAY": "0.005"}, "longform-instant", logdir)
        started.append(worker)
        worker.start().wait_state(client, "ready", timeout=120)
        return worker

    try:
        api.start()
        yield Service(api.url, client, s3_server, start_worker(), start_worker)
    finally:
        for worker in started:
            worker.terminate(timeout=20)
        api.stop()
        client.close()


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


def check_segments(job: dict, samples: int, overlap: float = 0.04) -> None:
    """The record lists the segments in order, each inside the file, the last ending at its end; neighbours
    overlap by at most their cross-fade."""
    segments = job["result"]["segments"]
    plan = job["request"]["plan"]
    assert len(segments) == plan["duration"]["segments"] == job["progress"]["total"] == job["progress"]["step"]
    assert segments[0]["start"] == 0.0 and abs(segments[-1]["end"] - samples / SR) < 1e-3
    assert all(a["end"] <= b["start"] + overlap + 1e-3 for a, b in zip(segments, segments[1:]))


# ---------------------------------------------------------------------------------------------- the OpenAI SDK


def test_openai_sdk_speaks_2000_characters_with_only_model_voice_and_input(service: Service) -> None:
    """2 000 characters (over two minutes of speech) with nothing but model, voice and input: one file of the
    estimated length, rendered as segments in one described voice (the first segment anchors the others)."""
    text = english(2000)
    sdk = openai.OpenAI(base_url=f"{service.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    response = sdk.audio.speech.create(model="tts-1", voice="", input=text, response_format="wav")
    samples, rate = sf.read(io.BytesIO(response.content), dtype="float32")
    job = service.wait(response.response.headers["x-job-id"])
    plan = job["request"]["plan"]
    assert job["status"] == "succeeded" and rate == SR
    assert plan["kind"] == "text" and plan["voice"] == "anchor" and plan["duration"]["source"] == "rate:latin"
    assert len(samples) == plan["samples"] == job["result"]["samples"]
    assert abs(len(samples) / SR - 2000 / 15.0) < 15  # the Latin rate, plus pauses
    segments = plan["segments"]
    assert segments[0]["instruction"].startswith("Generate speech based on the following description")
    assert all(s["instruction"].startswith("Say the following with the same voice") for s in segments[1:])
    assert " ".join(s["text"] for s in segments).split() == text.split()  # every word, none cut
    check_segments(job, len(samples))
    # The anchor alone, then the other segments 8 to a pass.
    assert job["result"]["passes"] == 1 + -(-(len(segments) - 1) // 8)


# ---------------------------------------------------------------------------------------------- batches and jobs


def test_a_batch_line_of_20000_characters_is_one_job_of_one_file(service: Service) -> None:
    long_line = {"custom_id": "chapter", "text": english(20_000), "num_inference_steps": 1}
    short_line = {"custom_id": "short", "text": "A short line.", "num_inference_steps": 1}
    with service.http() as http:
        created = http.post("/v1/batches", content="\n".join(json.dumps(line) for line in (long_line, short_line)),
                            headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
        assert created.status_code in (200, 201, 202), created.text
        batch_id = created.json()["id"]
        deadline = time.monotonic() + 240
        while http.get(f"/v1/batches/{batch_id}").json()["status"] != "done":
            assert time.monotonic() < deadline, "batch did not finish"
            time.sleep(0.2)
        jobs = {job["custom_id"]: job for job in http.get("/v1/jobs", params={"batch_id": batch_id}).json()["data"]}
    chapter = service.wait(jobs["chapter"]["id"])
    assert chapter["status"] == "succeeded", chapter["error"]
    plan = chapter["request"]["plan"]
    assert len(plan["segments"]) >= 60 and chapter["result"]["samples"] == plan["samples"]
    assert abs(plan["duration"]["seconds"] - chapter["result"]["duration_s"]) < 1e-3
    check_segments(chapter, chapter["result"]["samples"])
    short = service.wait(jobs["short"]["id"])
    assert short["status"] == "succeeded" and short["request"]["plan"]["kind"] == "single"
    assert short["request"]["duration"]["source"] == "rate:latin"
    # The finished job's segment objects are removed; its file stays.
    assert not [k for k in _keys(service) if f"{chapter['id']}/segments/" in k]


def _keys(service: Service) -> list[str]:
    pages = service.s3.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


@pytest.mark.parametrize("name, text, language, source", [
    ("chinese", "今天天气很好，我们一起去公园散步。孩子们在草地上奔跑，老人们坐在长椅上聊天！" * 12, None, "rate:cjk"),
    ("mixed", "我们用 TensorFlow 和 PyTorch 训练模型, then we ship it to production. 然后部署到服务器上。" * 8, None,
     "rate:mixed"),
    ("japanese", "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。" * 8, "ja", "rate:cjk"),
    ("no punctuation", " ".join(["lighthouse keepers climb stairs every evening"] * 60), None, "rate:latin"),
])  # fmt: skip
def test_scripts_and_unpunctuated_text_split_into_one_file_with_subtitles(
    service: Service, name: str, text: str, language: str | None, source: str
) -> None:
    body = {"text": text, "num_inference_steps": 1, "timestamps": "srt", "seed": 11}
    if language:
        body["language"] = language
    with service.http() as http:
        created = http.post("/v1/jobs", json=body)
    assert created.status_code in (200, 201, 202), created.text
    job = service.wait(created.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    plan = job["request"]["plan"]
    assert plan["kind"] == "text" and plan["duration"]["source"] == source
    assert "".join(s["text"] for s in plan["segments"]).replace(" ", "") == text.replace(" ", "")
    if name == "chinese":
        assert plan["segments"][0]["instruction"].startswith("请基于下面的描述")
    audio = service.audio(job)
    assert len(audio) == plan["samples"]
    check_segments(job, len(audio))
    stamps = job["result"]["timestamps"]
    srt = httpx.get(stamps["url"], timeout=30).text  # presigned beside the audio's URL
    assert stamps["format"] == "srt" and srt.startswith("1\n00:00:00,000 --> ")
    assert srt.count(" --> ") == len(plan["segments"]) and plan["segments"][-1]["text"] in srt


def test_a_ten_minute_recording_is_enhanced_in_windows(service: Service) -> None:
    rate = 16_000
    t = np.arange(600 * rate) / rate
    tone = (0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, tone, rate, format="WAV", subtype="PCM_16")
    with service.http() as http:
        upload = http.post("/v1/uploads", files={"file": ("ten.wav", buf.getvalue(), "audio/wav")})
        assert upload.status_code == 201, upload.text
        body = {"task": "enhance", "audio": {"upload_id": upload.json()["upload_id"]}, "num_inference_steps": 1,
                "response_format": "flac"}
        created = http.post("/v1/jobs", json=body)
    assert created.status_code in (200, 201, 202), created.text
    job = service.wait(created.json()["id"], timeout=240)
    assert job["status"] == "succeeded", job["error"]
    plan = job["request"]["plan"]
    assert plan["kind"] == "windows" and plan["instruction"].startswith("Preserve all speakers")
    assert job["result"]["samples"] == 600 * 50 * HOP and plan["duration"] == {"seconds": 600.0, "source": "clip",
                                                                               "segments": len(plan["windows"])}
    check_segments(job, job["result"]["samples"], overlap=0.5)


def test_cancel_stops_a_long_text_at_the_next_segment(service: Service) -> None:
    body = {"text": english(6000), "num_inference_steps": 40}  # 40 steps of 5 ms: 0.2 s a group
    with service.http() as http:
        job_id = http.post("/v1/jobs", json=body).json()["id"]
        deadline = time.monotonic() + 60
        while True:
            job = http.get(f"/v1/jobs/{job_id}").json()
            if job["status"] == "running" and (job["progress"] or {}).get("step", 0) >= 1:
                break
            assert time.monotonic() < deadline and job["status"] in ("queued", "running"), job
            time.sleep(0.02)
        assert http.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    final = service.wait(job_id)
    assert final["status"] == "canceled" and final["result"] is None
    total = len(final["request"]["plan"]["segments"])
    assert final["progress"]["step"] < total
    time.sleep(1.0)  # the worker stops at its next step and removes the segments it stored
    assert not [k for k in _keys(service) if job_id in k]


@pytest.mark.parametrize("body, field, words", [
    ({"text": " \t\n "}, "text", "empty once cleaned"),
    ({"text": "x" * 100_001}, "text", "100000"),
    ({"text": "Short words then " + "a" * 600}, "text", "longer than one segment"),
    ({"text": "Hello.", "speed": 9.0}, "speed", "4"),
    ({"text": "Hello.", "ref_text": "Hello."}, "ref_text", "needs its clip"),
    ({"task": "enhance"}, "audio", "works on a recording"),
    ({"instruction": "Say the following: \"" + "word " * 200 + "\""}, "gen_seconds", "over one 30 s pass"),
])  # fmt: skip
def test_bad_long_input_is_a_4xx_naming_the_field(service: Service, body: dict, field: str, words: str) -> None:
    with service.http() as http:
        response = http.post("/v1/jobs", json=body)
    assert 400 <= response.status_code < 500, response.text
    text = json.dumps(response.json())
    assert field in text and words in text, text


def test_a_transcript_that_does_not_fit_its_clip_is_refused(service: Service) -> None:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(2 * SR, dtype=np.float32) + 0.01, SR, format="WAV")
    with service.http() as http:
        upload = http.post("/v1/uploads", files={"file": ("c.wav", buf.getvalue(), "audio/wav")})
        upload_id = upload.json()["upload_id"]
        response = http.post("/v1/jobs", json={"text": english(3000), "audio": {"upload_id": upload_id},
                                               "ref_text": english(900)})  # fmt: skip
        assert response.status_code == 422 and "ref_text" in error_of(response)["message"], response.text
        fits = http.post("/v1/jobs", json={"text": english(1000), "audio": {"upload_id": upload_id},
                                           "ref_text": "Night zero, the lamp.", "num_inference_steps": 1})  # fmt: skip
    assert fits.status_code in (200, 201, 202), fits.text
    job = service.wait(fits.json()["id"])
    plan = job["request"]["plan"]
    assert job["status"] == "succeeded" and plan["voice"] == "clip" and plan["duration"]["source"] == "ref_text"
    assert job["result"]["samples"] == plan["samples"]


def test_speech_input_over_4096_characters_is_refused_by_name(service: Service) -> None:
    with service.http() as http:
        response = http.post("/v1/audio/speech", json={"model": "auk", "input": english(4200)})
    assert response.status_code == 422 and "input" in response.text and "4096" in response.text, response.text


def test_a_killed_worker_loses_no_finished_segment(service: Service) -> None:
    """SIGKILL mid-text: the next worker renders only the segments that were not stored, and the file is whole."""
    body = {"text": english(8000), "num_inference_steps": 40, "seed": 5}
    with service.http() as http:
        job_id = http.post("/v1/jobs", json=body).json()["id"]
        deadline = time.monotonic() + 60
        while (http.get(f"/v1/jobs/{job_id}").json()["progress"] or {}).get("step", 0) < 9:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    service.worker.kill()
    stored = [k for k in _keys(service) if f"{job_id}/segments/" in k]
    service.worker = service.start_worker()  # its reaper sends the dead worker's job again
    final = service.wait(job_id, timeout=120)
    assert final["status"] == "succeeded" and final["attempts"] == 2, final
    total = len(final["request"]["plan"]["segments"])
    assert 9 <= len(stored) < total
    assert final["result"]["segments_rendered"] == total - len(stored)
    assert final["result"]["samples"] == final["request"]["plan"]["samples"]
