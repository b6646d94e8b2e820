"""The job records' state transitions, each one Lua script (``scripts.py``) run atomically in Redis:

    create -> queued -> start -> running -> finish | fail | cancel -> succeeded | failed | canceled
                                 running -> requeue | release_orphan -> queued

plus batch creation, retirement (counts and TTLs of a finished job) and the delivery marks the reaper reads.
Transitions given a holder apply only while that holder holds the running record (``jobs.py`` says why).
"""

from __future__ import annotations

import builtins
import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from auk_worker.service.records import scripts
from auk_worker.service.records.jobs import (
    TERMINAL,
    JobReader,
    JobRecord,
    JobStatus,
    created_ms,
    flat_to_dict,
    new_id,
    utc_now,
)


class IdempotencyKeyTaken(Exception):
    """The batch's Idempotency-Key already names a batch (another request wrote it first)."""


@dataclass(frozen=True)
class Transition:
    """What a finishing transition did: the record after it (None if it was already terminal or missing),
    and whether this call claimed its batch's manifest (it made the batch's last job terminal)."""

    record: JobRecord | None
    batch_done: bool = False

    @property
    def changed(self) -> bool:
        return self.record is not None


class JobTransitions(JobReader):
    """Every write that moves a job (or batch) record from one state to another."""

    def __init__(self, redis_client: redis.Redis, namespace: str = "auk", retain_s: int = 0) -> None:
        super().__init__(redis_client, namespace, retain_s)
        self._retire_script = redis_client.register_script(scripts.RETIRE)
        self._create_script = redis_client.register_script(scripts.CREATE)
        self._start_script = redis_client.register_script(scripts.START)
        self._transition_script = redis_client.register_script(scripts.TRANSITION)
        self._progress_script = redis_client.register_script(scripts.PROGRESS)
        self._release_script = redis_client.register_script(scripts.RELEASE_ORPHAN)
        self._deliver_script = redis_client.register_script(scripts.MARK_DELIVERED)
        self._undeliver_script = redis_client.register_script(scripts.FORGET_DELIVERY)

    def create(self, record: JobRecord, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        """Write a new queued record; a repeated (owner, idempotency key) returns the existing one instead."""
        idem = self.idem_key(record.owner, idempotency_key) if idempotency_key else ""
        pairs = [item for pair in record._to_hash().items() for item in pair]
        if idem:
            pairs += ["idem", idem]  # the key a finished record's TTL also applies to
        created, flat = self._create_script(
            keys=[self.job_key(record.id), self.owner_key(record.owner), idem,
                  self.status_key(record.owner, record.status), self.indexed_key(record.owner)],
            args=[record.id, created_ms(record), f"{self.ns}:job:", *pairs],
        )
        if created:
            self.redis.hincrby(self.stats_key(), "submitted", 1)
        return JobRecord._from_hash(flat_to_dict(flat)), bool(created)

    def start(self, job_id: str, worker: str = "", held_at: float | None = None) -> JobRecord | None:
        """queued/running -> running, attempts + 1. None when there is nothing to do: the record is terminal or
        missing, or a live holder holds it (a duplicate delivery; the caller acknowledges it and drops it).

        ``worker`` names this attempt's holder ("<worker id>/<instance id>"), ``held_at`` is now on its clock.
        Taking a record still ``running`` under a dead holder counts a kill; under a holder that let go of it
        (its attempt ended without a transition, say while Redis was away) or under ``worker`` itself, none.
        """
        stamp = f"{time.time() if held_at is None else held_at:.3f}"
        flat = self._start_script(keys=[self.job_key(job_id)], args=[self.ns, utc_now(), worker, stamp, job_id])
        if not flat or flat in (["terminal"], ["held"]):
            return None
        return JobRecord._from_hash(flat_to_dict(flat))

    def set_progress(self, job_id: str, step: int, total: int, holder: str = "") -> JobStatus | None:
        """Record step k of N while running (under ``holder``, when given); returns the current status, or None
        when the record is missing or another holder runs it, so that a caller stops at a cancel or a lost job."""
        status = self._progress_script(keys=[self.job_key(job_id)], args=[int(step), int(total), holder])
        return None if status in (None, "lost") else JobStatus(status)

    def _apply(
        self,
        job_id: str,
        new: JobStatus,
        allowed: tuple[JobStatus, ...],
        claim: bool,
        fields: dict[str, str],
        holder: str = "",
    ) -> Transition:
        pairs = [item for pair in fields.items() for item in pair]
        allowed_s = ",".join(s.value for s in allowed)
        reply = self._transition_script(
            keys=[self.job_key(job_id)],
            args=[self.ns, new.value, utc_now(), "1" if claim else "0", allowed_s, holder, *pairs],
        )
        if len(reply) < 2:
            return Transition(None)
        if new in TERMINAL:
            self.retire(job_id, new)
        return Transition(JobRecord._from_hash(flat_to_dict(reply[1])), bool(reply[0]))

    def finish(self, job_id: str, result: dict[str, Any], holder: str = "") -> Transition:
        """running -> succeeded with its result (only while ``holder``, when given, holds it)."""
        fields = {"result": json.dumps(result, separators=(",", ":")), "error": "", "worker": ""}
        return self._apply(job_id, JobStatus.SUCCEEDED, (JobStatus.RUNNING,), True, fields, holder)

    def fail(self, job_id: str, code: str, message: str, holder: str = "") -> Transition:
        """queued/running -> failed with ``{"code", "message"}`` (with a holder: only while it holds the job)."""
        fields = {"error": json.dumps({"code": code, "message": message}), "worker": ""}
        return self._apply(job_id, JobStatus.FAILED, (JobStatus.QUEUED, JobStatus.RUNNING), True, fields, holder)

    def requeue(self, job_id: str, holder: str = "") -> Transition:
        """running -> queued: the attempt let go of the job and a retry is on its way (not a kill)."""
        fields = {"worker": "", "progress": ""}
        return self._apply(job_id, JobStatus.QUEUED, (JobStatus.RUNNING,), False, fields, holder)

    def cancel(self, job_id: str, owner: str) -> JobRecord | None:
        """queued/running -> canceled for the job's owner; None for another owner, a missing or terminal job.

        A running job sees the change at its next step and stops. The task that later meets the canceled
        record writes the batch manifest if this was the batch's last job.
        """
        record = self.get(job_id)
        if record is None or record.owner != owner:
            return None
        fields = {"error": json.dumps({"code": "canceled", "message": "canceled by its owner"})}
        allowed = (JobStatus.QUEUED, JobStatus.RUNNING)
        return self._apply(job_id, JobStatus.CANCELED, allowed, False, fields).record

    def create_batch(self, owner: str, records: builtins.list[JobRecord],
                     idempotency: tuple[str, str] | None = None) -> str:  # fmt: skip
        """Write a batch and all its (queued) job records in one transaction; returns the batch id.

        ``idempotency``: ``(Idempotency-Key, fingerprint of the request)``, written with the batch (and expiring
        with it) so that a retry finds it (``batch_by_idempotency_key``). A key that names a batch already, also one
        that another request wrote a moment ago, raises ``IdempotencyKeyTaken`` and writes nothing."""
        batch_id = new_id()
        now = utc_now()
        first = self.redis.zcard(self.owner_key(owner)) == 0
        idem = self.batch_idem_key(owner, idempotency[0]) if idempotency else ""
        with self.redis.pipeline(transaction=True) as pipe:
            if idem:
                pipe.watch(idem)  # written by another request before EXEC: nothing of this one is
                earlier = pipe.get(idem)
                if earlier and pipe.exists(self.batch_key(earlier.partition(" ")[0])):  # else a key outlived its batch
                    raise IdempotencyKeyTaken(idempotency[0])
                pipe.multi()
            if first:  # an owner's first jobs: nothing older to index
                pipe.set(self.indexed_key(owner), "1")
            for position, record in enumerate(records):
                if record.owner != owner:
                    raise ValueError(f"job {record.id} belongs to another owner")
                record.batch_id = batch_id
                pipe.hset(self.job_key(record.id), mapping=record._to_hash())
                pipe.zadd(self.owner_key(owner), {record.id: created_ms(record)})
                pipe.zadd(self.status_key(owner, record.status), {record.id: created_ms(record)})
                pipe.zadd(self.batch_jobs_key(batch_id), {record.id: position})  # submission order
            counts = {f"n_{s.value}": 0 for s in JobStatus}
            counts["n_queued"] = len(records)
            pipe.hset(self.batch_key(batch_id), mapping={"id": batch_id, "owner": owner, "total": len(records),
                                                         "terminal": 0, "created_at": now, "idem": idem, **counts})
            if idem:
                pipe.set(idem, f"{batch_id} {idempotency[1]}")
            pipe.hincrby(self.stats_key(), "submitted", len(records))
            try:
                pipe.execute()
            except redis.WatchError:
                raise IdempotencyKeyTaken(idempotency[0]) from None
        return batch_id

    def retire(self, job_id: str, status: JobStatus, ttl: int | None = None, count: bool = True) -> None:
        """A job just became terminal: count it by status (unless ``count`` is false) and set the TTLs of its
        record, its idempotency key and its ended batch to ``ttl`` (default ``retain_s``; 0 keeps them)."""
        ttl = self.retain_s if ttl is None else ttl
        self._retire_script(keys=[self.job_key(job_id), self.stats_key() if count else ""],
                            args=[self.ns, status.value, ttl])

    def set_batch_manifest(self, batch_id: str, key: str) -> None:
        self.redis.hset(self.batch_key(batch_id), mapping={"manifest_key": key, "finished_at": utc_now()})

    # -- the reaper's (worker/recovery.py) --------------------------------------------------------------------
    def release_orphan(self, job_id: str, holder: str) -> int | None:
        """running -> queued for a job ``holder`` had and no longer holds (kills + 1 when it is dead); the job's
        kills after it, or None when nothing changed (another attempt took it, or the holder still holds it)."""
        reply = self._release_script(keys=[self.job_key(job_id)], args=[self.ns, holder, job_id])
        return int(reply[0]) if reply else None

    def mark_delivered(self, job_ids: builtins.list[str], holder: str) -> None:
        """Note on each still queued record that ``holder`` received its message (before it starts the job)."""
        if job_ids:
            self._deliver_script(keys=[self.job_key(job_id) for job_id in job_ids], args=[self.ns, holder])

    def forget_delivery(self, job_id: str, holder: str) -> bool:
        """Drop a queued record's delivery to ``holder`` (dead before it started the job); True if it was there."""
        return bool(self._undeliver_script(keys=[self.job_key(job_id)], args=[self.ns, holder]))
