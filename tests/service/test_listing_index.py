"""Status-filtered listings read a per-key, per-status index, kept by the same scripts as every transition.

Store level (real Redis): after any mix of transitions each job sits in exactly its status's index, and a key's
older records, written before the indexes existed, are indexed on the first filtered listing. HTTP level (the real
API): ``GET /v1/jobs?status=failed&limit=1`` under 20,000 queued jobs and a few old failed ones reads a handful of
records, counted by Redis itself, where a scan would read all 20,000.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from auk_worker.service.records.jobs import JobRecord, JobStatus, owner_id
from auk_worker.service.records.store import JobStore
from tests.service.harness import ApiProcess, free_port

KEY_A, KEY_B = "key-listing-alpha-0123456789", "key-listing-bravo-0123456789"


def _new(owner: str) -> JobRecord:
    return JobRecord.new(owner, {"instruction": "x", "gen_seconds": 1.0}, queue="auk.base.interactive")


def _indexed(store: JobStore, owner: str) -> dict[str, set[str]]:
    return {status.value: set(store.redis.zrange(store.status_key(owner, status), 0, -1)) for status in JobStatus}


def test_every_transition_moves_the_job_between_status_indexes(store: JobStore) -> None:
    owner = "owner-index-0001"
    records = [store.create(_new(owner))[0] for _ in range(6)]
    batch = [_new(owner) for _ in range(3)]
    store.create_batch(owner, batch)
    a, b, c, d, e, f = (record.id for record in records)
    store.start(a, "w:1")
    store.finish(a, {"key": "x"})
    store.start(b, "w:1")
    store.fail(b, "bad", "bad")
    store.cancel(c, owner)
    store.start(d, "w:1")
    store.start(e, "w:1")
    store.requeue(e)
    store.start(batch[0].id, "w:2")
    store.finish(batch[0].id, {"key": "y"})
    store.finish(a, {"key": "again"})  # a terminal record never moves again
    expected = {"succeeded": {a, batch[0].id}, "failed": {b}, "canceled": {c}, "running": {d},
                "queued": {e, f, batch[1].id, batch[2].id}}  # fmt: skip
    assert _indexed(store, owner) == expected
    for status, ids in expected.items():
        listed, _ = store.list(owner, status=status, limit=100)
        assert {record.id for record in listed} == ids and all(r.status.value == status for r in listed)
    assert store.count(owner, (JobStatus.QUEUED, JobStatus.RUNNING)) == 5


def test_records_written_before_the_indexes_are_indexed_once(store: JobStore, redis_client: redis.Redis) -> None:
    owner = "owner-index-0002"
    ids = [store.create(_new(owner))[0].id for _ in range(5)]
    store.start(ids[0], "w:1")
    store.fail(ids[0], "bad", "bad")
    # As an older version left them: no status indexes, no marker.
    for status in JobStatus:
        redis_client.delete(store.status_key(owner, status))
    redis_client.delete(store.indexed_key(owner))
    failed, _ = store.list(owner, status="failed", limit=10)
    assert [record.id for record in failed] == [ids[0]]
    assert redis_client.get(store.indexed_key(owner)) == "1"
    assert _indexed(store, owner)["queued"] == set(ids[1:])


@pytest.fixture
def api(service_env: dict[str, str], tmp_path: Path) -> Iterator[ApiProcess]:
    env = {**service_env, "AUK_API_KEYS": f"{KEY_A},{KEY_B}", "AUK_QUOTA_QUEUED_JOBS": "0"}
    proc = ApiProcess(env, free_port(), tmp_path / "api.log").start()
    yield proc
    proc.stop()


def _record_reads(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return stats.get("cmdstat_hgetall", {}).get("calls", 0)


def test_a_filtered_listing_reads_only_its_status(api: ApiProcess, store: JobStore, redis_client: redis.Redis) -> None:
    owner = owner_id(KEY_A)
    oldest = []
    for _ in range(3):
        oldest.append(store.create(_new(owner))[0].id)
        time.sleep(0.002)  # distinct creation milliseconds: newest first is then a strict order
    for job_id in oldest:
        store.start(job_id, "w:1")
        store.fail(job_id, "bad", "an old failure")
    for start in range(0, 20_000, 1000):
        store.create_batch(owner, [_new(owner) for _ in range(1000)])
    store.create(_new(owner_id(KEY_B)))
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http:
        http.get("/v1/jobs", params={"status": "failed", "limit": 1}).raise_for_status()  # warm
        redis_client.config_resetstat()
        first = http.get("/v1/jobs", params={"status": "failed", "limit": 1}).json()
        assert [job["id"] for job in first["data"]] == [oldest[-1]] and first["next_cursor"]
        # A scan would read the 20,003 records; background readers (heartbeats, webhooks) add a few at most.
        assert _record_reads(redis_client) <= 10, "the listing read records of other statuses"
        rest = http.get("/v1/jobs", params={"status": "failed", "limit": 5, "cursor": first["next_cursor"]}).json()
        assert [job["id"] for job in rest["data"]] == oldest[-2::-1] and rest["next_cursor"] is None
        queued = http.get("/v1/jobs", params={"status": "queued", "limit": 500}).json()
        assert len(queued["data"]) == 500 and {job["status"] for job in queued["data"]} == {"queued"}
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60) as http:
        assert http.get("/v1/jobs", params={"status": "failed"}).json()["data"] == []
        assert len(http.get("/v1/jobs", params={"status": "queued"}).json()["data"]) == 1
