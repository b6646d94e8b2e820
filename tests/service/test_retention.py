"""Retention with short periods against the session's redis-server and SeaweedFS: finished records, their keys and
index entries, uploads and objects go away after their periods, and what is still live or outside the swept
prefixes stays."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import redis

from auk_worker.service.records.batches import BatchBook
from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.records.store import JobStore
from auk_worker.service.ops.retention import Sweeper, apply_lifecycle, lifecycle_rule_id
from auk_worker.service.connect.settings import Settings
from auk_worker.service.connect.storage import Storage
from auk_worker.service.records.uploads import Upload, UploadStore

OWNER, OTHER = "owner-aaaaaaaaaa", "owner-bbbbbbbbbb"


def _job(store: JobStore, owner: str = OWNER, idem: str | None = None) -> JobRecord:
    record, created = store.create(JobRecord.new(owner, {"instruction": "hello", "gen_seconds": 1.0}), idem)
    assert created
    return record


def _finish(store: JobStore, record: JobRecord) -> None:
    assert store.start(record.id, "w:1") is not None
    assert store.finish(record.id, {"key": f"jobs/{record.id}.wav"}).changed


def test_finished_records_expire_and_the_sweeper_trims_indexes(redis_client: redis.Redis, settings: Settings) -> None:
    store = JobStore(redis_client, retain_s=2)
    done = _job(store, idem="idem-done")
    _finish(store, done)
    failed = _job(store)
    assert store.fail(failed.id, "bad_audio", "the clip is silent").changed
    canceled = _job(store, owner=OTHER)
    assert store.cancel(canceled.id, OTHER) is not None
    queued = _job(store, idem="idem-queued")
    running = _job(store)
    assert store.start(running.id, "w:1") is not None
    batch_jobs = [JobRecord.new(OWNER, {"instruction": f"line {i}"}, custom_id=f"c{i}") for i in range(2)]
    batch_id = store.create_batch(OWNER, batch_jobs, ("night-1", "fingerprint-1"))
    for record in batch_jobs:
        _finish(store, record)
    book = BatchBook(store)
    book.register(batch_id, OWNER)
    live_job = JobRecord.new(OWNER, {"instruction": "still to come"}, custom_id="c0")
    live_batch = store.create_batch(OWNER, [live_job], ("night-2", "fingerprint-2"))
    book.register(live_batch, OWNER)
    # A record finished by a store without retention (before it was configured): the sweeper gives it a TTL.
    legacy = _job(JobStore(redis_client))
    _finish(JobStore(redis_client), legacy)

    ttl = redis_client.ttl
    assert 0 < ttl(store.job_key(done.id)) <= 2 and 0 < ttl(store.idem_key(OWNER, "idem-done")) <= 2
    assert 0 < ttl(store.job_key(failed.id)) <= 2 and 0 < ttl(store.job_key(canceled.id)) <= 2
    assert 0 < ttl(store.batch_key(batch_id)) <= 2 and 0 < ttl(store.batch_jobs_key(batch_id)) <= 2
    assert 0 < ttl(store.batch_idem_key(OWNER, "night-1")) <= 2  # a batch's key lasts as long as the batch
    for key in (store.job_key(queued.id), store.idem_key(OWNER, "idem-queued"), store.job_key(running.id),
                store.job_key(legacy.id), store.owner_key(OWNER), store.batch_idem_key(OWNER, "night-2")):  # fmt: skip
        assert ttl(key) == -1, key
    stats = redis_client.hgetall(store.stats_key())
    assert stats == {"submitted": "9", "succeeded": "4", "failed": "1", "canceled": "1"}

    time.sleep(2.5)
    for key in (store.job_key(done.id), store.idem_key(OWNER, "idem-done"), store.job_key(failed.id),
                store.job_key(canceled.id), store.batch_key(batch_id), store.batch_jobs_key(batch_id),
                *(store.job_key(r.id) for r in batch_jobs)):  # fmt: skip
        assert not redis_client.exists(key), key
    assert store.get(queued.id).status == JobStatus.QUEUED and store.get(running.id).status == JobStatus.RUNNING
    assert store.by_idempotency_key(OWNER, "idem-queued").id == queued.id
    assert store.get_batch(batch_id) is None and store.get_batch(live_batch) is not None
    assert store.batch_by_idempotency_key(OWNER, "night-1") is None
    assert store.batch_by_idempotency_key(OWNER, "night-2") == (live_batch, "fingerprint-2")
    # Listings skip expired ids before any sweep; the index still holds them until the sweeper runs.
    listed, _ = store.list(OWNER)
    assert {r.id for r in listed} == {queued.id, running.id, legacy.id, live_job.id}
    assert redis_client.zcard(store.owner_key(OWNER)) == 8
    assert redis_client.zcard(book.owner_key(OWNER)) == 2

    swept = dataclasses.replace(settings, retain_records_s=2)
    report = Sweeper(swept, store, storage=None).sweep()
    # Jobs: 4 of OWNER's and 1 of OTHER's, in the listing and again in their status's listing; and a batch.
    assert report.index_entries_removed == 11 and report.ttls_set == 1
    for status in JobStatus:
        for owner in (OWNER, OTHER):
            left = set(redis_client.zrange(store.status_key(owner, status), 0, -1))
            assert left <= {queued.id, running.id, legacy.id, live_job.id}, (owner, status, left)
    assert set(redis_client.zrange(store.owner_key(OWNER), 0, -1)) == {queued.id, running.id, legacy.id, live_job.id}
    assert redis_client.zrange(book.owner_key(OWNER), 0, -1) == [live_batch]  # the batch still running stays
    assert redis_client.zcard(store.owner_key(OTHER)) == 0
    assert 0 < ttl(store.job_key(legacy.id)) <= 1  # finished 2.5 s ago: its period is already over
    time.sleep(1.2)
    assert store.get(legacy.id) is None and store.get(queued.id) is not None
    assert Sweeper(swept, store, storage=None).sweep().index_entries_removed == 2  # legacy's, in both listings
    assert redis_client.hgetall(store.stats_key())["succeeded"] == "4"  # a late TTL does not count a job twice


def test_upload_records_expire(redis_client: redis.Redis) -> None:
    uploads = UploadStore(redis_client, retain_s=1)
    upload = Upload("u1", OWNER, "p/uploads/u1", 1.0, 16000, 16000, 1)
    uploads.add(upload)
    assert uploads.get("u1", OWNER) == upload and 0 < redis_client.ttl(uploads.key("u1")) <= 1
    time.sleep(1.3)
    assert uploads.get("u1", OWNER) is None


def test_sweeper_deletes_old_objects_under_the_retained_prefixes_only(settings: Settings, storage: Storage,
                                                                       redis_client: redis.Redis) -> None:  # fmt: skip
    prefix = settings.s3_prefix
    old = [f"{prefix}uploads/old-clip", f"{prefix}jobs/old.wav", f"{prefix}jobs/batch-b1.manifest.jsonl"]
    kept_elsewhere = [f"{prefix}other/keep.bin", f"x{prefix}jobs/another-deployment.wav", f"{prefix}uploadsX/k"]
    for key in old + kept_elsewhere:
        storage.put_bytes(key, b"data", "application/octet-stream")
    time.sleep(2.2)
    fresh = [f"{prefix}uploads/new-clip", f"{prefix}jobs/new.wav"]
    for key in fresh:
        storage.put_bytes(key, b"data", "application/octet-stream")

    swept = dataclasses.replace(settings, retain_uploads_s=2, retain_results_s=2)
    report = Sweeper(swept, JobStore(redis_client), storage).sweep()
    assert report.objects_deleted == {f"{prefix}uploads/": 1, f"{prefix}jobs/": 2}
    for key in old:
        assert not storage.exists(key), key
    for key in fresh + kept_elsewhere:
        assert storage.exists(key), key
    # A period of 0 keeps everything under its prefix.
    keep = dataclasses.replace(settings, retain_uploads_s=0, retain_results_s=0)
    assert Sweeper(keep, JobStore(redis_client), storage).sweep().objects_deleted == {}


def test_lifecycle_rules_on_seaweedfs_keep_the_buckets_other_rules(settings: Settings, storage: Storage,
                                                                   redis_client: redis.Redis) -> None:  # fmt: skip
    """SeaweedFS takes bucket lifecycle rules: whole-day periods become rules (the sweeper then skips those
    prefixes); a rule someone else put on the bucket stays; a sub-day period stays with the sweeper."""
    client, bucket = storage.client, storage.bucket
    foreign = {"ID": "someone-else", "Filter": {"Prefix": "logs/"}, "Status": "Enabled", "Expiration": {"Days": 3}}
    try:  # the session's bucket may hold the rules of other tests' APIs: they stay too
        present = client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    except client.exceptions.ClientError:
        present = []
    rules = [r for r in present if r["ID"] != foreign["ID"]] + [foreign]
    client.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": rules})
    try:
        days = dataclasses.replace(settings, retain_uploads_s=7 * 86400, retain_results_s=3600)
        applied = apply_lifecycle(storage, days)
        prefix = settings.s3_prefix
        uploads = f"{prefix}uploads/"
        assert applied == {uploads}
        rules = {r["ID"]: r for r in client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}
        assert rules[lifecycle_rule_id(uploads)]["Expiration"] == {"Days": 7}
        assert rules[lifecycle_rule_id(uploads)]["Filter"] == {"Prefix": uploads}
        assert rules["someone-else"]["Expiration"] == {"Days": 3} and lifecycle_rule_id(f"{prefix}jobs/") not in rules
        count = len(rules)
        assert apply_lifecycle(storage, days) == {uploads}  # applying again replaces our rule, adds none
        assert len(client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]) == count

        old = f"{settings.s3_prefix}jobs/old.wav"
        storage.put_bytes(old, b"data", "audio/wav")
        report = Sweeper(days, JobStore(redis_client), storage, applied).sweep()  # results: an hour, swept
        assert report.objects_deleted == {f"{settings.s3_prefix}jobs/": 0} and storage.exists(old)
    finally:
        client.delete_bucket_lifecycle(Bucket=bucket)


def test_retention_periods_parse_with_units_and_zero_keeps_forever() -> None:
    from auk_worker.errors import ConfigError

    defaults = Settings.from_env({})
    assert (defaults.retain_records_s, defaults.retain_uploads_s, defaults.retain_results_s) == (
        30 * 86400, 7 * 86400, 30 * 86400)
    parsed = Settings.from_env({"AUK_RETAIN_RECORDS": "36h", "AUK_RETAIN_UPLOADS": "0", "AUK_RETAIN_RESULTS": "90",
                                "AUK_RETAIN_SWEEP_INTERVAL": "15m"})  # fmt: skip
    assert (parsed.retain_records_s, parsed.retain_uploads_s, parsed.retain_results_s) == (36 * 3600, 0, 90)
    assert parsed.retain_sweep_interval_s == 900
    for bad in ("-1d", "1.5d", "a week", "7w"):
        with pytest.raises(ConfigError, match="AUK_RETAIN_RECORDS"):
            Settings.from_env({"AUK_RETAIN_RECORDS": bad})


def test_ended_webhook_deliveries_expire_and_pending_ones_stay(redis_client: redis.Redis) -> None:
    from auk_worker.service.delivery.webhooks.store import WebhookStore

    deliveries = WebhookStore(redis_client, retain_s=1)
    sent = deliveries.enqueue(OWNER, "https://example.test/hook", "job.succeeded", {"id": "j1"})
    retried = deliveries.enqueue(OWNER, "https://example.test/hook", "job.failed", {"id": "j2"})
    outcomes = {sent: "delivered", retried: "retry"}
    for _ in range(2):
        delivery, token = deliveries.claim(lease_s=30)
        assert deliveries.finish(delivery, token, outcomes[delivery.id], delay_s=60, status=200)
    assert 0 < redis_client.ttl(deliveries.key(sent)) <= 1 and redis_client.ttl(deliveries.key(retried)) == -1
    time.sleep(1.3)
    assert deliveries.get(sent) is None and deliveries.get(retried).state == "pending"


def test_the_sweeper_runs_alone_from_the_command_line(service_env: dict[str, str], settings: Settings,
                                                      storage: Storage) -> None:  # fmt: skip
    import os
    import subprocess
    import sys

    from tests.service.harness import REPO

    old = f"{settings.s3_prefix}jobs/old.wav"
    storage.put_bytes(old, b"data", "audio/wav")
    time.sleep(2.2)
    env = {**os.environ, **service_env, "AUK_RETAIN_RESULTS": "2s", "AUK_LOG_FORMAT": "json", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "auk_worker.service.ops.retention", "--once"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not storage.exists(old)
    report = [json.loads(line) for line in out.stderr.splitlines() if "objects deleted" in line]
    assert len(report) == 1 and f"1 under {settings.s3_prefix}jobs/" in report[0]["message"]
