"""Bulk groups end to end: ``auk.render_group`` tasks on real worker processes, and the API cutting a batch into them.

Records are written with ``JobStore`` (or through the real API over HTTP) and each test asserts what the records,
the bucket and the broker queue hold: every job of a group keeps its own seed, WAV, record and failure.
"""

from __future__ import annotations

import base64
import json
import math
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from auk_worker.deploy import DiTSampling
from auk_worker.service.queues.celery_app import RENDER_TASK, make_celery, queue_name
from auk_worker.service.queues.grouping import RENDER_GROUP_TASK, plan_groups
from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.records.store import JobStore
from auk_worker.service.connect.settings import Settings
from auk_worker.service.records.objects import manifest_key, result_key
from bench.throughput import group_phases
from tests.service.harness import REPO, ApiProcess, free_port
from tests.service.test_worker import (
    OWNER,
    broker_idle,
    expected_samples,
    make_record,
    read_wav,
    wait_for,
    wait_for_batch_manifest,
    wait_terminal,
    wavs,
)

BULK = queue_name("base", "bulk")
API_KEY = "key-groups-0123456789"


def create(store: JobStore, **body) -> JobRecord:
    record, created = store.create(make_record({"instruction": "Say hello.", "priority": "bulk", **body}))
    assert created
    return record


def send_group(settings: Settings, records: list[JobRecord]) -> None:
    make_celery(settings).send_task(RENDER_GROUP_TASK, args=[[r.id for r in records]], queue=BULK)


def send_single(settings: Settings, record: JobRecord) -> None:
    make_celery(settings).send_task(RENDER_TASK, args=[record.id], queue=record.queue)


def queued_tasks(redis_client, queue: str) -> list[tuple[str, list]]:
    """(task name, args) of every message waiting in ``queue``, oldest first (kombu pushes on the left)."""
    tasks = []
    for raw in reversed(redis_client.lrange(queue, 0, -1)):
        message = json.loads(raw)
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, _kwargs, _embed = json.loads(body)
        tasks.append((message["headers"]["task"], args))
    return tasks


# ------------------------------------------------------------------------------------------------ grouping plan


def test_plan_groups_sorts_by_schedule_then_length_and_caps_the_size() -> None:
    defaults = DiTSampling(seed=0, num_inference_steps=32, guidance_scale=2.0, sway=-1.0)

    def rec(seconds: float, **knobs) -> JobRecord:
        return make_record({"instruction": "x", "gen_seconds": seconds, "priority": "bulk", **knobs})

    default_knobs = [rec(s) for s in (3.0, 1.0, 2.0)]
    explicit_default = rec(1.5, num_inference_steps=32, guidance_scale=2.0, sway=-1.0)  # same pass as unset knobs
    other = [rec(s, num_inference_steps=8) for s in (0.5, 0.7)]
    flash = rec(1.0, variant="flash")
    groups = plan_groups([*default_knobs, other[0], explicit_default, flash, other[1]], 3, defaults)
    seconds = [[r.request["gen_seconds"] for r in group] for group in groups]
    # Steps 8 sort before 32; within a schedule, shortest first; at most 3 a group; Flash never mixes with base.
    assert seconds == [[0.5, 0.7], [1.0, 1.5, 2.0], [3.0], [1.0]]
    assert groups[-1] == [flash]
    assert [len(g) for g in plan_groups(default_knobs, 1, defaults)] == [1, 1, 1]


# ------------------------------------------------------------------------------------------------ worker


def test_group_renders_in_one_task_matching_single_renders(
    start_worker, tiny_checkpoint, store, settings, storage, redis_client
) -> None:
    worker = start_worker("w-group-tiny", ["--checkpoint", str(tiny_checkpoint)], AUK_PIPELINE="auk",
                          AUK_DEPLOY_CONFIG=str(REPO / "config" / "auk-bulk.yaml"))  # fmt: skip
    worker.wait_state(redis_client, "ready", timeout=120)
    lengths = [0.3, 0.66, 0.5, 0.42]
    body = {"num_inference_steps": 3, "output_format": "float32"}
    group = [create(store, instruction=f"Line {i}.", gen_seconds=s, seed=100 + i, **body)
             for i, s in enumerate(lengths)]  # fmt: skip
    send_group(settings, group)
    batched = []
    for record, seconds in zip(group, lengths):
        done = wait_terminal(store, record.id, timeout=120)
        assert done.status == JobStatus.SUCCEEDED, done.error
        assert done.attempts == 1
        assert done.progress == {"step": 3, "total": 3}
        samples, rate, subtype = read_wav(storage, done.result["key"])
        assert (rate, subtype, len(samples)) == (24_000, "FLOAT", expected_samples(seconds))
        assert np.isfinite(samples).all() and np.abs(samples).max() > 0
        batched.append(samples)
    log = worker.log_tail(200_000)
    assert log.count("group of 4: rendering") == 1  # one task, one render_batch call for all four

    # The same jobs one at a time through auk.render: the same samples up to float32 rounding (CPU, fp32). The
    # padded, masked group pass reduces in a different order than a lone pass; measured max difference 1.3e-7.
    for i, seconds in enumerate(lengths):
        alone = create(store, instruction=f"Line {i}.", gen_seconds=seconds, seed=100 + i, **body)
        send_single(settings, alone)
        done = wait_terminal(store, alone.id, timeout=120)
        assert done.status == JobStatus.SUCCEEDED, done.error
        assert done.result["seed"] == 100 + i
        samples = read_wav(storage, done.result["key"])[0]
        assert len(samples) == len(batched[i])
        diff = float(np.abs(samples - batched[i]).max())
        assert diff <= 1e-6, f"job {i}: the group render differs from the lone render by {diff}"
    assert not np.array_equal(batched[2][: len(batched[0])], batched[0])  # seeds differ, so do the renders

    seeds = [store.get(record.id).result["seed"] for record in group]
    assert seeds == [100 + i for i in range(len(lengths))]  # each job reports its own seed


def test_bad_clip_fails_alone_in_its_group(start_worker, store, settings, storage, redis_client) -> None:
    inputs = f"operator-inputs/{settings.s3_prefix}"  # the input location, apart from the service's own objects
    worker = start_worker("w-group-bad", AUK_S3_INPUT_BUCKET=settings.s3_bucket, AUK_S3_INPUT_PREFIX=inputs)
    worker.wait_state(redis_client, "ready", timeout=60)
    storage.client.put_object(Bucket=settings.s3_bucket, Key=f"{inputs}notes.txt",
                              Body=b"a grocery list, not a recording\n" * 20)  # fmt: skip
    good_a = create(store, gen_seconds=0.4)
    bad = create(store, audio={"key": "notes.txt"}, gen_seconds=0.5)
    good_b = create(store, gen_seconds=0.6)
    send_group(settings, [good_a, bad, good_b])

    done = wait_terminal(store, bad.id)
    assert done.status == JobStatus.FAILED and done.attempts == 1
    assert done.error["code"] == "invalid_audio"
    for record, seconds in ((good_a, 0.4), (good_b, 0.6)):
        done = wait_terminal(store, record.id)
        assert done.status == JobStatus.SUCCEEDED, done.error
        assert len(read_wav(storage, done.result["key"])[0]) == expected_samples(seconds)
    assert sorted(wavs(storage, settings)) == sorted(result_key(settings.s3_prefix, r.id) for r in (good_a, good_b))
    assert "retry" not in worker.log_tail(20_000)


def test_storage_down_during_a_group_keeps_its_audio_until_uploads_succeed(
    start_worker, store, settings, storage, redis_client, s3_server
) -> None:
    """The group's uploads (run concurrently) are refused while storage is down: each job keeps its rendered audio
    and waits, and none is rendered again (the long form is tests/service/test_storage_outage.py)."""
    worker = start_worker("w-group-s3", AUK_INSTANT_STEP_DELAY="0.05", AUK_VISIBILITY_TIMEOUT="60",
                          AUK_STORAGE_RETRY_BACKOFF="0.2", AUK_STORAGE_RETRY_BACKOFF_MAX="1")  # fmt: skip
    worker.wait_state(redis_client, "ready", timeout=60)
    lengths = [0.3, 0.5, 0.4]
    group = [create(store, gen_seconds=s, num_inference_steps=20) for s in lengths]
    send_group(settings, group)
    wait_for(store, group[0].id, lambda r: (r.progress or {}).get("step", 0) >= 2, 20, "step 2")
    s3_server.stop()
    try:
        for record in group:
            wait_for(store, record.id, lambda r: (r.progress or {}).get("step") == 20, 30, "its last step")
        time.sleep(2.0)
        for record in store.get_many([r.id for r in group]):
            assert record.status == JobStatus.RUNNING and record.attempts == 1 and record.error is None
    finally:
        s3_server.start()
    for record, seconds in zip(group, lengths):
        done = wait_terminal(store, record.id, timeout=60)
        assert done.status == JobStatus.SUCCEEDED, done.error
        assert done.attempts == 1 and done.kills == 0
        assert len(read_wav(storage, done.result["key"])[0]) == expected_samples(seconds)
    assert sorted(wavs(storage, settings)) == sorted(result_key(settings.s3_prefix, r.id) for r in group)
    assert "waiting for storage" in worker.log_tail(20_000)
    wait_for(store, group[0].id, lambda r: broker_idle(redis_client), 10, "the broker to drain")


def test_canceled_job_in_a_running_group_stays_canceled_and_neighbours_succeed(
    start_worker, store, settings, storage, redis_client
) -> None:
    worker = start_worker("w-group-cancel", AUK_INSTANT_STEP_DELAY="0.04")
    worker.wait_state(redis_client, "ready", timeout=60)
    records = [make_record({"instruction": f"Line {i}.", "gen_seconds": 0.3 + 0.1 * i, "num_inference_steps": 40,
                            "custom_id": f"c{i}", "priority": "bulk"}) for i in range(3)]  # fmt: skip
    batch_id = store.create_batch(OWNER, records)
    send_group(settings, records)
    victim = records[1]
    wait_for(store, victim.id, lambda r: (r.progress or {}).get("step", 0) >= 3, 20, "step 3")
    assert store.cancel(victim.id, OWNER).status == JobStatus.CANCELED

    for record in (records[0], records[2]):
        done = wait_terminal(store, record.id)
        assert done.status == JobStatus.SUCCEEDED, done.error
        assert done.progress == {"step": 40, "total": 40}  # the group ran to its end
    done = store.get(victim.id)
    assert done.status == JobStatus.CANCELED and done.result is None and done.progress["step"] < 40
    assert sorted(wavs(storage, settings)) == sorted(result_key(settings.s3_prefix, r.id)
                                                     for r in (records[0], records[2]))  # fmt: skip
    batch = wait_for_batch_manifest(store, batch_id)
    assert batch["counts"]["succeeded"] == 2 and batch["counts"]["canceled"] == 1
    lines = [json.loads(line) for line in storage.get_bytes(storage.bucket, batch["manifest_key"]).decode().splitlines()]
    assert [line["status"] for line in lines] == ["succeeded", "canceled", "succeeded"]
    assert batch["manifest_key"] == manifest_key(settings.s3_prefix, batch_id)


# ------------------------------------------------------------------------------------------------ API


def test_api_sends_a_batch_as_groups_of_max_num_seqs(
    service_env, start_worker, store, storage, redis_client, tmp_path: Path
) -> None:
    deploy = yaml.safe_load((REPO / "config" / "auk.yaml").read_text())
    deploy["stages"][1]["max_num_seqs"] = 4
    config = tmp_path / "auk-bulk-4.yaml"
    config.write_text(yaml.safe_dump(deploy))
    env = {**service_env, "AUK_DEPLOY_CONFIG": str(config), "AUK_API_KEYS": API_KEY}
    api = ApiProcess(env, free_port(), tmp_path / "api.log")
    try:
        api.start(timeout=60)
        lengths = [0.2 + 0.05 * ((7 * i) % 10) for i in range(10)]
        jsonl = "\n".join(json.dumps({"instruction": f"Line {i}.", "gen_seconds": s, "custom_id": f"c{i}"})
                          for i, s in enumerate(lengths))  # fmt: skip
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
            response = http.post("/v1/batches", content=jsonl, headers={"Content-Type": "application/x-ndjson"})
            assert response.status_code == 202, response.text
            batch_id = response.json()["id"]

            # Before any worker runs: ceil(10 / 4) group tasks on the bulk queue, shortest jobs together.
            tasks = queued_tasks(redis_client, BULK)
            assert [name for name, _ in tasks] == [RENDER_GROUP_TASK] * math.ceil(10 / 4)
            groups = [args[0] for _, args in tasks]
            assert [len(ids) for ids in groups] == [4, 4, 2]
            assert sorted(i for ids in groups for i in ids) == sorted(r.id for r in store.batch_records(batch_id))
            seconds = [store.get(i).request["gen_seconds"] for ids in groups for i in ids]
            assert seconds == sorted(lengths)

            worker = start_worker("w-group-api", AUK_DEPLOY_CONFIG=str(config))
            worker.wait_state(redis_client, "ready", timeout=60)
            deadline = time.monotonic() + 60
            while (batch := http.get(f"/v1/batches/{batch_id}").json())["status"] != "done":
                assert time.monotonic() < deadline, batch
                time.sleep(0.1)
        assert batch["counts"]["succeeded"] == 10 and batch["manifest"] is not None
        for record in store.batch_records(batch_id):
            assert record.attempts == 1
            samples = read_wav(storage, record.result["key"])[0]
            assert len(samples) == expected_samples(record.request["gen_seconds"])
        log = worker.log_tail(200_000)
        assert log.count("group of 4: rendering") == 2
        phases = group_phases(log)  # each group task's timing line, as bench.throughput reads it
        assert set(phases) == {"between_tasks", "prepare", "render", "store"} and phases["render"] > 0
        assert redis_client.llen(BULK) == 0
    finally:
        api.stop()
