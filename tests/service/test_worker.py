"""Worker processes end to end, without the API: records are created with ``JobStore``, tasks sent by name with a
Celery client app, and each test asserts what the Redis records, the bucket and the broker queues hold.

Most tests run the instant pipeline (``AUK_PIPELINE=instant``; ``AUK_INSTANT_STEP_DELAY`` stretches a job so a
test can act in the middle of it); ``test_tiny_checkpoint_job_succeeds`` runs the real pipeline on the tiny
checkpoint once that lands.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from api.submit import record_request
from auk_worker.rules import frames_for_seconds
from auk_worker.service.records.attempts import attempt_key
from auk_worker.service.queues.celery_app import RENDER_TASK, make_celery, queue_name
from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.records.store import JobStore
from auk_worker.service.records.requests import JobRequest
from auk_worker.service.connect.settings import Settings
from auk_worker.service.connect.storage import Storage
from auk_worker.service.records.objects import manifest_key, result_key
from auk_worker.types import HOP

OWNER = "0123456789abcdef"


def expected_samples(gen_seconds: float) -> int:
    return frames_for_seconds(gen_seconds) * HOP


def make_record(body: dict[str, Any]) -> JobRecord:
    request = JobRequest.model_validate(body)
    return JobRecord.new(OWNER, record_request(request, None), queue=queue_name(request.variant, request.priority),
                         custom_id=request.custom_id)


def send(settings: Settings, record: JobRecord) -> None:
    make_celery(settings).send_task(RENDER_TASK, args=[record.id], queue=record.queue)


def submit(store: JobStore, settings: Settings, **body: Any) -> JobRecord:
    record, created = store.create(make_record({"instruction": "Say hello.", "gen_seconds": 1.0, **body}))
    assert created
    send(settings, record)
    return record


def wait_for(store: JobStore, job_id: str, until, timeout: float = 30.0, what: str = "") -> JobRecord:
    deadline = time.monotonic() + timeout
    record = store.get(job_id)
    while time.monotonic() < deadline:
        record = store.get(job_id)
        if record is not None and until(record):
            return record
        time.sleep(0.05)
    raise AssertionError(f"job {job_id}: {what or 'condition'} not reached in {timeout} s; record: {record}")


def wait_terminal(store: JobStore, job_id: str, timeout: float = 30.0) -> JobRecord:
    return wait_for(store, job_id, lambda r: r.terminal, timeout, "a terminal state")


def broker_idle(redis_client, variant: str = "base") -> bool:
    """No message waiting in this variant's queues and none delivered but unacknowledged."""
    queues = [queue_name(variant, p) for p in ("interactive", "bulk")]
    waiting = sum(redis_client.llen(q) for q in queues)
    return waiting == 0 and redis_client.hlen("unacked") == 0


def read_wav(storage: Storage, key: str) -> tuple[np.ndarray, int, str]:
    data = storage.get_bytes(storage.bucket, key)
    info = sf.info(io.BytesIO(data))
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    return samples, rate, info.subtype


def wavs(storage: Storage, settings: Settings) -> list[str]:
    return [k for k in storage.list_keys(f"{settings.s3_prefix}jobs/") if k.endswith(".wav")]


# ------------------------------------------------------------------------------------------------ happy path


def test_jobs_and_batch_succeed_with_wavs_metadata_and_manifest(
    start_worker, store, settings, storage, redis_client
) -> None:
    worker = start_worker("w-happy")
    beat = worker.wait_state(redis_client, "ready", timeout=60)
    assert beat["variant"] == "base"

    pcm = submit(store, settings, gen_seconds=1.3, seed=7, custom_id="pcm")
    flt = submit(store, settings, gen_seconds=0.5, output_format="float32", num_inference_steps=5)
    done = wait_terminal(store, pcm.id)
    assert done.status == JobStatus.SUCCEEDED, done.error
    assert done.attempts == 1 and done.kills == 0 and done.error is None
    assert done.progress == {"step": 32, "total": 32}
    assert done.started_at and done.finished_at and done.started_at <= done.finished_at
    key = result_key(settings.s3_prefix, pcm.id)
    assert done.result["key"] == key and done.result["bucket"] == settings.s3_bucket
    assert done.result["seed"] == 7 and done.result["sample_rate"] == 24_000
    samples, rate, subtype = read_wav(storage, key)
    assert (rate, subtype, len(samples)) == (24_000, "PCM_16", expected_samples(1.3))
    assert done.result["duration_s"] == pytest.approx(len(samples) / 24_000)
    meta = storage.head(key)["Metadata"]
    assert meta["seed"] == "7" and meta["variant"] == "base" and meta["job-id"] == pcm.id
    assert meta["custom-id"] == "pcm" and meta["steps"] == "32" and len(meta["instruction-sha256"]) == 16

    done = wait_terminal(store, flt.id)
    assert done.status == JobStatus.SUCCEEDED, done.error
    samples, rate, subtype = read_wav(storage, done.result["key"])
    assert (subtype, len(samples)) == ("FLOAT", expected_samples(0.5))
    assert done.progress == {"step": 5, "total": 5}

    # A batch on the bulk queue: every WAV, then one manifest listing them all.
    records = [make_record({"instruction": f"Line {i}.", "gen_seconds": 0.2 + 0.1 * i, "custom_id": f"c{i}",
                            "priority": "bulk"}) for i in range(4)]  # fmt: skip
    batch_id = store.create_batch(OWNER, records)
    for record in records:
        send(settings, record)
    for record in records:
        assert wait_terminal(store, record.id).status == JobStatus.SUCCEEDED
    batch = wait_for_batch_manifest(store, batch_id)
    assert batch["counts"] == {"queued": 0, "running": 0, "succeeded": 4, "failed": 0, "canceled": 0}
    lines = [json.loads(line) for line in storage.get_bytes(storage.bucket, batch["manifest_key"]).decode().splitlines()]
    assert batch["manifest_key"] == manifest_key(settings.s3_prefix, batch_id)
    assert [line["custom_id"] for line in lines] == ["c0", "c1", "c2", "c3"]
    assert all(line["status"] == "succeeded" and line["key"] == result_key(settings.s3_prefix, line["job_id"])
               for line in lines)  # fmt: skip
    for i, record in enumerate(records):
        assert len(read_wav(storage, result_key(settings.s3_prefix, record.id))[0]) == expected_samples(0.2 + 0.1 * i)
    assert len(wavs(storage, settings)) == 6
    assert broker_idle(redis_client)

    # A redelivered message of a finished job is acknowledged without a second render.
    send(settings, records[0])
    time.sleep(0.5)
    assert store.get(records[0].id).attempts == 1
    assert broker_idle(redis_client)

    # Warm shutdown: SIGTERM in the middle of a job lets it finish first.
    assert worker.terminate(timeout=20) == 0
    slow = submit(store, settings, gen_seconds=0.4, num_inference_steps=60)
    worker_slow = start_worker("w-slow", AUK_INSTANT_STEP_DELAY="0.03")
    worker_slow.wait_state(redis_client, "busy", timeout=60)
    assert worker_slow.terminate(timeout=30) == 0
    done = store.get(slow.id)
    assert done.status == JobStatus.SUCCEEDED and done.attempts == 1
    assert broker_idle(redis_client)
    assert worker_slow.heartbeat(redis_client) == {}


def wait_for_batch_manifest(store: JobStore, batch_id: str, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = store.get_batch(batch_id)
        if batch["manifest_key"]:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id}: no manifest after {timeout} s: {store.get_batch(batch_id)}")


def test_a_delivery_of_an_ended_batch_writes_its_missing_manifest(start_worker, store, settings, storage,
                                                                   redis_client) -> None:  # fmt: skip
    """Two batches whose last end no worker followed with a manifest: one whose worker recorded the last job and
    died before the upload (scripted here with the store), one whose jobs were all canceled while queued. The next
    delivery of any of their jobs writes the manifest, once."""
    died = [make_record({"instruction": f"Line {i}.", "gen_seconds": 0.2, "custom_id": f"d{i}", "priority": "bulk"})
            for i in range(2)]  # fmt: skip
    died_batch = store.create_batch(OWNER, died)
    for record in died:
        store.start(record.id, "gone-host:1")
    assert not store.finish(died[0].id, {"key": "jobs/d0.wav"}).batch_done
    assert store.fail(died[1].id, "invalid_audio", "scripted").batch_done  # that worker's turn to write it
    canceled = [make_record({"instruction": "Hi.", "gen_seconds": 0.2, "priority": "bulk"}) for _ in range(2)]
    canceled_batch = store.create_batch(OWNER, canceled)
    for record in canceled:
        store.cancel(record.id, OWNER)
    assert store.get_batch(died_batch)["manifest_key"] is None and store.get_batch(canceled_batch)["done"]

    worker = start_worker("w-manifest")
    worker.wait_state(redis_client, "ready", timeout=60)
    for record in (died[1], *canceled):  # each batch's messages, as the broker would redeliver or deliver them
        send(settings, record)
    died_lines = [json.loads(line) for line in storage.get_bytes(
        storage.bucket, wait_for_batch_manifest(store, died_batch)["manifest_key"]).decode().splitlines()]
    assert [(line["custom_id"], line["status"]) for line in died_lines] == [("d0", "succeeded"), ("d1", "failed")]
    assert died_lines[0]["key"] == "jobs/d0.wav" and died_lines[1]["error"]["code"] == "invalid_audio"
    canceled_lines = storage.get_bytes(
        storage.bucket, wait_for_batch_manifest(store, canceled_batch)["manifest_key"]).decode().splitlines()
    assert [json.loads(line)["status"] for line in canceled_lines] == ["canceled", "canceled"]
    wait_for(store, died[0].id, lambda r: broker_idle(redis_client), 10, "the broker to drain")
    assert all(store.get(r.id).attempts == 1 for r in died) and wavs(storage, settings) == []  # nothing rendered
    log = worker.log_tail(20_000)
    assert log.count(f"batch {canceled_batch}: manifest") == 1, log  # the second delivery found it stored


def test_tiny_checkpoint_job_succeeds(start_worker, tiny_checkpoint, store, settings, storage, redis_client) -> None:
    worker = start_worker("w-tiny", ["--checkpoint", str(tiny_checkpoint)], AUK_PIPELINE="auk")
    worker.wait_state(redis_client, "ready", timeout=120)
    job = submit(store, settings, gen_seconds=0.6, num_inference_steps=3, seed=3)
    done = wait_terminal(store, job.id, timeout=120)
    assert done.status == JobStatus.SUCCEEDED, done.error
    samples, rate, subtype = read_wav(storage, done.result["key"])
    assert (rate, subtype, len(samples)) == (24_000, "PCM_16", expected_samples(0.6))
    assert np.isfinite(samples).all()
    assert set(done.result["model_hashes"]) >= {"dit", "vae"}
    assert done.progress == {"step": 3, "total": 3}


# ------------------------------------------------------------------------------------------------ faults


def test_sigkill_mid_job_second_worker_finishes_it(start_worker, store, settings, storage, redis_client) -> None:
    first = start_worker("w-doomed", AUK_INSTANT_STEP_DELAY="0.1")
    first.wait_state(redis_client, "ready", timeout=60)
    job = submit(store, settings, gen_seconds=0.8, num_inference_steps=20)
    wait_for(store, job.id, lambda r: (r.progress or {}).get("step", 0) >= 3, 20, "step 3")
    first.kill()

    held = store.get(job.id)
    assert held.status == JobStatus.RUNNING and held.attempts == 1
    assert redis_client.hlen("unacked") == 1  # the broker still holds the delivered message

    second = start_worker("w-rescue", AUK_INSTANT_STEP_DELAY="0.01")
    second.wait_state(redis_client, "ready", timeout=60)
    done = wait_terminal(store, job.id, timeout=40)
    assert done.status == JobStatus.SUCCEEDED, done.error
    assert done.attempts == 2 and done.kills == 1
    assert wavs(storage, settings) == [attempt_key(settings.s3_prefix, job.id, 2)] == [done.result["key"]]
    assert len(read_wav(storage, done.result["key"])[0]) == expected_samples(0.8)
    wait_for(store, job.id, lambda r: broker_idle(redis_client), 10, "the broker to drain")


def test_bad_input_fails_at_once_and_worker_goes_on(start_worker, store, settings, storage, redis_client) -> None:
    inputs = f"operator-inputs/{settings.s3_prefix}"  # the input location, apart from the service's own objects
    worker = start_worker("w-bad", AUK_S3_INPUT_BUCKET=settings.s3_bucket, AUK_S3_INPUT_PREFIX=inputs)
    worker.wait_state(redis_client, "ready", timeout=60)
    storage.client.put_object(Bucket=settings.s3_bucket, Key=f"{inputs}notes.txt",
                              Body=b"this is a shopping list, not a recording\n" * 20)  # fmt: skip

    bad = submit(store, settings, audio={"key": "notes.txt"}, gen_seconds=0.5)
    missing = submit(store, settings, audio={"key": "absent.wav"})
    good = submit(store, settings, gen_seconds=0.3)

    done = wait_terminal(store, bad.id)
    assert done.status == JobStatus.FAILED and done.attempts == 1
    assert done.error["code"] == "invalid_audio" and "not audio" in done.error["message"]
    done = wait_terminal(store, missing.id)
    assert done.status == JobStatus.FAILED and done.attempts == 1
    assert done.error["code"] == "audio_not_found" and "absent.wav" in done.error["message"]

    done = wait_terminal(store, good.id)
    assert done.status == JobStatus.SUCCEEDED
    assert wavs(storage, settings) == [result_key(settings.s3_prefix, good.id)]
    assert worker.proc.poll() is None and worker.heartbeat(redis_client)["pid"] == str(worker.pid)
    assert "retry" not in worker.log_tail(20000)
    assert broker_idle(redis_client)


def test_job_that_killed_its_worker_three_times_fails(start_worker, store, settings, storage, redis_client) -> None:
    record, _ = store.create(make_record({"instruction": "Crash me.", "gen_seconds": 0.5}))
    # Three deliveries whose workers all died holding the job (each start under a new holder).
    for holder in ("dead-1:11", "dead-2:22", "dead-3:33"):
        store.start(record.id, holder)
    assert store.get(record.id).kills == 2
    worker = start_worker("w-crash")
    worker.wait_state(redis_client, "ready", timeout=60)
    send(settings, record)
    done = wait_terminal(store, record.id)
    assert done.status == JobStatus.FAILED and done.kills == 3 and done.attempts == 4
    assert done.error["code"] == "worker_crashed" and "died 3 times" in done.error["message"]
    assert wavs(storage, settings) == []
    # Two deliveries: this one and the reaper's (the last holder is dead); the later one meets a failed record.
    wait_for(store, record.id, lambda r: broker_idle(redis_client), 10, "both deliveries acknowledged")


def test_cancel_while_running_stops_without_upload(start_worker, store, settings, storage, redis_client) -> None:
    worker = start_worker("w-cancel", AUK_INSTANT_STEP_DELAY="0.05")
    worker.wait_state(redis_client, "ready", timeout=60)
    job = submit(store, settings, num_inference_steps=200)
    wait_for(store, job.id, lambda r: (r.progress or {}).get("step", 0) >= 2, 20, "step 2")
    assert store.cancel(job.id, "another-owner") is None
    assert store.cancel(job.id, OWNER).status == JobStatus.CANCELED
    wait_for(store, job.id, lambda r: broker_idle(redis_client), 10, "the task to stop")
    done = store.get(job.id)
    assert done.status == JobStatus.CANCELED and done.progress["step"] < 200
    assert wavs(storage, settings) == []
    assert worker.heartbeat(redis_client)["state"] == "ready"


def test_interactive_queue_drains_before_bulk(start_worker, store, settings, redis_client) -> None:
    bulk = [submit(store, settings, gen_seconds=0.2, priority="bulk") for _ in range(3)]
    interactive = submit(store, settings, gen_seconds=0.2)
    worker = start_worker("w-order")
    worker.wait_state(redis_client, "ready", timeout=60)
    records = [wait_terminal(store, r.id) for r in [*bulk, interactive]]
    assert all(r.status == JobStatus.SUCCEEDED for r in records)
    first = min(records, key=lambda r: r.started_at)
    assert first.id == interactive.id


def test_pipeline_load_failure_reports_failed_and_exits(start_worker, tmp_path, redis_client) -> None:
    worker = start_worker("w-noload", ["--checkpoint", str(tmp_path / "no-such-checkpoint")], AUK_PIPELINE="auk")
    assert worker.wait_exit(timeout=60) == 1
    beat = worker.heartbeat(redis_client)
    assert beat["state"] == "failed" and beat["pid"] == str(worker.pid)
    assert beat["error"]  # the load error, for whoever reads the heartbeat


def test_uploads_send_their_body_with_the_headers(storage) -> None:
    """Every upload body is already in memory, so no ``Expect: 100-continue`` round trip before it; the object
    arrives whole (a real SeaweedFS over HTTP)."""
    sent: list[dict[str, str]] = []

    def record(request, **_) -> None:
        sent.append(dict(request.headers))

    storage.client.meta.events.register("before-send.s3.PutObject", record)
    try:
        data = bytes(range(256)) * 400  # 100 kB
        storage.put_wav("expect-test/a.wav", data, {"job-id": "a"})
    finally:
        storage.client.meta.events.unregister("before-send.s3.PutObject", record)
    assert len(sent) == 1
    assert "Expect" not in sent[0] and sent[0]["Content-Length"] == str(len(data))
    assert storage.get_bytes(storage.bucket, "expect-test/a.wav") == data
