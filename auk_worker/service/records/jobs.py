"""The job lifecycle and its Redis record store.

A job record is written before its task is sent, so every id a caller sees exists. It moves
``queued -> running -> succeeded | failed | canceled``; each transition is one Lua script, so it is atomic
against the API (cancel) and other workers (a redelivered task), and a terminal record never changes again.
(Every transition's script sits beside the method that runs it, which makes this file longer than most.)

A running record names its holder, ``"<worker id>/<instance id>"`` (``worker``), and when it took the job
(``held_at``, the holder's own clock). The holder is alive while its heartbeat (``health.py``) carries the same
instance id and a state other than ``failed``; it still holds the job while that heartbeat lists the job id, or was
written before ``held_at``. Transitions given a holder apply only while that holder holds the running record
(fencing: a worker that lost its job cannot finish it); ``start`` refuses a job a live holder holds (a duplicate
delivery) and counts a kill when it takes one from a dead holder. ``recovery.py`` finds and re-sends the rest
(its scripts build on ``LUA_HELPERS`` here).

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
- ``auk:worker:{worker id}``  hash: a worker's heartbeat (see ``health.py``); ``auk:workers`` set of worker ids

The holder checks read heartbeat keys a script is not handed in ``KEYS``: fine on one Redis (or a Sentinel-managed
master), not on Redis Cluster.

Retention (``retention.py``): a transition to a terminal state sets the record's and its idempotency key's TTL
(``retain_s``), and the batch's once its last job ends; the sweeper trims index entries whose record has gone.

Batch counters move inside the same script as the job, so ``get_batch`` is O(1). The worker that records a
batch's last terminal job is told so (``Transition.batch_done``) and writes the manifest; a later delivery of any of
the batch's jobs writes it if it is still missing (the canceled jobs' case, or that worker's death).

Longer than 400 lines: the record, the Lua scripts that move it and the store that runs them are one state
machine; split apart, each script would be read away from the fields it moves.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any

import redis

from auk_worker.service.connect.redis import redis_client
from auk_worker.service.connect.settings import Settings


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


@dataclass(frozen=True)
class Transition:
    """What a finishing transition did: the record after it (None if it was already terminal or missing),
    and whether this call claimed its batch's manifest (it made the batch's last job terminal)."""

    record: JobRecord | None
    batch_done: bool = False

    @property
    def changed(self) -> bool:
        return self.record is not None


def _flat_to_dict(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2]))


def _score(record: JobRecord) -> int:
    stamp = datetime.fromisoformat(record.created_at.replace("Z", "+00:00"))
    return int(stamp.timestamp() * 1000)


# Shared Lua: move a job between its owner's status indexes (move_status); move its batch counters from one status
# to another and claim the manifest when the batch's terminal count reaches its total (move_batch: returns 1 when
# this call claimed it).
LUA_HELPERS = """
local function is_terminal(s)
  return s == 'succeeded' or s == 'failed' or s == 'canceled'
end
-- A running record's holder ("<worker id>/<instance id>"): 'dead' when its worker's heartbeat is gone, names
-- another instance or says failed; 'holds' when that heartbeat lists the job or was written before the holder
-- took it (it may not show the job yet); else 'let go' (alive, but its attempt ended without a transition).
local function holder_state(ns, holder, job_id, held_at)
  local cut = string.find(holder or '', '/[^/]*$')
  if not cut then return 'dead' end
  local beat_key = ns .. ':worker:' .. string.sub(holder, 1, cut - 1)
  local beat = redis.call('HMGET', beat_key, 'instance', 'state', 'job_id', 'ts')
  if beat[1] ~= string.sub(holder, cut + 1) or beat[2] == 'failed' then return 'dead' end
  if (tonumber(beat[4]) or 0) <= (tonumber(held_at) or 0) then return 'holds' end
  if string.find(',' .. (beat[3] or '') .. ',', ',' .. job_id .. ',', 1, true) then return 'holds' end
  return 'let go'
end
local function move_status(job, ns, old, new)
  if old == new then return end
  local id = redis.call('HGET', job, 'id')
  local owner_index = ns .. ':owner:' .. redis.call('HGET', job, 'owner')
  local score = redis.call('ZSCORE', owner_index .. ':jobs', id)
  redis.call('ZREM', owner_index .. ':status:' .. old, id)
  if score then redis.call('ZADD', owner_index .. ':status:' .. new, score, id) end
end
local function move_batch(job, ns, old, new, claim)
  local batch = redis.call('HGET', job, 'batch_id')
  if (not batch) or batch == '' or old == new then return 0 end
  local bkey = ns .. ':batch:' .. batch
  redis.call('HINCRBY', bkey, 'n_' .. old, -1)
  redis.call('HINCRBY', bkey, 'n_' .. new, 1)
  if is_terminal(new) and not is_terminal(old) then
    local done = redis.call('HINCRBY', bkey, 'terminal', 1)
    local total = tonumber(redis.call('HGET', bkey, 'total'))
    if claim and done >= total then
      return redis.call('HSETNX', bkey, 'manifest_claimed', '1')
    end
  end
  return 0
end
"""

# KEYS: job, owner index, idempotency key ('' for none), the owner's index of the record's status, the owner's
# status-indexed marker (set with an owner's first job: it has no older records to index).
# ARGV: job id, score, job key prefix, then field/value pairs.
_CREATE = """
if KEYS[3] ~= '' then
  local existing = redis.call('GET', KEYS[3])
  if existing then
    local rec = redis.call('HGETALL', ARGV[3] .. existing)
    if #rec > 0 then return {0, rec} end
  end
end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
if redis.call('ZCARD', KEYS[2]) == 0 then redis.call('SET', KEYS[5], '1') end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
if KEYS[3] ~= '' then redis.call('SET', KEYS[3], ARGV[1]) end
return {1, redis.call('HGETALL', KEYS[1])}
"""

# KEYS: job. ARGV: namespace, now, holder, held_at, job id. Returns {} if missing, {'terminal'} if terminal,
# {'held'} if a live holder holds it, else the record.
_START = (
    LUA_HELPERS
    + """
local job = KEYS[1]
local status = redis.call('HGET', job, 'status')
if not status then return {} end
if is_terminal(status) then return {'terminal'} end
if status == 'running' then
  local prev = redis.call('HGET', job, 'worker') or ''
  if prev ~= '' and prev ~= ARGV[3] then
    local state = holder_state(ARGV[1], prev, ARGV[5], redis.call('HGET', job, 'held_at'))
    if state == 'holds' then return {'held'} end
    if state == 'dead' then redis.call('HINCRBY', job, 'kills', 1) end
  end
end
redis.call('HINCRBY', job, 'attempts', 1)
redis.call('HSET', job, 'status', 'running', 'worker', ARGV[3], 'held_at', ARGV[4], 'progress', '')
redis.call('HDEL', job, 'delivered')
redis.call('SREM', ARGV[1] .. ':delivered', job)
redis.call('SADD', ARGV[1] .. ':running', job)
local started = redis.call('HGET', job, 'started_at')
if (not started) or started == '' then redis.call('HSET', job, 'started_at', ARGV[2]) end
move_status(job, ARGV[1], status, 'running')
move_batch(job, ARGV[1], status, 'running', false)
return redis.call('HGETALL', job)
"""
)

# KEYS: job. ARGV: namespace, new status, now, claim ('1'/'0'), allowed-from list (comma), holder ('' for any),
# field/value pairs. Returns {0} when the transition does not apply (with a holder: unless that holder holds the
# running record), else {claimed, record}.
_TRANSITION = (
    LUA_HELPERS
    + """
local job = KEYS[1]
local status = redis.call('HGET', job, 'status')
if not status then return {0} end
if is_terminal(status) then return {0} end
if not string.find(',' .. ARGV[5] .. ',', ',' .. status .. ',', 1, true) then return {0} end
if ARGV[6] ~= '' and (status ~= 'running' or redis.call('HGET', job, 'worker') ~= ARGV[6]) then return {0} end
if #ARGV > 6 then
  local fields = {}
  for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('HSET', job, unpack(fields))
end
redis.call('HSET', job, 'status', ARGV[2])
if status == 'running' and ARGV[2] ~= 'running' then redis.call('SREM', ARGV[1] .. ':running', job) end
if is_terminal(ARGV[2]) then redis.call('HSET', job, 'finished_at', ARGV[3]) end
move_status(job, ARGV[1], status, ARGV[2])
local claimed = move_batch(job, ARGV[1], status, ARGV[2], ARGV[4] == '1')
return {claimed, redis.call('HGETALL', job)}
"""
)

# KEYS: job. ARGV: step, total, holder ('' for any). Writes progress only while running (under that holder);
# returns the status, or 'lost' when another holder runs it.
_PROGRESS = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'running' then
  if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'worker') ~= ARGV[3] then return 'lost' end
  redis.call('HSET', KEYS[1], 'progress', '{"step":' .. ARGV[1] .. ',"total":' .. ARGV[2] .. '}')
end
return status
"""

# KEYS: job, stats ('' to count nothing). ARGV: namespace, terminal status, TTL in seconds (0: keep forever).
# Counts the finished job and starts the clocks of its record, its idempotency key and (once its last job has
# ended) its batch.
_RETIRE = """
if KEYS[2] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[2], 1) end
local ttl = tonumber(ARGV[3])
if ttl <= 0 then return 0 end
redis.call('EXPIRE', KEYS[1], ttl)
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem and idem ~= '' then redis.call('EXPIRE', idem, ttl) end
local batch = redis.call('HGET', KEYS[1], 'batch_id')
if batch and batch ~= '' then
  local bkey = ARGV[1] .. ':batch:' .. batch
  local counts = redis.call('HMGET', bkey, 'terminal', 'total')
  if counts[1] and tonumber(counts[1]) >= tonumber(counts[2]) then
    redis.call('EXPIRE', bkey, ttl)
    redis.call('EXPIRE', bkey .. ':jobs', ttl)
  end
end
return 1
"""


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


class JobStore:
    """Job and batch records in Redis. The client must use ``decode_responses=True``.

    ``retain_s``: how long a finished job's record and idempotency key (and an ended batch) stay; 0 keeps them.
    """

    def __init__(self, redis_client: redis.Redis, namespace: str = "auk", retain_s: int = 0) -> None:
        self.redis = redis_client
        self.ns = namespace
        self.retain_s = retain_s
        self._retire = redis_client.register_script(_RETIRE)
        self._create = redis_client.register_script(_CREATE)
        self._start = redis_client.register_script(_START)
        self._transition = redis_client.register_script(_TRANSITION)
        self._progress = redis_client.register_script(_PROGRESS)

    @classmethod
    def from_settings(cls, settings: Settings, namespace: str = "auk") -> JobStore:
        return cls(redis_client(settings, socket_connect_timeout=2, socket_timeout=5), namespace)

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

    def batch_key(self, batch_id: str) -> str:
        return f"{self.ns}:batch:{batch_id}"

    def batch_jobs_key(self, batch_id: str) -> str:
        return f"{self.ns}:batch:{batch_id}:jobs"

    def stats_key(self) -> str:
        return f"{self.ns}:stats:jobs"

    # -- create and read ----------------------------------------------------------------------------------------
    def create(self, record: JobRecord, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        """Write a new queued record; a repeated (owner, idempotency key) returns the existing one instead."""
        idem = self.idem_key(record.owner, idempotency_key) if idempotency_key else ""
        pairs = [item for pair in record._to_hash().items() for item in pair]
        if idem:
            pairs += ["idem", idem]  # the key a finished record's TTL also applies to
        created, flat = self._create(
            keys=[self.job_key(record.id), self.owner_key(record.owner), idem,
                  self.status_key(record.owner, record.status), self.indexed_key(record.owner)],
            args=[record.id, _score(record), f"{self.ns}:job:", *pairs],
        )
        if created:
            self.redis.hincrby(self.stats_key(), "submitted", 1)
        return JobRecord._from_hash(_flat_to_dict(flat)), bool(created)

    def by_idempotency_key(self, owner: str, key: str) -> JobRecord | None:
        """The job an earlier request of ``owner`` made under this idempotency key, if its record is still there."""
        job_id = self.redis.get(self.idem_key(owner, key))
        return self.get(job_id) if job_id else None

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

    def list(
        self,
        owner: str,
        status: JobStatus | str | None = None,
        batch_id: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[builtins.list[JobRecord], str | None]:
        """The owner's jobs newest first, optionally one status or one batch; ``next_cursor`` is None at the end.

        The cursor is opaque to callers (``"<created ms>-<job id>"``) and stays valid while new jobs arrive.
        """
        want = JobStatus(status) if status is not None else None
        if batch_id:
            index = self.batch_jobs_key(batch_id)
        elif want is not None:
            self._ensure_status_index(owner)
            index = self.status_key(owner, want)  # the filter below then only guards a transition mid-read
        else:
            index = self.owner_key(owner)
        top: float | str = "+inf"
        after: tuple[float, str] | None = None
        if cursor:
            score_s, _, after_id = cursor.partition("-")
            # The score is a creation time in whole milliseconds: digits only (no nan, inf, signs or exponents).
            if not (score_s.isascii() and score_s.isdigit() and len(score_s) <= 16 and after_id):
                raise ValueError(f"bad cursor {cursor!r}")
            after = (float(score_s), after_id)
            top = after[0]
        out: builtins.list[tuple[JobRecord, float]] = []
        # Every id of an owner or status index qualifies: read one page and its look-ahead; a batch filtered by
        # status skips ids, so it reads ahead in larger chunks.
        exact = not (batch_id and want is not None)
        offset, chunk = 0, limit + 1 if exact else max(limit + 1, 64)
        while len(out) <= limit:
            rows = self.redis.zrevrangebyscore(index, top, "-inf", start=offset, num=chunk, withscores=True)
            if not rows:
                break
            offset += len(rows)
            if after is not None:
                # Equal scores come in reverse id order: skip the ids at or above the cursor's.
                rows = [(m, s) for m, s in rows if not (s == after[0] and m >= after[1])]
            records = self.get_many([m for m, _ in rows])
            for (_, score), rec in zip(rows, records):
                if rec is None or rec.owner != owner or (want is not None and rec.status != want):
                    continue
                out.append((rec, score))
                if len(out) > limit:
                    break
        page = out[:limit]
        next_cursor = None
        if len(out) > limit and page:
            last, score = page[-1]
            next_cursor = f"{int(score)}-{last.id}"
        return [rec for rec, _ in page], next_cursor

    def count(self, owner: str, statuses: tuple[JobStatus, ...]) -> int:
        """How many of the owner's jobs are in ``statuses`` (O(1) per status: the status indexes' sizes)."""
        self._ensure_status_index(owner)
        pipe = self.redis.pipeline(transaction=False)
        for status in statuses:
            pipe.zcard(self.status_key(owner, status))
        return sum(pipe.execute())

    def _ensure_status_index(self, owner: str) -> None:
        """Index an owner's records written before the status indexes existed, once (then marked as done).

        Transitions keep the indexes from then on; a record that moves while this runs may leave a stale entry,
        which listings skip (they check each record's status)."""
        marker = self.indexed_key(owner)
        if self.redis.exists(marker):
            return
        offset, chunk = 0, 1000
        while rows := self.redis.zrange(self.owner_key(owner), offset, offset + chunk - 1, withscores=True):
            offset += len(rows)
            records = self.get_many([job_id for job_id, _ in rows])
            pipe = self.redis.pipeline(transaction=False)
            for (job_id, score), record in zip(rows, records):
                if record is not None:
                    pipe.zadd(self.status_key(owner, record.status), {job_id: score})
            pipe.execute()
        self.redis.set(marker, "1")

    # -- transitions --------------------------------------------------------------------------------------------
    def start(self, job_id: str, worker: str = "", held_at: float | None = None) -> JobRecord | None:
        """queued/running -> running, attempts + 1. None when there is nothing to do: the record is terminal or
        missing, or a live holder holds it (a duplicate delivery; the caller acknowledges it and drops it).

        ``worker`` names this attempt's holder ("<worker id>/<instance id>"), ``held_at`` is now on its clock.
        Taking a record still ``running`` under a dead holder counts a kill; under a holder that let go of it
        (its attempt ended without a transition, say while Redis was away) or under ``worker`` itself, none.
        """
        stamp = f"{time.time() if held_at is None else held_at:.3f}"
        flat = self._start(keys=[self.job_key(job_id)], args=[self.ns, utc_now(), worker, stamp, job_id])
        if not flat or flat in (["terminal"], ["held"]):
            return None
        return JobRecord._from_hash(_flat_to_dict(flat))

    def set_progress(self, job_id: str, step: int, total: int, holder: str = "") -> JobStatus | None:
        """Record step k of N while running (under ``holder``, when given); returns the current status, or None
        when the record is missing or another holder runs it, so that a caller stops at a cancel or a lost job."""
        status = self._progress(keys=[self.job_key(job_id)], args=[int(step), int(total), holder])
        return None if status in (None, "lost") else JobStatus(status)

    def is_canceled(self, job_id: str) -> bool:
        return self.redis.hget(self.job_key(job_id), "status") == JobStatus.CANCELED.value

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
        reply = self._transition(
            keys=[self.job_key(job_id)],
            args=[self.ns, new.value, utc_now(), "1" if claim else "0", allowed_s, holder, *pairs],
        )
        if len(reply) < 2:
            return Transition(None)
        if new in TERMINAL:
            self.retire(job_id, new)
        return Transition(JobRecord._from_hash(_flat_to_dict(reply[1])), bool(reply[0]))

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

    # -- batches ------------------------------------------------------------------------------------------------
    def create_batch(self, owner: str, records: builtins.list[JobRecord]) -> str:
        """Write a batch and all its (queued) job records in one transaction; returns the batch id."""
        batch_id = new_id()
        now = utc_now()
        first = self.redis.zcard(self.owner_key(owner)) == 0
        pipe = self.redis.pipeline(transaction=True)
        if first:  # an owner's first jobs: nothing older to index
            pipe.set(self.indexed_key(owner), "1")
        for position, record in enumerate(records):
            if record.owner != owner:
                raise ValueError(f"job {record.id} belongs to another owner")
            record.batch_id = batch_id
            pipe.hset(self.job_key(record.id), mapping=record._to_hash())
            pipe.zadd(self.owner_key(owner), {record.id: _score(record)})
            pipe.zadd(self.status_key(owner, record.status), {record.id: _score(record)})
            pipe.zadd(self.batch_jobs_key(batch_id), {record.id: position})  # submission order
        counts = {f"n_{s.value}": 0 for s in JobStatus}
        counts["n_queued"] = len(records)
        pipe.hset(
            self.batch_key(batch_id),
            mapping={"id": batch_id, "owner": owner, "total": len(records), "terminal": 0, "created_at": now, **counts},
        )
        pipe.hincrby(self.stats_key(), "submitted", len(records))
        pipe.execute()
        return batch_id

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(self.batch_key(batch_id))
        return batch_from_hash(raw) if raw else None

    def batch_records(self, batch_id: str) -> builtins.list[JobRecord]:
        """The batch's jobs in submission order."""
        ids = self.redis.zrange(self.batch_jobs_key(batch_id), 0, -1)
        return [rec for rec in self.get_many(ids) if rec is not None]

    def retire(self, job_id: str, status: JobStatus, ttl: int | None = None, count: bool = True) -> None:
        """A job just became terminal: count it by status (unless ``count`` is false) and set the TTLs of its
        record, its idempotency key and its ended batch to ``ttl`` (default ``retain_s``; 0 keeps them)."""
        ttl = self.retain_s if ttl is None else ttl
        self._retire(keys=[self.job_key(job_id), self.stats_key() if count else ""], args=[self.ns, status.value, ttl])

    def set_batch_manifest(self, batch_id: str, key: str) -> None:
        self.redis.hset(self.batch_key(batch_id), mapping={"manifest_key": key, "finished_at": utc_now()})
