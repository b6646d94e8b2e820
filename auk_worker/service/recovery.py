"""Fast recovery: the jobs whose worker died (or let go of them) run again within seconds, once.

Why heartbeats rather than the broker's own mechanism. With the Redis transport, a message delivered to a worker
sits in kombu's ``unacked`` hash until it is acknowledged; if the worker dies, every worker's periodic sweep puts
it back on its queue once it is older than the visibility timeout. That timeout must exceed the longest job (or a
job still rendering is handed out a second time), so it is an hour by default, and nothing in the hash says which
worker holds which message, so there is no telling a dead worker's delivery from a slow one's sooner. The job
records do say it: a running record names its holder, ``"<worker id>/<instance id>"`` (every start has a new
instance id), and every worker keeps a heartbeat with a 10 s TTL that carries its instance id and the jobs it is
rendering. A holder whose heartbeat expired, names another instance (its container restarted under the same worker
id) or says ``failed`` is dead; one whose fresh heartbeat no longer lists the job let go of it without recording an
end (its attempt ended while Redis was away). Either way the job is an orphan.

The reaper runs after every heartbeat write (every 2 s) in every worker, one worker at a time under a short Redis
lock (``auk:reaper``). For each orphan (``RecoveryStore.orphans``: a Lua scan of ``auk:running``) it first sends
``auk.render`` for the job to its variant's ``recovery`` queue, which workers poll before any other, and then
moves the record back to ``queued`` (``RecoveryStore.release``: only if the same holder still has it and still does not
hold it; a kill is counted when the holder is dead). Sending first means a reaper that dies in between leaves a
message and a record a start can still take (counting the kill itself), never a queued record without a message.
A member of a bulk group comes back as a single job, which also keeps a job that may crash workers away from its
neighbours.

A worker can also die after it received a message and before it started the job (a group's later members wait
for the earlier ones' starts): the record is still ``queued`` and its only message sits in kombu's ``unacked`` hash
for the visibility timeout. So a worker notes each message it receives on the records (``task_received`` signal,
``RecoveryStore.mark_delivered``: ``delivered`` = its holder, set ``auk:delivered``), and the reaper sends again a queued
job whose receiver is dead (never one whose receiver is alive: it may be holding the message for a retry's
countdown). No kill is counted: the job never ran. A worker killed right after its fetch leaves the message in its own unacknowledged set
(``fetch.py``: the fetch is atomic); each reaper pass first puts the messages of dead holders back at the front of
their queues (``restore_dead_holders``).

What keeps a job from running twice at once, or storing two WAVs:

- ``start`` refuses a job a live holder holds: the duplicate delivery is acknowledged and dropped. The old message
  kombu restores after the visibility timeout meets a record that ended (acknowledged without work) or a job held
  by its new attempt (dropped).
- Every later transition of an attempt (progress, finish, fail, requeue) names its holder and applies only while
  that holder holds the running record (fencing), so an attempt that was given up cannot record an end, and it
  stops at its next progress write.
- Each attempt uploads to its own key (``attempts.py``) and the finish names it, so an attempt that was given up
  never replaces the object the record names; it deletes its own.

Poison jobs: each death of a holder counts one kill on the record (in ``release`` or in ``start``, whichever
comes first). A job started with ``AUK_MAX_KILLS`` kills fails with ``worker_crashed`` instead of rendering, also
when the worker it keeps killing comes back under the same worker id (a new instance id each time).

Timing: a SIGKILLed worker's heartbeat expires within its TTL (10 s), at once if a supervisor restarts it (the new
instance overwrites it); the next reaper pass (at most 2 s later) sends the job, and the next worker to finish its
current job takes it from the recovery queue.
"""

from __future__ import annotations

import logging
import builtins
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis

from auk_worker.service.celery_app import RECOVERY, queue_name
from auk_worker.service.fetch import restore_dead_holders
from auk_worker.service.jobs import LUA_HELPERS, JobStore

log = logging.getLogger(__name__)

LOCK_TTL_MS = 5000  # one reaper at a time; a reaper that dies holding the lock blocks the others this long

# Deletes the lock only if this reaper still owns it (it may have expired and been taken by another).
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class Orphan:
    """A running job no live attempt holds: its holder died (``dead``) or let go of it; or (``started`` False) a
    queued job whose message a worker received and that worker died before starting it."""

    job_id: str
    queue: str | None
    holder: str
    dead: bool
    started: bool = True


# KEYS: the running set. ARGV: namespace. Returns {job id, queue, holder, state} for every running record whose
# holder is dead or let go of it; drops finished records left in the set.
_ORPHANS = (
    LUA_HELPERS
    + """
local prefix = ARGV[1] .. ':job:'
local out = {}
for _, job in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local rec = redis.call('HMGET', job, 'status', 'worker', 'held_at', 'queue')
  if rec[1] ~= 'running' then
    redis.call('SREM', KEYS[1], job)
  else
    local id = string.sub(job, #prefix + 1)
    local state = holder_state(ARGV[1], rec[2], id, rec[3])
    if state ~= 'holds' then
      out[#out + 1] = {id, rec[4] or '', rec[2] or '', state}
    end
  end
end
-- Received but never started: only a dead receiver makes an orphan (a live one may hold it for a retry's ETA).
local delivered = ARGV[1] .. ':delivered'
for _, job in ipairs(redis.call('SMEMBERS', delivered)) do
  local rec = redis.call('HMGET', job, 'status', 'delivered', 'queue')
  if rec[1] ~= 'queued' or (not rec[2]) or rec[2] == '' then
    redis.call('SREM', delivered, job)
  else
    local id = string.sub(job, #prefix + 1)
    if holder_state(ARGV[1], rec[2], id, nil) == 'dead' then
      out[#out + 1] = {id, rec[3] or '', rec[2], 'unstarted'}
    end
  end
end
return out
"""
)

# KEYS: job keys. ARGV: namespace, holder. Marks each queued one as received by that holder.
_DELIVER = """
for _, job in ipairs(KEYS) do
  if redis.call('HGET', job, 'status') == 'queued' then
    redis.call('HSET', job, 'delivered', ARGV[2])
    redis.call('SADD', ARGV[1] .. ':delivered', job)
  end
end
return 1
"""

# KEYS: job. ARGV: namespace, holder. Forgets a delivery to that (dead) holder of a still queued record; 1 if it did.
_UNDELIVER = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' or redis.call('HGET', KEYS[1], 'delivered') ~= ARGV[2] then
  return 0
end
redis.call('HDEL', KEYS[1], 'delivered')
redis.call('SREM', ARGV[1] .. ':delivered', KEYS[1])
return 1
"""

# KEYS: job. ARGV: namespace, holder, job id. running -> queued when that holder still has it and no longer holds
# it (kills + 1 when it is dead). Returns {} when nothing changed, else {kills}.
_RELEASE = (
    LUA_HELPERS
    + """
local job = KEYS[1]
local status = redis.call('HGET', job, 'status')
if status ~= 'running' or redis.call('HGET', job, 'worker') ~= ARGV[2] then return {} end
local state = holder_state(ARGV[1], ARGV[2], ARGV[3], redis.call('HGET', job, 'held_at'))
if state == 'holds' then return {} end
if state == 'dead' then redis.call('HINCRBY', job, 'kills', 1) end
redis.call('HSET', job, 'status', 'queued', 'worker', '', 'progress', '')
redis.call('SREM', ARGV[1] .. ':running', job)
move_status(job, ARGV[1], 'running', 'queued')
move_batch(job, ARGV[1], 'running', 'queued', false)
return {tonumber(redis.call('HGET', job, 'kills'))}
"""
)


class RecoveryStore:
    """The reaper's side of the job records (``jobs.py`` holds the lifecycle; these scripts use its helpers)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.ns = store.ns
        client = store.redis
        self._orphans = client.register_script(_ORPHANS)
        self._release = client.register_script(_RELEASE)
        self._deliver = client.register_script(_DELIVER)
        self._undeliver = client.register_script(_UNDELIVER)

    def orphans(self) -> builtins.list[Orphan]:
        """Running records whose holder is dead or has let go of them, and queued ones a dead worker received."""
        rows = self._orphans(keys=[f"{self.ns}:running"], args=[self.ns])
        return [Orphan(job_id, queue or None, holder, state != "let go", started=state != "unstarted")
                for job_id, queue, holder, state in rows]  # fmt: skip

    def release(self, job_id: str, holder: str) -> int | None:
        """running -> queued for a job ``holder`` had and no longer holds (kills + 1 when it is dead); the job's
        kills after it, or None when nothing changed (another attempt took it, or the holder still holds it)."""
        reply = self._release(keys=[self.store.job_key(job_id)], args=[self.ns, holder, job_id])
        return int(reply[0]) if reply else None

    def mark_delivered(self, job_ids: builtins.list[str], holder: str) -> None:
        """Note on each still queued record that ``holder`` received its message (before it starts the job)."""
        if job_ids:
            self._deliver(keys=[self.store.job_key(job_id) for job_id in job_ids], args=[self.ns, holder])

    def forget_delivery(self, job_id: str, holder: str) -> bool:
        """Drop a queued record's delivery to ``holder`` (dead before it started the job); True if it was there."""
        return bool(self._undeliver(keys=[self.store.job_key(job_id)], args=[self.ns, holder]))


@dataclass(frozen=True)
class Recovered:
    """One job the reaper sent again."""

    job_id: str
    holder: str
    dead: bool  # the holder died (a kill was counted), rather than letting go of the job
    kills: int | None  # the record's kills after the release (None: another attempt took the job first)


class Reaper:
    """Finds orphaned jobs and sends them again; ``send(job_id, queue)`` sends ``auk.render`` for one job."""

    def __init__(self, store: JobStore, send: Callable[[str, str], None]) -> None:
        self.store = store
        self.records = RecoveryStore(store)
        self.send = send
        self.lock_key = f"{store.ns}:reaper"
        self.token = uuid.uuid4().hex
        self._unlock = store.redis.register_script(_UNLOCK)

    def run(self) -> list[Recovered]:
        """One pass, if no other worker's reaper is in one. Returns what it sent again."""
        if not self.store.redis.set(self.lock_key, self.token, nx=True, px=LOCK_TTL_MS):
            return []
        try:
            for holder, tag, queue in restore_dead_holders(self.store.redis, self.store.ns):
                log.warning("message %s: its fetcher %s died; back at the front of %s", tag, holder, queue)
            return [self._recover(orphan) for orphan in self.records.orphans()]
        finally:
            try:
                self._unlock(keys=[self.lock_key], args=[self.token])
            except redis.RedisError:  # it expires on its own
                pass

    def _recover(self, orphan: Orphan) -> Recovered:
        record = self.store.get(orphan.job_id)
        variant = (record.request.get("variant") if record else None) or "base"
        queue = queue_name(variant, RECOVERY)
        self.send(orphan.job_id, queue)
        if not orphan.started:  # never started: no kill to count, and the record is queued already
            self.records.forget_delivery(orphan.job_id, orphan.holder)
            log.warning("job %s: its receiver %s died before starting it; sent again to %s", orphan.job_id,
                        orphan.holder, queue)  # fmt: skip
            return Recovered(orphan.job_id, orphan.holder, True, record.kills if record else None)
        kills = self.records.release(orphan.job_id, orphan.holder)
        why = "died" if orphan.dead else "let go of it"
        log.warning("job %s: its holder %s %s; sent again to %s (kills %s)", orphan.job_id, orphan.holder, why,
                    queue, "unchanged: another attempt took it" if kills is None else kills)  # fmt: skip
        return Recovered(orphan.job_id, orphan.holder, orphan.dead, kills)
