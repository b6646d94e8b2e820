"""JobStore against a real redis-server: creation, idempotency, listing, transitions, batches, concurrency."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

import pytest

from auk_worker.service.records.jobs import JobRecord, JobStatus, owner_id
from auk_worker.service.records.store import JobStore

ALICE = owner_id("alice-key")
BOB = owner_id("bob-key")


def at(seconds: float) -> str:
    stamp = datetime(2025, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=seconds)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new(owner: str = ALICE, t: float = 0.0, **kw) -> JobRecord:
    record = JobRecord.new(owner, {"instruction": "hi", "gen_seconds": 1.0}, queue="auk.base.interactive", **kw)
    record.created_at = at(t)
    return record


def test_owner_id_is_a_short_hash_not_the_key() -> None:
    assert len(ALICE) == 16 and ALICE != BOB and "alice" not in ALICE
    assert owner_id("alice-key") == ALICE


def test_create_get_round_trip(store: JobStore, redis_client) -> None:
    record, created = store.create(new(custom_id="c-1"))
    assert created
    got = store.get(record.id)
    assert got == record
    assert got.status == JobStatus.QUEUED and got.attempts == 0 and got.progress is None and got.result is None
    assert got.to_public()["status"] == "queued" and set(got.to_public()) == {
        "id", "status", "progress", "created_at", "started_at", "finished_at", "attempts", "request", "result",
        "error", "batch_id", "custom_id"}  # fmt: skip
    assert store.get("nope") is None
    assert redis_client.zscore(f"auk:owner:{ALICE}:jobs", record.id) is not None


def test_idempotency_key_returns_the_same_record(store: JobStore, redis_client) -> None:
    first, created = store.create(new(), idempotency_key="order-17")
    again, created_again = store.create(new(), idempotency_key="order-17")
    assert created and not created_again and again.id == first.id
    other_owner, created_other = store.create(new(BOB), idempotency_key="order-17")
    assert created_other and other_owner.id != first.id
    assert redis_client.zcard(f"auk:owner:{ALICE}:jobs") == 1
    assert redis_client.get(f"auk:idem:{ALICE}:order-17") == first.id


def test_concurrent_creates_with_one_key_make_one_job(store: JobStore, redis_client) -> None:
    ids: list[str] = []

    def create() -> None:
        ids.append(store.create(new(), idempotency_key="race")[0].id)

    threads = [threading.Thread(target=create) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(ids)) == 1 and redis_client.zcard(f"auk:owner:{ALICE}:jobs") == 1


def test_list_newest_first_paginated_filtered_and_owner_isolated(store: JobStore) -> None:
    mine = [store.create(new(t=i))[0] for i in range(7)]
    store.create(new(BOB, t=3.5))
    store.start(mine[2].id)
    store.finish(mine[2].id, {"key": "k"})
    store.start(mine[5].id)

    seen, cursor = [], None
    for _ in range(10):
        page, cursor = store.list(ALICE, limit=3, cursor=cursor)
        seen += page
        if cursor is None:
            break
    assert [r.id for r in seen] == [r.id for r in reversed(mine)]
    assert all(r.owner == ALICE for r in seen)

    assert [r.id for r in store.list(ALICE, status=JobStatus.SUCCEEDED)[0]] == [mine[2].id]
    assert [r.id for r in store.list(ALICE, status="running")[0]] == [mine[5].id]
    assert [r.owner for r in store.list(BOB)[0]] == [BOB]
    page, cursor = store.list(ALICE, status="queued", limit=2)
    assert [r.id for r in page] == [mine[6].id, mine[4].id] and cursor is not None
    page, cursor = store.list(ALICE, status="queued", limit=10, cursor=cursor)
    assert [r.id for r in page] == [mine[3].id, mine[1].id, mine[0].id] and cursor is None
    with pytest.raises(ValueError, match="cursor"):
        store.list(ALICE, cursor="garbage")


def test_list_cursor_is_stable_under_equal_timestamps_and_new_jobs(store: JobStore) -> None:
    same = [store.create(new(t=1.0))[0] for _ in range(5)]
    first, cursor = store.list(ALICE, limit=2)
    store.create(new(t=9.0))  # arrives between pages
    rest, end = store.list(ALICE, limit=10, cursor=cursor)
    assert end is None
    assert sorted(r.id for r in first + rest) == sorted(r.id for r in same)


def test_transitions_and_terminal_records_never_change(store: JobStore) -> None:
    record, _ = store.create(new())
    started = store.start(record.id, "w1:1")
    assert started.status == JobStatus.RUNNING and started.attempts == 1 and started.started_at
    assert store.set_progress(record.id, 3, 8) == JobStatus.RUNNING
    assert store.get(record.id).progress == {"step": 3, "total": 8}

    done = store.finish(record.id, {"key": "jobs/x.wav", "seed": 1})
    assert done.changed and done.record.status == JobStatus.SUCCEEDED and done.record.finished_at
    frozen = store.get(record.id)
    assert store.start(record.id, "w2:2") is None
    assert not store.fail(record.id, "x", "y").changed
    assert not store.finish(record.id, {"key": "other"}).changed
    assert store.cancel(record.id, ALICE) is None
    assert not store.requeue(record.id).changed
    assert store.set_progress(record.id, 5, 8) == JobStatus.SUCCEEDED
    assert store.get(record.id) == frozen


def test_fail_cancel_requeue_and_kills(store: JobStore) -> None:
    failing, _ = store.create(new())
    store.start(failing.id, "w1:1")
    failed = store.fail(failing.id, "invalid_audio", "not audio").record
    assert failed.status == JobStatus.FAILED and failed.error == {"code": "invalid_audio", "message": "not audio"}

    job, _ = store.create(new())
    assert store.cancel(job.id, BOB) is None  # another owner cannot cancel it
    store.start(job.id, "w1:1")
    assert store.cancel(job.id, ALICE).status == JobStatus.CANCELED
    assert store.is_canceled(job.id) and store.set_progress(job.id, 1, 4) == JobStatus.CANCELED
    assert not store.finish(job.id, {"key": "late"}).changed

    # A retry lets go of the record; starting it again is no kill. A new holder of a running record is one.
    crash, _ = store.create(new())
    store.start(crash.id, "w1:1")
    assert store.requeue(crash.id).record.status == JobStatus.QUEUED
    assert store.start(crash.id, "w2:2").kills == 0
    assert store.start(crash.id, "w2:2").kills == 0  # the same holder again: still alive
    again = store.start(crash.id, "w3:3")
    assert (again.attempts, again.kills) == (4, 1)


def test_start_is_atomic_under_concurrent_deliveries(store: JobStore) -> None:
    record, _ = store.create(new())
    barrier = threading.Barrier(8)

    def deliver(i: int) -> None:
        barrier.wait()
        store.start(record.id, f"w{i}:{i}")

    threads = [threading.Thread(target=deliver, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    final = store.get(record.id)
    assert final.attempts == 8 and final.kills == 7  # every later start saw a running record held by another


def test_batch_counters_and_the_last_job_is_told_the_batch_is_done(store: JobStore, redis_client) -> None:
    records = [new(t=i, custom_id=f"c{i}") for i in range(4)]
    batch_id = store.create_batch(ALICE, records)
    batch = store.get_batch(batch_id)
    assert batch["total"] == 4 and batch["owner"] == ALICE and not batch["done"]
    assert batch["counts"] == {"queued": 4, "running": 0, "succeeded": 0, "failed": 0, "canceled": 0}
    assert all(store.get(r.id).batch_id == batch_id for r in records)
    assert [r.custom_id for r in store.batch_records(batch_id)] == ["c0", "c1", "c2", "c3"]
    assert [r.custom_id for r in store.list(ALICE, batch_id=batch_id)[0]] == ["c3", "c2", "c1", "c0"]

    for r in records[:3]:
        store.start(r.id, "w:1")
    assert store.get_batch(batch_id)["counts"]["running"] == 3
    assert not store.finish(records[0].id, {"key": "a"}).batch_done
    assert not store.fail(records[1].id, "invalid_audio", "bad").batch_done
    assert store.cancel(records[3].id, ALICE) is not None  # counted like any end; the manifest is a worker's to write
    last = store.finish(records[2].id, {"key": "c"})
    assert last.batch_done
    batch = store.get_batch(batch_id)
    assert batch["done"] and batch["manifest_key"] is None
    assert batch["counts"] == {"queued": 0, "running": 0, "succeeded": 2, "failed": 1, "canceled": 1}
    assert not store.fail(records[2].id, "invalid_audio", "late").changed  # an ended job stays as it is
    store.set_batch_manifest(batch_id, "jobs/batch-x.manifest.jsonl")
    assert store.get_batch(batch_id)["manifest_key"] == "jobs/batch-x.manifest.jsonl"
    assert store.get_batch("missing") is None
