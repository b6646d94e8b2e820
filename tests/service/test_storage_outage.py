"""Storage outages: the rendered audio is kept and only its upload is retried; a job waiting for its clip waits too.

Each test stops the session's SeaweedFS (the one real S3 server) and starts it again on the same data and ports.
The outage is scaled down from the production figures (a 10 minute outage against the 30 minute default of
``AUK_STORAGE_RETRY_DEADLINE``) to seconds, with the same ratio of outage to deadline, and it is longer than the
whole budget of the Celery retries (``AUK_RETRY_BACKOFF`` * (2^``AUK_RETRY_MAX`` - 1)) that used to decide it.
"""

from __future__ import annotations

import re
import time

import numpy as np

from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.records.store import JobStore
from auk_worker.service.records.objects import result_key, upload_key
from auk_worker.formats import encode
from tests.service.test_groups import BULK, create, send_group
from tests.service.test_worker import broker_idle, expected_samples, make_record, read_wav, send, wait_for, wavs

RETRY_BACKOFF_S, RETRY_MAX = 0.2, 6
OLD_RETRY_BUDGET_S = RETRY_BACKOFF_S * (2**RETRY_MAX - 1)  # 12.6 s: every Celery retry's wait, added up
OUTAGE_S = 20.0  # a third of the deadline, as 10 minutes is of the default 30
DEADLINE_S = 60.0


def outage_env(**overrides: str) -> dict[str, str]:
    env = {
        "AUK_INSTANT_STEP_DELAY": "0.05",
        "AUK_VISIBILITY_TIMEOUT": "300",  # above the longest wait, as in production
        "AUK_RETRY_BACKOFF": str(RETRY_BACKOFF_S),
        "AUK_RETRY_MAX": str(RETRY_MAX),
        "AUK_STORAGE_RETRY_DEADLINE": str(DEADLINE_S),
        "AUK_STORAGE_RETRY_BACKOFF": "0.2",
        "AUK_STORAGE_RETRY_BACKOFF_MAX": "2",
    }
    env.update(overrides)
    return env


def put_clip(storage, prefix: str, upload_id: str, seconds: float = 0.5) -> None:
    t = np.arange(int(24_000 * seconds), dtype=np.float32) / 24_000
    storage.put_bytes(upload_key(prefix, upload_id), encode(0.3 * np.sin(2 * np.pi * 220 * t), "wav", 24_000),
                      "audio/wav")  # fmt: skip


def submit_record(store: JobStore, body: dict) -> JobRecord:
    record, created = store.create(make_record(body))
    assert created
    return record


def fresh_busy(beat: dict[str, str]) -> bool:
    return beat.get("state") == "busy" and time.time() - float(beat.get("ts", 0)) < 5


def test_outage_longer_than_the_old_retry_budget_fails_no_job(
    start_worker, store, settings, storage, redis_client, s3_server
) -> None:
    """A group in flight, a job waiting for its clip and more jobs queued behind them live through an outage
    longer than the old retry budget: every job succeeds once storage is back, each rendered once, one WAV each."""
    assert OUTAGE_S > OLD_RETRY_BUDGET_S and OUTAGE_S * 3 <= DEADLINE_S
    prefix = settings.s3_prefix
    put_clip(storage, prefix, "clip-outage")
    workers = [start_worker(name, **outage_env()) for name in ("w-out-a", "w-out-b")]
    for worker in workers:
        worker.wait_state(redis_client, "ready", timeout=60)

    in_flight = [create(store, gen_seconds=0.3 + 0.1 * i, num_inference_steps=40) for i in range(3)]
    send_group(settings, in_flight)
    wait_for(store, in_flight[0].id, lambda r: (r.progress or {}).get("step", 0) >= 2, 20, "step 2")
    s3_server.stop()
    down_at = time.monotonic()
    try:
        clip_job = submit_record(store, {"instruction": "Say it like this.", "audio": {"upload_id": "clip-outage"},
                                         "gen_seconds": 0.4, "num_inference_steps": 10})  # fmt: skip
        send(settings, clip_job)
        wait_for(store, clip_job.id, lambda r: r.attempts >= 1, 20, "its start")
        queued = [submit_record(store, {"instruction": "Queued.", "gen_seconds": 0.2}) for _ in range(2)]
        for record in queued:
            send(settings, record)
        queued_group = [create(store, gen_seconds=0.2) for _ in range(2)]
        send_group(settings, queued_group)
        for record in in_flight:  # rendered to the last step, now waiting for storage
            wait_for(store, record.id, lambda r: (r.progress or {}).get("step") == 40, 20, "its last step")
        everything = [*in_flight, clip_job, *queued, *queued_group]
        held = sorted([clip_job.id, ",".join(r.id for r in in_flight)])
        ended_early, not_holding = set(), []  # what went wrong during the outage, asserted after it
        while time.monotonic() - down_at < OUTAGE_S:
            ended_early |= {r.id for r in store.get_many([r.id for r in everything]) if r.terminal}
            beats = [w.heartbeat(redis_client) for w in workers]
            if sorted(b.get("job_id", "") for b in beats) != held or not all(fresh_busy(b) for b in beats):
                not_holding.append(beats)
            time.sleep(1.0)
        group_waits = redis_client.llen(BULK) == 1  # the queued group still in the broker, never started
    finally:
        s3_server.start()
    outage = time.monotonic() - down_at

    ends = {r.id: wait_for(store, r.id, lambda r: r.terminal, 60, "a terminal state") for r in everything}
    assert [(i, e.status.value, e.attempts) for i, e in ends.items() if e.status != JobStatus.SUCCEEDED] == []
    assert [(i, e.attempts, e.kills) for i, e in ends.items() if (e.attempts, e.kills) != (1, 0)] == []
    assert not ended_early and group_waits
    assert not_holding == [], "both workers hold their jobs through the outage, heartbeating busy"
    assert sorted(wavs(storage, settings)) == sorted(result_key(prefix, r.id) for r in everything)
    for i, record in enumerate(in_flight):
        assert len(read_wav(storage, result_key(prefix, record.id))[0]) == expected_samples(0.3 + 0.1 * i)
    wait_for(store, clip_job.id, lambda r: broker_idle(redis_client), 20, "the broker to drain")
    logs = "".join(w.log_tail(200_000) for w in workers)
    assert "waiting for storage" in logs and "retry 1 of" not in logs  # no Celery retry: nothing rendered again
    print(f"outage {outage:.1f} s (old retry budget {OLD_RETRY_BUDGET_S:.1f} s, deadline {DEADLINE_S:.0f} s): "
          f"{len(everything)} jobs succeeded, each rendered once")  # fmt: skip


def test_storage_deadline_is_a_time_not_a_count_and_fails_with_a_storage_code(
    start_worker, store, settings, storage, redis_client, s3_server
) -> None:
    """With storage down for good, a rendered job fails once the deadline has passed, after many more tries than the
    old seven; then a job waiting for its clip does the same. Each names storage; nothing is rendered twice."""
    deadline = 4.0
    put_clip(storage, settings.s3_prefix, "clip-deadline")
    worker = start_worker("w-deadline", **outage_env(AUK_STORAGE_RETRY_DEADLINE=str(deadline),
                                                     AUK_STORAGE_RETRY_BACKOFF="0.05",
                                                     AUK_STORAGE_RETRY_BACKOFF_MAX="0.25"))  # fmt: skip
    worker.wait_state(redis_client, "ready", timeout=60)
    rendered = submit_record(store, {"instruction": "Upload me.", "gen_seconds": 0.3, "num_inference_steps": 4})
    clip_job = submit_record(store, {"instruction": "Fetch me.", "audio": {"upload_id": "clip-deadline"},
                                     "gen_seconds": 0.3})
    s3_server.stop()
    try:
        send(settings, rendered)
        send(settings, clip_job)
        wait_for(store, rendered.id, lambda r: (r.progress or {}).get("step") == 4, 20, "its last step")
        waiting_from = time.monotonic()
        failed = wait_for(store, rendered.id, lambda r: r.terminal, deadline + 20, "a terminal state")
        waited = time.monotonic() - waiting_from
        clip_failed = wait_for(store, clip_job.id, lambda r: r.terminal, deadline + 20, "a terminal state")
        clip_waited = time.monotonic() - waiting_from - waited
    finally:
        s3_server.start()
    for record in (failed, clip_failed):
        assert record.status == JobStatus.FAILED and record.attempts == 1
        assert record.error["code"] == "storage_unavailable", record.error
        assert "AUK_STORAGE_RETRY_DEADLINE" in record.error["message"]
    assert "upload" in failed.error["message"] and "clip" in clip_failed.error["message"]
    assert deadline <= waited < deadline + 5 and deadline - 0.5 <= clip_waited < deadline + 5, (waited, clip_waited)
    tries = int(re.search(r"\((\d+) tries", failed.error["message"]).group(1))
    assert tries > RETRY_MAX + 1, failed.error["message"]  # the old code stopped after seven
    assert wavs(storage, settings) == []
    wait_for(store, clip_job.id, lambda r: broker_idle(redis_client), 20, "the broker to drain")
    print(f"deadline {deadline} s: failed after {waited:.1f} s and {tries} tries; the clip job after {clip_waited:.1f} s")
