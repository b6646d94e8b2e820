"""Result objects fenced like records: each attempt of a job writes its own object, and the record names the one that
counts.

Why. The record's transitions are fenced by holder (``jobs.py``): an attempt that lost its job (its worker froze
past its heartbeat and another worker took the job over) cannot record an end. Its upload was not fenced: both
attempts wrote ``jobs/<job id>.wav``, so a frozen worker that woke after the job had succeeded elsewhere replaced
the recorded audio with its own render (bit-identical on the CPU, not promised on a GPU). Now:

- **Keys by attempt** (``attempt_key``): attempt 1 writes ``jobs/<job id>.<ext>`` (the key every job that never
  changed hands keeps), attempt ``n`` > 1 writes ``jobs/<job id>.attempt-<n>.<ext>``. The attempt number is the
  record's ``attempts`` counter after the start, drawn atomically, so no two attempts share a key. The finish
  transition records the attempt's own key; a stale attempt's finish is refused, and its object replaces nothing.
- **Orphans**: an attempt notes its key in ``<ns>:results:written`` (a zset scored by time) before it uploads, and
  drops the note once its end is recorded. A refused attempt deletes its own object at once. What remains (an
  attempt killed between its upload and its record, or one frozen again before its clean-up) is swept by the
  retention sweeper (``retention.py``): a note older than ``ORPHAN_GRACE_S`` whose record has ended naming another
  key (or no key) has its object deleted; one whose record names it is just dropped; one whose record is not
  terminal yet waits for a later sweep. The cost is one zset entry per upload in flight, not a listing of the
  bucket.
"""

from __future__ import annotations

import logging
import re
import time

import redis

from auk_worker.service.records.jobs import TERMINAL
from auk_worker.service.records.store import JobStore
from auk_worker.service.connect.storage import Storage
from auk_worker.service.records.objects import result_key

log = logging.getLogger(__name__)

ORPHAN_GRACE_S = 3600  # a note this old is checked: its attempt is over, or frozen for an hour
SWEEP_BATCH = 500
_JOB_ID = re.compile(r"jobs/([0-9a-f]{32})\.")


def attempt_key(prefix: str, job_id: str, attempt: int, extension: str = "wav") -> str:
    """The object attempt ``attempt`` of a job writes: ``jobs/<id>.<ext>`` for the first, ``jobs/<id>.attempt-<n>
    .<ext>`` after."""
    if attempt <= 1:
        return result_key(prefix, job_id, extension)
    return result_key(prefix, job_id, f"attempt-{attempt}.{extension}")


class ResultNotes:
    """The notes of uploads whose end is not recorded yet (``<ns>:results:written``)."""

    def __init__(self, client: redis.Redis, namespace: str = "auk") -> None:
        self.redis = client
        self.key = f"{namespace}:results:written"

    def writing(self, key: str) -> None:
        """Before the upload of ``key``."""
        self.redis.zadd(self.key, {key: time.time()})

    def recorded(self, key: str) -> None:
        """After the record's transition named ``key`` (or after a refused attempt deleted it)."""
        self.redis.zrem(self.key, key)

    def sweep(self, store: JobStore, storage: Storage, grace_s: float = ORPHAN_GRACE_S) -> int:
        """Delete the objects of notes older than ``grace_s`` whose record ended naming another key; returns how
        many objects were deleted."""
        deleted = 0
        stale = self.redis.zrangebyscore(self.key, "-inf", time.time() - grace_s, start=0, num=SWEEP_BATCH)
        for key in stale:
            key = key.decode() if isinstance(key, bytes) else key
            match = _JOB_ID.search(key)
            record = store.get(match[1]) if match else None
            if record is not None and record.status not in TERMINAL:
                continue  # still running somewhere (or queued again): a later sweep decides
            named = (record.result or {}).get("key") if record is not None else None
            if record is not None and named != key:
                storage.delete(key)
                deleted += 1
                log.info("job %s: orphaned result %s deleted (the record names %s)", record.id, key, named)
            self.redis.zrem(self.key, key)  # a record gone with its retention leaves its objects to theirs
        return deleted
