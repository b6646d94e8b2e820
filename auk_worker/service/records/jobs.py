"""The job lifecycle and its Redis record store.

A job record is written before its task is sent, so every id a caller sees exists. It moves
``queued -> running -> succeeded | failed | canceled``; each transition is one Lua script, so it is atomic
against the API (cancel) and other workers (a redelivered task), and a terminal record never changes again.

This module holds the record, its key map and the store's read side; the transitions are in ``transitions.py``,
the listings in ``listing.py``, every Lua script in ``scripts.py``, and ``store.py`` puts the three together as
``JobStore``.

A running record names its holder, ``"<worker id>/<instance id>"`` (``worker``), and when it took the job
(``held_at``, the holder's own clock). The holder is alive while its heartbeat (``records/workers.py``) carries the same
instance id and a state other than ``failed``; it still holds the job while that heartbeat lists the job id, or was
written before ``held_at``. Transitions given a holder apply only while that holder holds the running record
(fencing: a worker that lost its job cannot finish it); ``start`` refuses a job a live holder holds (a duplicate
delivery) and counts a kill when it takes one from a dead holder. The worker's reaper (``worker/recovery.py``)
finds and re-sends the rest through ``orphans`` and ``release_orphan`` (``transitions.py``).

Keys (namespace ``auk``):

- ``auk:job:{id}``            hash: the record (JSON for request/result/error/progress)
- ``auk:owner:{owner}:jobs``  zset: job ids scored by creation time (ms), for newest-first listing
- ``auk:owner:{owner}:status:{status}``  zset: the same, one per status, so a status-filtered listing reads only
  its own jobs; moved by the same script as every transition (``move_status``), so it never disagrees with the
  records. ``auk:owner:{owner}:status-indexed`` marks an owner whose older records have been indexed too.
- ``auk:idem:{owner}:{key}``  string: the job id an idempotency key made
- ``auk:batch:{id}``          hash: owner, total, created_at, a count per status, the terminal count, manifest key
- ``auk:batch:{id}:jobs``     zset: the batch's job ids scored like the owner index
- ``auk:running``             set: the keys of running records (what the reaper looks through)
- ``auk:delivered``           set: the keys of queued records a worker has received but not started (``delivered``
  on the record names that worker's holder), so that a worker that dies between the two is noticed too
- ``auk:stats:jobs``          hash: jobs submitted, and finished by status, since the start (``/metrics``)
- ``auk:worker:{worker id}``  hash: a worker's heartbeat (see ``records/workers.py``); ``auk:workers`` set of worker ids

The holder checks read heartbeat keys a script is not handed in ``KEYS``: fine on one Redis (or a Sentinel-managed
master), not on Redis Cluster.

Retention (``ops/retention.py``): a transition to a terminal state sets the record's and its idempotency key's TTL
(``retain_s``), and the batch's once its last job ends; the sweeper trims index entries whose record has gone.

Batch counters move inside the same script as the job, so ``get_batch`` is O(1). The worker that records a
batch's last terminal job is told so (``Transition.batch_done``) and writes the manifest; a later delivery of any of
the batch's jobs writes it if it is still missing (the canceled jobs' case, or that worker's death).
"""

from __future__ import annotations

import builtins
import hashlib
import json
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any

import redis

from auk_worker.service.records import scripts


class JobStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELED})

_JSON_FIELDS = ("progress", "request", "result", "error")
_INT_FIELDS = ("attempts", "kills")


def utc_now() -> str:
    """ISO-8601 UTC with milliseconds, e.g. ``2025-01-31T22:04:05.123Z``."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_id() -> str:
    return uuid.uuid4().hex


def owner_id(api_key: str) -> str:
    """The owner id stored on records: the first 16 hex digits of sha256(api key); raw keys are never stored."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


@dataclass
class JobRecord:
    id: str
    owner: str
    status: JobStatus = JobStatus.QUEUED
    created_at: str = field(default_factory=utc_now)
    started_at: str | None = None
    finished_at: str | None = None
    attempts: int = 0  # times a worker started it
    kills: int = 0  # times a worker died holding it
    progress: dict[str, int] | None = None  # {"step": k, "total": n}
    request: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    error: dict[str, str] | None = None  # {"code", "message"}
    batch_id: str | None = None
    custom_id: str | None = None
    queue: str | None = None
    worker: str | None = None  # the holder, "<worker id>/<instance id>", while running (internal)
    held_at: str | None = None  # when the holder took it: seconds since the epoch on the holder's clock (internal)

    @classmethod
    def new(
        cls,
        owner: str,
        request: dict[str, Any],
        *,
        queue: str | None = None,
        custom_id: str | None = None,
        batch_id: str | None = None,
    ) -> JobRecord:
        return cls(id=new_id(), owner=owner, request=request, queue=queue, custom_id=custom_id, batch_id=batch_id)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def to_public(self) -> dict[str, Any]:
        """The API's JSON shape of a job."""
        return {
            "id": self.id,
            "status": self.status.value,
            "progress": self.progress,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "attempts": self.attempts,
            "request": self.request,
            "result": self.result,
            "error": self.error,
            "batch_id": self.batch_id,
            "custom_id": self.custom_id,
        }

    def _to_hash(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, value in asdict(self).items():
            if name in _JSON_FIELDS:
                out[name] = "" if value is None else json.dumps(value, separators=(",", ":"))
            elif isinstance(value, JobStatus):
                out[name] = value.value
            else:
                out[name] = "" if value is None else str(value)
        return out

    @classmethod
    def _from_hash(cls, raw: dict[str, str]) -> JobRecord:
        kwargs: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            value = raw.get(name, "")
            if name in _JSON_FIELDS:
                kwargs[name] = json.loads(value) if value else ({} if name == "request" else None)
            elif name in _INT_FIELDS:
                kwargs[name] = int(value or 0)
            elif name == "status":
                kwargs[name] = JobStatus(value)
            else:
                kwargs[name] = value or None
        return cls(**kwargs)


def flat_to_dict(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2]))


def created_ms(record: JobRecord) -> int:
    stamp = datetime.fromisoformat(record.created_at.replace("Z", "+00:00"))
    return int(stamp.timestamp() * 1000)


def batch_from_hash(raw: dict[str, str]) -> dict[str, Any]:
    """A batch's record from its Redis hash: counts per status, whether every job ended, its result files."""
    total, terminal = int(raw["total"]), int(raw.get("terminal", 0))
    return {
        "id": raw["id"],
        "owner": raw["owner"],
        "total": total,
        "counts": {s.value: int(raw.get(f"n_{s.value}", 0)) for s in JobStatus},
        "created_at": raw["created_at"],
        "finished_at": raw.get("finished_at") or None,
        "done": terminal >= total,
        "manifest_key": raw.get("manifest_key") or None,
        "error_key": raw.get("error_key") or None,
        "error_count": int(raw.get("error_count") or 0),
        "canceled_at": raw.get("canceled_at") or None,
        "webhook_url": raw.get("webhook_url") or None,
    }


@dataclass(frozen=True)
class Orphan:
    """A running job no live attempt holds: its holder died (``dead``) or let go of it; or (``started`` False) a
    queued job whose message a worker received and that worker died before starting it."""

    job_id: str
    queue: str | None
    holder: str
    dead: bool
    started: bool = True


class JobReader:
    """The job and batch records' key map and read side. The client must use ``decode_responses=True``.

    ``retain_s``: how long a finished job's record and idempotency key (and an ended batch) stay; 0 keeps them.
    """

    def __init__(self, redis_client: redis.Redis, namespace: str = "auk", retain_s: int = 0) -> None:
        self.redis = redis_client
        self.ns = namespace
        self.retain_s = retain_s
        self._orphans_script = redis_client.register_script(scripts.ORPHANS)

    # -- keys ---------------------------------------------------------------------------------------------------
    def job_key(self, job_id: str) -> str:
        return f"{self.ns}:job:{job_id}"

    def owner_key(self, owner: str) -> str:
        return f"{self.ns}:owner:{owner}:jobs"

    def status_key(self, owner: str, status: JobStatus | str) -> str:
        return f"{self.ns}:owner:{owner}:status:{JobStatus(status).value}"

    def indexed_key(self, owner: str) -> str:
        return f"{self.ns}:owner:{owner}:status-indexed"

    def idem_key(self, owner: str, key: str) -> str:
        return f"{self.ns}:idem:{owner}:{key}"

    def batch_idem_key(self, owner: str, key: str) -> str:
        return f"{self.ns}:idem-batch:{owner}:{key}"

    def batch_key(self, batch_id: str) -> str:
        return f"{self.ns}:batch:{batch_id}"

    def batch_jobs_key(self, batch_id: str) -> str:
        return f"{self.ns}:batch:{batch_id}:jobs"

    def stats_key(self) -> str:
        return f"{self.ns}:stats:jobs"

    # -- reads ----------------------------------------------------------------------------------------------------
    def ping(self) -> bool:
        """Redis answers (the API's readiness check); a connection error propagates."""
        return bool(self.redis.ping())

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.hgetall(self.job_key(job_id))
        return JobRecord._from_hash(raw) if raw else None

    def get_many(self, job_ids: builtins.list[str]) -> builtins.list[JobRecord | None]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.job_key(job_id))
        return [JobRecord._from_hash(raw) if raw else None for raw in pipe.execute()]

    def by_idempotency_key(self, owner: str, key: str) -> JobRecord | None:
        """The job an earlier request of ``owner`` made under this idempotency key, if its record is still there."""
        job_id = self.redis.get(self.idem_key(owner, key))
        return self.get(job_id) if job_id else None

    def batch_by_idempotency_key(self, owner: str, key: str) -> tuple[str, str] | None:
        """``(batch id, fingerprint of its request)`` that an earlier batch of ``owner`` made under this idempotency
        key, while the batch is still there."""
        value = self.redis.get(self.batch_idem_key(owner, key))
        if not value:
            return None
        batch_id, _, fingerprint = value.partition(" ")
        return (batch_id, fingerprint) if self.redis.exists(self.batch_key(batch_id)) else None

    def is_canceled(self, job_id: str) -> bool:
        return self.redis.hget(self.job_key(job_id), "status") == JobStatus.CANCELED.value

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(self.batch_key(batch_id))
        return batch_from_hash(raw) if raw else None

    def batch_records(self, batch_id: str) -> builtins.list[JobRecord]:
        """The batch's jobs in submission order."""
        ids = self.redis.zrange(self.batch_jobs_key(batch_id), 0, -1)
        return [rec for rec in self.get_many(ids) if rec is not None]

    def orphans(self) -> builtins.list[Orphan]:
        """Running records whose holder is dead or has let go of them, and queued ones a dead worker received."""
        rows = self._orphans_script(keys=[f"{self.ns}:running"], args=[self.ns])
        return [Orphan(job_id, queue or None, holder, state != "let go", started=state != "unstarted")
                for job_id, queue, holder, state in rows]  # fmt: skip
