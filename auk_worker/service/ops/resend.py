"""Queued jobs with no message are sent again: what the queue audit (``audit.py``) finds, acted on.

A record can stay ``queued`` with no message anywhere when Redis fails over with asynchronous replication and the
replica had the record but not the message (the master died between the two writes; the caller got a 503 and may
never retry), when a send failed past its window and the record's failure could not be written either, or through a
bug yet unknown. Nothing else would ever send it, and it would hold its key's queued-jobs quota for good.

Every ``RESEND_EVERY_S``, one API process (a lock that lasts the period, whichever replica takes it):

1. the audit's candidates: the oldest queued jobs, queued for over ``GRACE_S``, that none of the oldest messages
   names (cheap, bounded);
2. each confirmed by a deeper read (``DEEP``: 10,000 entries a list, read only when there is a candidate), in one
   snapshot, of every queue, the unacknowledged messages, the keys' staged bulk tasks and the feeder's releases in
   flight, and by its record still saying ``queued`` after it;
3. a job found missing by two passes in a row (the previous pass's suspects live in ``{ns}:resend:suspects``) is
   sent to its variant's ``recovery`` queue, which workers poll first. Two passes: a message on its way between
   two places at one snapshot is not on its way at the next.

A job sent again that had a message after all (deeper than ``DEEP`` in a list) still renders once: a worker's
start refuses a job that ended or that a live holder holds, and the other message is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable

import redis

from auk_worker.service.ops.audit import overdue_without_message, without_message
from auk_worker.service.queues.celery_app import RECOVERY, RENDER_TASK, queue_name
from auk_worker.service.queues.fairshare import Send
from auk_worker.service.records.store import JobStore

log = logging.getLogger(__name__)

RESEND_EVERY_S = 30.0
RESENT = "resent"  # the field of the jobs' stats hash that counts them (``auk_jobs_resent_total``)


class Resender:
    """One pass at a time across the service; ``send(task, args, queue)`` sends a task by name."""

    def __init__(self, store: JobStore, owners: Iterable[str], send: Send) -> None:
        self.store = store
        self.owners = sorted(set(owners))
        self.send = send
        self.lock_key = f"{store.ns}:resend:lock"
        self.suspects_key = f"{store.ns}:resend:suspects"

    def run(self, now: float | None = None) -> list[str]:
        """One pass, unless another process made one within the period; returns the jobs sent again."""
        client = self.store.redis
        if not client.set(self.lock_key, uuid.uuid4().hex, nx=True, px=int(RESEND_EVERY_S * 900)):
            return []
        return self.pass_once(now)

    def pass_once(self, now: float | None = None) -> list[str]:
        """Steps 1-3 of the module's docstring, without the lock."""
        client, ns = self.store.redis, self.store.ns
        now = time.time() if now is None else now
        _, missing = overdue_without_message(client, self.owners, ns, now)
        if missing:  # not among the oldest messages: look deeper before calling it lost
            missing = without_message(client, self.owners, missing, ns, deep=True)
        suspected = set(client.smembers(self.suspects_key))
        due = [job for job in missing if job in suspected]
        pipe = client.pipeline(transaction=True)
        pipe.delete(self.suspects_key)
        if later := [job for job in missing if job not in suspected]:
            pipe.sadd(self.suspects_key, *later)
            pipe.pexpire(self.suspects_key, int(RESEND_EVERY_S * 4000))
        pipe.execute()
        return [job for job in due if self._resend(job)]

    def _resend(self, job_id: str) -> bool:
        record = self.store.get(job_id)
        if record is None:
            return False
        queue = queue_name(record.request.get("variant") or "base", RECOVERY)
        self.send(RENDER_TASK, [job_id], queue)
        self.store.redis.hincrby(self.store.stats_key(), RESENT, 1)
        log.warning("job %s: queued since %s with no message anywhere; sent again to %s", job_id, record.created_at,
                    queue)  # fmt: skip
        return True


def start_background(resender: Resender) -> threading.Event:
    """``Resender.run`` every ``RESEND_EVERY_S`` on a daemon thread until the returned event is set."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(RESEND_EVERY_S):
            try:
                resender.run()
            except (redis.RedisError, OSError) as exc:  # Redis or the broker away: the next pass tries again
                log.warning("resend pass: %s", exc)
            except Exception:  # noqa: BLE001 - the thread's boundary: log it, keep the passes going
                log.exception("resend pass failed")

    threading.Thread(target=run, name="resender", daemon=True).start()
    return stop
