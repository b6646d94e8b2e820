"""The 30 s rule at its boundary: the API, the worker, the pipeline and the instant pipeline give one verdict.

Clips at awkward sample rates sit exactly on a latent-frame boundary (the fewest samples whose 24 kHz copy holds
``c`` whole frames) or one sample short of it, with a target that brings clip plus target to exactly 1500 frames
(30 s) or one frame over. Each request goes through the real code paths: the API over its app (upload, then
``POST /v1/jobs``, with the session's Redis and SeaweedFS), the worker's ``steps.prepare`` on the record (fetch, decode,
length rule), ``AuKPipeline.target_frames`` on the length ``resample`` returns, and the instant pipeline's render.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
from fastapi.testclient import TestClient

from api.app import create_app
from auk_worker import rules
from auk_worker.audio import decode_audio, resample
from auk_worker.deploy import load_deploy_config
from auk_worker.errors import InputError
from auk_worker.pipeline import AuKPipeline
from auk_worker.service.worker.instant import InstantPipeline
from auk_worker.service.records.jobs import JobRecord, owner_id
from auk_worker.service.records.store import JobStore
from auk_worker.service.records.requests import JobRequest
from auk_worker.service.connect.settings import Settings
from auk_worker.service.connect.storage import Storage
from auk_worker.service.worker.runtime import RenderRuntime
from auk_worker.service.worker.steps import prepare
from auk_worker.types import RenderRequest
from tests.service.harness import REPO

KEY = "key-length-rule-0123456789"


def first_sample_count(frames: int, rate: int) -> int:
    """The fewest samples at ``rate`` whose 24 kHz copy holds ``frames`` whole frames."""
    n = frames * 480 * rate // 24_000 - 2
    while rules.clip_frames(n, rate) < frames:
        n += 1
    return n


def gen_seconds_for(frames: int) -> float:
    """A length whose target is exactly ``frames`` (half a frame below it, so no rounding can move it)."""
    return (frames - 0.5) / 50


def wav(samples: int, rate: int) -> bytes:
    tone = 0.1 * np.random.default_rng(samples).standard_normal(samples)
    buf = io.BytesIO()
    sf.write(buf, tone.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def cases(rate: int) -> list[tuple[int, int | None, bool]]:
    """(clip samples, target frames or None for the clip's own length, fits in 30 s)."""
    at_500, at_751 = first_sample_count(500, rate), first_sample_count(751, rate)
    return [
        (at_500, 1000, True),  # 500 + 1000 frames: exactly 30 s
        (at_500, 1001, False),  # one frame over
        (at_500 - 1, 1001, True),  # one sample less is one frame less: 499 + 1001
        (first_sample_count(750, rate), None, True),  # 750 + 750, the target being the clip's length
        (at_751, None, False),  # 751 + 751
        (at_751 - 1, None, True),  # 750 + 750
    ]


@pytest.mark.parametrize("rate", [44_100, 22_050, 8_000, 11_025])
def test_api_and_worker_agree_at_exactly_30_s_and_one_frame_over(rate, service_env, redis_client) -> None:
    settings = Settings.from_env({**service_env, "AUK_API_KEYS": KEY})
    store, storage = JobStore(redis_client), Storage(settings)
    deploy = load_deploy_config(REPO / "config" / "auk.yaml")
    instant = InstantPipeline("base", deploy)
    runtime = RenderRuntime(settings, instant, store, storage)
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(create_app(settings)) as http:
        for samples, frames, fits in cases(rate):
            assert rules.clip_frames(samples, rate) in (499, 500, 750, 751)
            data = wav(samples, rate)
            upload = http.post("/v1/uploads", files={"file": ("clip.wav", data, "audio/wav")}, headers=auth)
            assert upload.status_code == 201, upload.text
            # A speaking instruction: one pass, whatever the clip's length (a same-length task over a clip longer
            # than 15 s renders in windows instead: tests/service/test_longform.py).
            body = {"instruction": 'Say the following with the same voice: "Same voice."',
                    "audio": {"upload_id": upload.json()["upload_id"]}}
            if frames is not None:
                body["gen_seconds"] = gen_seconds_for(frames)
            created = http.post("/v1/jobs", json=body, headers=auth)
            api = created.status_code == 202
            assert created.status_code in (202, 422), created.text
            if not api:
                assert "the model renders at most 30 s in total" in created.json()["error"]["message"]

            # The worker reads the record: the API's own, or for a refused request the one a caller could only
            # have written past the API.
            if api:
                record = store.get(created.json()["id"])
            else:
                request = JobRequest.model_validate(body).model_dump(mode="json")
                record = JobRecord.new(owner_id(KEY), {**request, "clip": None})
            worker = _verdict(lambda: prepare(runtime, record))

            clip = decode_audio(data)
            assert len(clip.samples) == samples and clip.sample_rate == rate
            render_request = RenderRequest("Same voice.", audio=clip, gen_seconds=body.get("gen_seconds"))
            clip_24k = len(resample(clip.samples, rate, 24_000))
            pipeline = _verdict(lambda: AuKPipeline.target_frames(render_request, clip_24k))
            model_free = _verdict(lambda: instant.render(render_request))
            assert api == worker == pipeline == model_free == fits, (rate, samples, frames)


def _verdict(check) -> bool:
    try:
        check()
    except InputError:
        return False
    return True
