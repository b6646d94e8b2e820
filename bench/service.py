"""The service as a user feels it: ``POST /v1/audio/speech`` from request sent to last byte, through the real
processes (redis-server, SeaweedFS, the API under uvicorn, one worker per variant), with where the time goes.

    python -m bench.service --speech                                   # CPU: the model-free instant pipeline
    python -m bench.service --speech --pipeline random-release         # GPU: release-size random weights
    python -m bench.service --speech --pipeline auk --checkpoint DIR   # GPU: a real checkpoint
    python -m bench.service --startup [--pipeline ...]                 # worker start-up (bench/startup.py)
    python -m bench.service --stream --pipeline auk --checkpoint TINY  # streamed answers: first byte and last
    python -m bench.service --stream --stream-chars 4096 --pipeline random-release  # a long text streamed

For each case (issue 35's rows: Flash 3 s, base instruct 6 s, base zero-shot 12 s with a 5 s reference; and a
zero-shot render with a voice seen before against one with a new voice each time), ``--requests`` warm requests
one after another. Each answer's ``Server-Timing`` gives the split: ``submit`` (checks and the clip), ``queue``
(record written and task sent, to the worker's start), ``prepare`` (the worker starts the record and reads the
clip), ``render``, ``encode`` (the response format), ``transfer`` (the worker's push to the API's receipt, through
Redis); ``total`` is the API's own wall time and ``client`` the wall time the caller saw. ``store`` (the object upload after the
answer) comes from the job's record, and ``recorded_after_answer`` is how long after the answer the record said
``succeeded``. For the instruct case the same render is also timed the old way (``POST /v1/jobs``, poll the
record every 2 ms, download the object), under the same load. The JSON goes to ``bench/results/service-speech-<commit>-<device>-<date>.json``.

``--stream`` times a built-in voice's render (``voice: alloy`` with ``input``, ``--stream-seconds`` of audio) in each
format that streams, answered whole and streamed (``stream_format: "audio"``): the time to the first byte of the
body and to the last, as the caller's HTTP client saw them, and how many chunks came. The JSON goes to
``bench/results/service-stream-<commit>-<device>-<pipeline>-<date>.json``.

On the CPU with ``instant`` the render is silence made at once: the figures are the service's own overhead, not
a GPU render, and are labelled with the pipeline and the device.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from auk_client import Client
from auk_client.types import parse_server_timing
from auk_dev.local import REPO, ApiProcess, RedisServer, S3Server, WorkerProcess, connection_env, free_port
from bench.common import commit

log = logging.getLogger("bench.service")

API_KEY = "bench-key-0123456789abcdef"
SPLIT = ("submit", "queue", "prepare", "render", "encode", "transfer", "total")


@dataclass(frozen=True)
class Case:
    name: str
    variant: str
    gen_seconds: float
    clip_seconds: float = 0.0  # a reference clip of this length (0: instruct TTS)
    voice: str = ""  # "" inline ref_audio; "cached": one voice for every request; "cold": a new voice each time
    target_ms: float | None = None  # issue 35's target on one H200 (none for the voice comparison)


CASES = (
    Case("flash_zero_shot_3s", "flash", 3.0, clip_seconds=3.0, voice="cached", target_ms=35.0),
    Case("base_instruct_6s", "base", 6.0, target_ms=135.0),
    Case("base_zero_shot_12s_ref5s", "base", 12.0, clip_seconds=5.0, voice="cached", target_ms=280.0),
    Case("base_zero_shot_6s_voice_cold", "base", 6.0, clip_seconds=5.0, voice="cold"),
    Case("base_zero_shot_6s_voice_cached", "base", 6.0, clip_seconds=5.0, voice="cached"),
    Case("base_zero_shot_6s_inline_ref", "base", 6.0, clip_seconds=5.0),
)
INSTRUCT = ('Generate speech based on the following description: "A calm, clear adult voice." '
            'The content to speak is: "The service answers as soon as the audio exists."')  # fmt: skip
ZERO_SHOT = 'Say the following with the same voice: "The service answers as soon as the audio exists."'
STREAM_FORMATS = ("pcm", "wav", "mp3", "opus", "aac")
STREAM_TEXT = "The service sends the audio as soon as each piece of it is encoded."


def clip_bytes(seconds: float, seed: int) -> bytes:
    """A 24 kHz mono WAV of noise-modulated tone; a different ``seed`` is different content (a new voice)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 24_000)) / 24_000
    wave = 0.2 * np.sin(2 * np.pi * 180 * t) * (1 + 0.3 * rng.standard_normal(t.size))
    buf = io.BytesIO()
    sf.write(buf, np.clip(wave, -1, 1).astype(np.float32), 24_000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 3), "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
            "min": round(ordered[0], 3), "max": round(ordered[-1], 3)}  # fmt: skip


class SpeechBench:
    def __init__(self, url: str, steps: int | None) -> None:
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300)
        self.client = Client(url, API_KEY, timeout=300)
        self.steps = steps
        self.seed = 0

    def body(self, case: Case, voice_id: str | None) -> dict:
        body = {"model": "auk", "variant": case.variant, "response_format": "wav", "seed": 0,
                "duration_seconds": case.gen_seconds,
                "instructions": ZERO_SHOT if case.clip_seconds else INSTRUCT}  # fmt: skip
        if self.steps is not None and case.variant == "base":
            body["num_inference_steps"] = self.steps
        if voice_id is not None:
            body["voice"] = voice_id
        elif case.clip_seconds:
            body["ref_audio"] = base64.b64encode(clip_bytes(case.clip_seconds, seed=1)).decode()
        return body

    def voice(self, case: Case) -> str | None:
        if not case.voice:
            return None
        self.seed += 1
        seed = 1 if case.voice == "cached" else 1000 + self.seed
        return self.client.create_voice(clip_bytes(case.clip_seconds, seed), name=case.name).voice_id

    def one(self, case: Case, voice_id: str | None) -> dict[str, float]:
        body = self.body(case, voice_id if case.voice != "cold" else self.voice(case))
        started = time.perf_counter()
        response = self.http.post("/v1/audio/speech", json=body)
        client_ms = (time.perf_counter() - started) * 1000
        answered = time.perf_counter()
        if response.status_code != 200:
            raise RuntimeError(f"{case.name}: HTTP {response.status_code}: {response.text[:300]}")
        split = parse_server_timing(response.headers["server-timing"])
        job = self.client.wait_job(response.headers["x-job-id"], interval=0.002, timeout=60)
        split["recorded_after_answer"] = (time.perf_counter() - answered) * 1000
        split["store"] = job.result.timings.get("store", 0.0) * 1000
        split["client"] = client_ms
        split["bytes"] = len(response.content)
        return split

    def via_jobs(self, case: Case) -> dict[str, float]:
        """The same render the old way: ``POST /v1/jobs``, poll the record (every 2 ms), download the object."""
        body = {"instruction": INSTRUCT, "gen_seconds": case.gen_seconds, "variant": case.variant, "seed": 0}
        if self.steps is not None and case.variant == "base":
            body["num_inference_steps"] = self.steps
        started = time.perf_counter()
        job = self.client.wait_job(self.client.submit_job(body).id, interval=0.002, timeout=60)
        data = self.client.download(job)
        return {"client": (time.perf_counter() - started) * 1000, "bytes": len(data)}

    def first_and_last(self, body: dict) -> tuple[float, float, int, int]:
        """(ms to the first body byte, ms to the last, chunks, bytes) of one speech request, read as it arrives."""
        started = time.perf_counter()
        first, chunks, size = None, 0, 0
        with self.http.stream("POST", "/v1/audio/speech", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
            for chunk in response.iter_raw():
                first = first or time.perf_counter()
                chunks += 1
                size += len(chunk)
        last = time.perf_counter()
        return (first - started) * 1000, (last - started) * 1000, chunks, size

    def streaming(self, variant: str, seconds: float, warmup: int, requests: int, chars: int = 0) -> dict:
        """Each streaming format, whole and streamed, interleaved so that both see the same load. With ``chars``, a
        text of that many characters and no length (a long text: its segments stream as they are joined), PCM only."""
        bodies = {}
        for fmt in ("pcm",) if chars else STREAM_FORMATS:
            for mode in ("whole", "stream"):
                body = {"model": "auk", "variant": variant, "voice": "alloy", "input": STREAM_TEXT,
                        "duration_seconds": seconds, "response_format": fmt}  # fmt: skip
                if chars:
                    from bench.longform import english  # torch comes with it: only for this case

                    body["input"] = english(chars)[:chars].rsplit(" ", 1)[0]  # whole words, at most chars
                    del body["duration_seconds"]
                if mode == "stream":
                    body["stream_format"] = "audio"
                if self.steps is not None and variant == "base":
                    body["num_inference_steps"] = self.steps
                bodies[f"{fmt}_{mode}"] = body
        for _ in range(warmup):
            for body in bodies.values():
                self.first_and_last(body)
        runs: dict[str, list] = {name: [] for name in bodies}
        for _ in range(requests):
            for name, body in bodies.items():
                runs[name].append(self.first_and_last(body))
        return {name: {"first_byte_ms": _stats([run[0] for run in rows]),
                       "last_byte_ms": _stats([run[1] for run in rows]),
                       "chunks": _stats([float(run[2]) for run in rows]), "bytes": rows[0][3]}
                for name, rows in runs.items()}  # fmt: skip

    def case(self, case: Case, warmup: int, requests: int) -> dict:
        voice_id = self.voice(case) if case.voice == "cached" else None
        for _ in range(warmup):
            self.one(case, voice_id)
        runs = [self.one(case, voice_id) for _ in range(requests)]
        parts = ("client", *SPLIT, "store", "recorded_after_answer")
        if not case.clip_seconds:  # the same request the old way, for comparison under the same load
            for _ in range(warmup):
                self.via_jobs(case)
            old_way = [self.via_jobs(case)["client"] for _ in range(requests)]
        out = {"variant": case.variant, "gen_seconds": case.gen_seconds, "clip_seconds": case.clip_seconds,
               "clip_source": case.voice or ("inline ref_audio" if case.clip_seconds else "none"),
               "requests": requests, "bytes": int(runs[0]["bytes"]),
               "ms": {part: _stats([run[part] for run in runs]) for part in parts}}  # fmt: skip
        if case.target_ms is not None:
            out["target_ms_h200"] = case.target_ms
        if not case.clip_seconds:
            out["via_jobs_poll_download_ms"] = _stats(old_way)
        return out


def run(args: argparse.Namespace) -> dict:
    cases = [] if args.stream else [case for case in CASES if not args.cases or case.name in args.cases]
    variants = [args.variant] if args.stream else sorted({case.variant for case in cases})
    with tempfile.TemporaryDirectory(prefix="auk-bench-service-") as tmp:
        work = Path(tmp)
        redis_server = RedisServer(work / "redis").start()
        s3 = S3Server(work / "s3").start()
        workers: list[WorkerProcess] = []
        api = None
        try:
            env = connection_env(redis_server, s3, S3_BUCKET="auk-bench", PIPELINE=args.pipeline)
            if args.checkpoint:
                env["AUK_CHECKPOINT"] = str(args.checkpoint)
            # No request quota: the old way's record polling (every 2 ms) is part of what is measured.
            api = ApiProcess({**env, "AUK_API_KEYS": API_KEY, "AUK_QUOTA_RATE": "0"}, free_port(),
                             work / "api.log").start()
            client = redis_server.client()
            for variant in variants:
                worker = WorkerProcess({**env, "AUK_VARIANT": variant}, f"bench-{variant}", work).start()
                workers.append(worker)
                worker.wait_state(client, "ready", timeout=args.start_timeout)
            bench = SpeechBench(api.url, args.steps)
            results = {case.name: bench.case(case, args.warmup, args.requests) for case in cases}
            if args.stream:
                results = bench.streaming(args.variant, args.stream_seconds, args.warmup, args.requests,
                                          args.stream_chars)
        finally:
            for worker in workers:
                worker.terminate(timeout=60)
            if api is not None:
                api.stop()
            s3.stop()
            redis_server.stop()
    device = _device()
    return {
        "benchmark": "service_stream" if args.stream else "service_speech",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "device": device,
        "host": {"name": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "setup": {"pipeline": args.pipeline, "api": "uvicorn, 1 process", "broker": "redis-server (loopback)",
                  "storage": "SeaweedFS S3 (loopback)", "workers": "1 solo process per variant",
                  "hand_over": "worker RPUSH to auk:reply:{job}, API BLPOP (redis.asyncio)",
                  "steps": args.steps, "warmup": args.warmup,
                  "format": "each streaming format" if args.stream else "wav",
                  "checkpoint": str(args.checkpoint) if args.checkpoint else None,
                  **({"variant": args.variant, "audio_seconds": None if args.stream_chars else args.stream_seconds,
                      "text_characters": args.stream_chars or None} if args.stream else {})},  # fmt: skip
        "note": ("instant pipeline: silence made at once, so 'render' is not a GPU render; the figures are the "
                 "service's overhead around it") if args.pipeline == "instant" else "",
        "cases": results,
    }


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name().lower().replace(" ", "-")
    except ImportError:
        pass
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speech", action="store_true", help="the speech endpoint's rows")
    parser.add_argument("--startup", action="store_true",
                        help="worker start-up to the first job accepted, compile caches cold then warm (bench/startup.py)")
    parser.add_argument("--starts", type=int, default=3, help="with --startup: worker starts (the first cold)")
    parser.add_argument("--stream", action="store_true", help="streamed answers against whole ones, each format")
    parser.add_argument("--stream-seconds", type=float, default=6.0, help="with --stream: audio seconds")
    parser.add_argument("--stream-chars", type=int, default=0,
                        help="with --stream: a text of this many characters, its length estimated (long text), PCM")
    parser.add_argument("--variant", default="base", choices=("base", "flash"),
                        help="with --startup or --stream: the worker's")
    parser.add_argument("--deploy-config", type=Path, help="with --startup: the worker's deploy config")
    parser.add_argument("--pipeline", default="instant", choices=("instant", "random-release", "auk"))
    parser.add_argument("--checkpoint", type=Path, help="with --pipeline auk: the checkpoint directory")
    parser.add_argument("--requests", type=int, default=20, help="timed requests per case (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests first (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="base steps (default: the deploy config's 32)")
    parser.add_argument("--cases", nargs="*", help=f"a subset of: {', '.join(case.name for case in CASES)}")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds a worker may take to start")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    if args.speech + args.startup + args.stream != 1:
        parser.error("say which part to run: --speech, --stream or --startup")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.startup:
        return _startup(args)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    kind = ("stream-long" if args.stream_chars else "stream") if args.stream else "speech"
    name = f"service-{kind}-{result['commit']}-{result['device']}-{args.pipeline}-{datetime.now(timezone.utc):%Y-%m-%d}"
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    if args.stream:
        for row, ms in result["cases"].items():
            print(f"{row}: first byte {ms['first_byte_ms']['median']:.1f} ms, last byte "
                  f"{ms['last_byte_ms']['median']:.1f} ms median, {ms['chunks']['median']:.0f} chunks")  # fmt: skip
        print(f"written to {path}")
        return 0
    for case, row in result["cases"].items():
        ms = row["ms"]
        split = ", ".join(f"{part} {ms[part]['median']:.2f}" for part in SPLIT[:-1])
        print(f"{case}: client {ms['client']['median']:.2f} ms median ({split}; store {ms['store']['median']:.2f} "
              f"after the answer)")  # fmt: skip
    print(f"written to {path}")
    return 0


def _startup(args: argparse.Namespace) -> int:
    from bench import startup

    result = {"benchmark": "service_startup", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "commit": commit(), "device": _device(), "pipeline": args.pipeline,
              "host": {"name": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count()},
              **startup.run(args)}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"service-startup-{result['commit']}-{result['device']}-{args.pipeline}-{datetime.now(timezone.utc):%Y-%m-%d}"
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for start in result["starts"]:
        print(f"{start['caches']}: ready {start['ready_s']:.2f} s, first job accepted {start['first_job_accepted_s']:.2f} s")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
