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

The reaper runs after every heartbeat write (every 2 s) in every worker, one worker at a time under a short Redis lock
(``auk:reaper``). For each orphan (``JobStore.orphans``: a Lua scan of ``auk:running``) it first sends ``auk.render``
for the job to its variant's ``recovery`` queue, which workers poll before any other, and then moves the record back to
``queued`` (``JobStore.release_orphan``: only if the same holder still has it and still does not hold it; a kill is
counted when the holder is dead). Sending first means a reaper that dies in between leaves a message and a record a
start can still take (counting the kill itself), never a queued record without a message. A member of a bulk group
comes back as a single job, which also keeps a job that may crash workers away from its neighbours.

A worker can also die after it received a message and before it started the job (a group's later members wait
for the earlier ones' starts): the record is still ``queued`` and its only message sits in kombu's ``unacked`` hash
for the visibility timeout. So a worker notes each message it receives on the records (``task_received`` signal,
``JobStore.mark_delivered``: ``delivered`` = its holder, set ``auk:delivered``), and the reaper sends again a queued
job whose receiver is dead (never one whose receiver is alive: it may be holding the message for a retry's
countdown). No kill is counted: the job never ran. A worker killed right after its fetch leaves the message in its
own unacknowledged set (``queues/fetch.py``: the fetch is atomic); each reaper pass first puts the messages of dead
holders back at the front of their queues (``restore_dead_holders``).

What keeps a job from running twice at once, or storing two WAVs:

- ``start`` refuses a job a live holder holds: the duplicate delivery is acknowledged and dropped. The old message
  kombu restores after the visibility timeout meets a record that ended (acknowledged without work) or a job held
  by its new attempt (dropped).
- Every later transition of an attempt (progress, finish, fail, requeue) names its holder and applies only while
  that holder holds the running record (fencing), so an attempt that was given up cannot record an end, and it
  stops at its next progress write.
- Each attempt uploads to its own key (``records/attempts.py``) and the finish names it, so an attempt that was given
  up never replaces the object the record names; it deletes its own.

Poison jobs: each death of a holder counts one kill on the record (in ``release`` or in ``start``, whichever
comes first). A job started with ``AUK_MAX_KILLS`` kills fails with ``worker_crashed`` instead of rendering, also
when the worker it keeps killing comes back under the same worker id (a new instance id each time).

Timing: a SIGKILLed worker's heartbeat expires within its TTL (10 s), at once if a supervisor restarts it (the new
instance overwrites it); the next reaper pass (at most 2 s later) sends the job, and the next worker to finish its
current job takes it from the recovery queue.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis

from auk_worker.service.queues.celery_app import RECOVERY, queue_name
from auk_worker.service.queues.fetch import restore_dead_holders
from auk_worker.service.records import scripts
from auk_worker.service.records.jobs import Orphan
from auk_worker.service.records.store import JobStore

log = logging.getLogger(__name__)

LOCK_TTL_MS = 5000  # one reaper at a time; a reaper that dies holding the lock blocks the others this long


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
        self.send = send
        self.lock_key = f"{store.ns}:reaper"
        self.token = uuid.uuid4().hex
        self._unlock = store.redis.register_script(scripts.UNLOCK)

    def run(self) -> list[Recovered]:
        """One pass, if no other worker's reaper is in one. Returns what it sent again."""
        if not self.store.redis.set(self.lock_key, self.token, nx=True, px=LOCK_TTL_MS):
            return []
        try:
            for holder, tag, queue in restore_dead_holders(self.store.redis, self.store.ns):
                log.warning("message %s: its fetcher %s died; back at the front of %s", tag, holder, queue)
            return [self._recover(orphan) for orphan in self.store.orphans()]
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
            self.store.forget_delivery(orphan.job_id, orphan.holder)
            log.warning("job %s: its receiver %s died before starting it; sent again to %s", orphan.job_id,
                        orphan.holder, queue)  # fmt: skip
            return Recovered(orphan.job_id, orphan.holder, True, record.kills if record else None)
        kills = self.store.release_orphan(orphan.job_id, orphan.holder)
        why = "died" if orphan.dead else "let go of it"
        log.warning("job %s: its holder %s %s; sent again to %s (kills %s)", orphan.job_id, orphan.holder, why,
                    queue, "unchanged: another attempt took it" if kills is None else kills)  # fmt: skip
        return Recovered(orphan.job_id, orphan.holder, orphan.dead, kills)
