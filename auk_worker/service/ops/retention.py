"""Retention: finished jobs, uploads and results go away after their periods, and nothing else with them.

Periods (``Settings``; ``0`` keeps forever):

- ``AUK_RETAIN_RECORDS`` (30 days): a finished job's record and idempotency key, an ended batch's record and job
  list. Redis expires them itself: the transition to a terminal state sets their TTL (``JobStore.retain_s``).
- ``AUK_RETAIN_UPLOADS`` (7 days): an upload's record (a TTL set when it is written) and its object.
- ``AUK_RETAIN_RESULTS`` (30 days): result WAVs and batch manifests (``<prefix>jobs/``).

What Redis cannot expire on its own is swept here every ``AUK_RETAIN_SWEEP_INTERVAL``:

- listing entries whose record has expired are removed (``<ns>:owner:*:jobs``, the per-status
  ``<ns>:owner:*:status:*`` and ``<ns>:owner:*:batches``), so
  listings never page through dead ids (they also skip a missing record on read);
- a finished record, idempotency key or upload record that has no TTL (written before retention was configured,
  or by a process that died between its transition and its TTL) gets one;
- objects: a bucket lifecycle rule per prefix where the store takes one and the period is whole days; otherwise the
  sweeper lists ``<prefix>uploads/`` and ``<prefix>jobs/`` and deletes what is older than the period;
- orphaned results: the object of an attempt that lost its job and could not delete it (``attempts.py``: the
  notes of uploads whose end was never recorded, checked an hour after the upload).

The API runs the sweeper in a background thread (one API replica per interval holds a Redis lock); ``python -m
auk_worker.service.ops.retention [--once] [--all-objects]`` runs it alone.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import redis
from botocore.exceptions import BotoCoreError, ClientError

from auk_worker.service.records.attempts import ResultNotes
from auk_worker.service.records.jobs import JobStatus, TERMINAL
from auk_worker.service.records.store import JobStore
from auk_worker.service.connect.settings import Settings
from auk_worker.service.connect.storage import Storage, error_code

log = logging.getLogger(__name__)

DAY_S = 86400
SCAN_COUNT = 500  # keys per SCAN call and index entries per ZRANGE page
_TERMINAL_VALUES = frozenset(s.value for s in TERMINAL)


@dataclass
class SweepReport:
    """What one sweep did (also logged)."""

    index_entries_removed: int = 0
    ttls_set: int = 0
    objects_deleted: dict[str, int] = field(default_factory=dict)  # prefix -> count

    def __str__(self) -> str:
        objects = ", ".join(f"{n} under {p}" for p, n in self.objects_deleted.items()) or "none"
        return (f"{self.index_entries_removed} index entries removed, {self.ttls_set} TTLs set, "
                f"objects deleted: {objects}")  # fmt: skip


def object_prefixes(settings: Settings) -> dict[str, int]:
    """The object prefixes under retention and each one's period in seconds (0: kept)."""
    prefix = settings.s3_prefix
    return {f"{prefix}uploads/": settings.retain_uploads_s, f"{prefix}jobs/": settings.retain_results_s}


def lifecycle_rule_id(prefix: str) -> str:
    return f"auk-retain-{prefix or 'root'}"[:255]


def apply_lifecycle(storage: Storage, settings: Settings) -> set[str]:
    """Put one expiration rule per prefix whose period is whole days on the result bucket, keeping the bucket's
    other rules. Returns the prefixes the store now expires itself (empty when it refuses lifecycle rules)."""
    wanted = {p: s // DAY_S for p, s in object_prefixes(settings).items() if s and s % DAY_S == 0}
    if not wanted:
        return set()
    client, bucket = storage.client, storage.bucket
    try:
        try:
            rules = client.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", [])
        except ClientError as exc:
            if error_code(exc) != "NoSuchLifecycleConfiguration":
                raise
            rules = []
        ours = {lifecycle_rule_id(p) for p in wanted}
        rules = [r for r in rules if r.get("ID") not in ours]
        rules += [{"ID": lifecycle_rule_id(p), "Filter": {"Prefix": p}, "Status": "Enabled",
                   "Expiration": {"Days": days}} for p, days in wanted.items()]  # fmt: skip
        client.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": rules})
        stored = client.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", [])
    except (ClientError, BotoCoreError) as exc:
        log.info("retention: bucket %s takes no lifecycle rules (%s); the sweeper deletes old objects", bucket, exc)
        return set()
    applied = {r.get("Filter", {}).get("Prefix", r.get("Prefix")) for r in stored if r.get("ID") in ours}
    log.info("retention: bucket %s expires %s by lifecycle rule", bucket, ", ".join(sorted(applied)) or "nothing")
    return {p for p in wanted if p in applied}


class Sweeper:
    """One pass over the indexes and the objects; ``run_forever`` repeats it every sweep interval."""

    def __init__(self, settings: Settings, store: JobStore, storage: Storage | None,
                 lifecycle_prefixes: set[str] | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.store = store
        self.redis: redis.Redis = store.redis
        self.storage = storage
        self.lifecycle_prefixes = lifecycle_prefixes or set()  # the store expires these itself
        self.lock_key = f"{store.ns}:retention:lock"

    # -- Redis --------------------------------------------------------------------------------------------------
    def sweep_indexes(self, report: SweepReport) -> None:
        """Drop listing entries of expired records; give finished records and ended batches without a TTL one.

        Each index family names the record its members point to; other sorted sets are never touched."""
        if not self.settings.retain_records_s:
            return
        ns = self.store.ns
        self._sweep_family(f"{ns}:owner:*:jobs", self._check_jobs, report)
        self._sweep_family(f"{ns}:owner:*:status:*", self._check_jobs, report)  # the per-status job listings
        self._sweep_family(f"{ns}:owner:*:batches", self._check_batches, report)

    def _sweep_family(self, pattern: str, check: Any, report: SweepReport) -> None:
        """For each sorted set matching ``pattern``: its members created before the period began (scores are
        creation times in ms), in pages; ``check(ids, report)`` returns those whose record is gone."""
        cutoff_ms = (time.time() - self.settings.retain_records_s) * 1000  # younger records cannot have expired
        for index in self.redis.scan_iter(pattern, count=SCAN_COUNT, _type="zset"):
            offset = 0
            while True:
                ids = self.redis.zrangebyscore(index, "-inf", cutoff_ms, start=offset, num=SCAN_COUNT)
                if not ids:
                    break
                gone = check(ids, report)
                if gone:
                    report.index_entries_removed += self.redis.zrem(index, *gone)
                offset += len(ids) - len(gone)

    def _check_jobs(self, ids: list[str], report: SweepReport) -> list[str]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(self.store.job_key(job_id), "status", "finished_at")
            pipe.ttl(self.store.job_key(job_id))
        replies = pipe.execute()
        gone = []
        for job_id, (status, finished), ttl in zip(ids, replies[::2], replies[1::2]):
            if status is None:
                gone.append(job_id)
            elif status in _TERMINAL_VALUES and ttl == -1:
                self._retire_late(job_id, status, finished, report)
        return gone

    def _check_batches(self, ids: list[str], report: SweepReport) -> list[str]:
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hmget(self.store.batch_key(batch_id), "total", "terminal")
            pipe.ttl(self.store.batch_key(batch_id))
        replies = pipe.execute()
        gone = []
        for batch_id, (total, terminal), ttl in zip(ids, replies[::2], replies[1::2]):
            if total is None:
                gone.append(batch_id)
            elif ttl == -1 and int(terminal or 0) >= int(total):  # ended before retention was configured
                for key in (self.store.batch_key(batch_id), self.store.batch_jobs_key(batch_id)):
                    self.redis.expire(key, self.settings.retain_records_s)
                report.ttls_set += 1
        return gone

    def _retire_late(self, job_id: str, status: str, finished_at: str | None, report: SweepReport) -> None:
        """A finished record without a TTL: its clock starts from its own ``finished_at``."""
        retain = self.settings.retain_records_s
        left = retain
        if finished_at:
            finished = datetime.fromisoformat(finished_at.replace("Z", "+00:00"))
            remaining = finished + timedelta(seconds=retain) - datetime.now(timezone.utc)
            left = max(1, math.ceil(remaining.total_seconds()))
        self.store.retire(job_id, JobStatus(status), ttl=left, count=False)  # counted when it finished
        report.ttls_set += 1

    def sweep_uploads(self, report: SweepReport) -> None:
        """Upload records written without a TTL get one."""
        retain = self.settings.retain_uploads_s
        if not retain:
            return
        for key in self.redis.scan_iter(f"{self.store.ns}:upload:*", count=SCAN_COUNT, _type="hash"):
            if self.redis.ttl(key) == -1:
                self.redis.expire(key, retain)
                report.ttls_set += 1

    # -- objects ------------------------------------------------------------------------------------------------
    def sweep_objects(self, report: SweepReport) -> None:
        """Delete objects older than their prefix's period, for the prefixes no lifecycle rule covers."""
        if self.storage is None:
            return
        client, bucket = self.storage.client, self.storage.bucket
        now = datetime.now(timezone.utc)
        for prefix, retain in object_prefixes(self.settings).items():
            if not retain or prefix in self.lifecycle_prefixes:
                continue
            cutoff = now - timedelta(seconds=retain)
            deleted = 0
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                old = [{"Key": o["Key"]} for o in page.get("Contents", []) if o["LastModified"] < cutoff]
                for start in range(0, len(old), 1000):  # DeleteObjects takes at most 1000 keys
                    client.delete_objects(Bucket=bucket, Delete={"Objects": old[start:start + 1000], "Quiet": True})
                deleted += len(old)
            report.objects_deleted[prefix] = deleted

    # -- running ------------------------------------------------------------------------------------------------
    def sweep_orphaned_results(self, report: SweepReport) -> None:
        if self.storage is None:
            return
        deleted = ResultNotes(self.redis, self.store.ns).sweep(self.store, self.storage)
        if deleted:
            report.objects_deleted["orphaned results"] = deleted

    def sweep(self) -> SweepReport:
        report = SweepReport()
        self.sweep_indexes(report)
        self.sweep_uploads(report)
        self.sweep_objects(report)
        self.sweep_orphaned_results(report)
        log.info("retention: %s", report)
        return report

    def sweep_if_due(self) -> SweepReport | None:
        """Sweep unless another process swept within the interval (a Redis lock that lasts the interval)."""
        interval = self.settings.retain_sweep_interval_s
        if not self.redis.set(self.lock_key, str(time.time()), nx=True, ex=interval):
            return None
        return self.sweep()

    def run_forever(self, stop: threading.Event) -> None:
        """Sweep when due until ``stop`` is set; a failed sweep is logged and tried again next interval."""
        while not stop.is_set():
            try:
                self.sweep_if_due()
            except (redis.RedisError, ClientError, BotoCoreError) as exc:
                log.warning("retention: sweep failed: %s", exc)
            except Exception:  # noqa: BLE001 - the thread's boundary: log it and sweep again next interval
                log.exception("retention: sweep failed")
            stop.wait(min(self.settings.retain_sweep_interval_s, 60))


def start_background(settings: Settings, store: JobStore, storage: Storage) -> tuple[threading.Thread, threading.Event]:
    """The API's sweeper: lifecycle rules first (once), then ``run_forever`` on a daemon thread."""
    stop = threading.Event()

    def run() -> None:
        try:
            prefixes = apply_lifecycle(storage, settings)
        except Exception as exc:  # noqa: BLE001 - the thread's boundary: the sweeper deletes objects itself then
            log.warning("retention: lifecycle rules not applied: %s", exc)
            prefixes = set()
        Sweeper(settings, store, storage, prefixes).run_forever(stop)

    thread = threading.Thread(target=run, name="retention-sweeper", daemon=True)
    thread.start()
    return thread, stop


def main(argv: list[str] | None = None) -> int:
    """``python -m auk_worker.service.ops.retention``: apply lifecycle rules and sweep (``--once``, or forever)."""
    parser = argparse.ArgumentParser(prog="python -m auk_worker.service.ops.retention",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--once", action="store_true", help="one sweep, then exit")
    parser.add_argument("--all-objects", action="store_true",
                        help="list and delete old objects under every prefix, lifecycle rule or not (a store such "
                             "as SeaweedFS applies a new rule only to objects written after it)")  # fmt: skip
    args = parser.parse_args(argv)
    from auk_worker.service.connect.logs import configure_logging
    from auk_worker.service.connect.redis import redis_client

    settings = Settings.from_env()
    configure_logging(settings.log_format)
    store = JobStore(redis_client(settings), retain_s=settings.retain_records_s)
    storage = Storage(settings)
    expired_by_store = apply_lifecycle(storage, settings)
    sweeper = Sweeper(settings, store, storage, set() if args.all_objects else expired_by_store)
    if args.once:
        sweeper.sweep()
        return 0
    stop = threading.Event()
    try:
        sweeper.run_forever(stop)
    except KeyboardInterrupt:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
