"""The queue audit: queued jobs with no message anywhere (always 0 when nothing is lost), and the oldest queued job's
age. Read by the API's ``/metrics`` (``auk_jobs_queued_without_message``, ``auk_jobs_oldest_queued_age_seconds``)
and its ``/readyz`` (``queue``).

A job whose message is gone stays ``queued`` (the window the atomic fetch closed, ``fetch.py``; a failover that kept
the record but not the message, with asynchronous replication; a bug yet unknown) until ``resend.py`` sends it
again from what this audit finds, and so it becomes one of the oldest queued jobs. The audit therefore looks only
at the oldest ones, at a cost that does not grow with the backlog:

1. the ``OLDEST`` oldest queued jobs across the owners (``ZRANGE`` of each owner's ``status:queued`` index, scored
   by creation time);
2. those queued for more than ``GRACE_S`` are looked for, in one ``MULTI`` snapshot, among the ``DEPTH`` oldest
   messages of every queue (the lists are first in, first out, so an old job's message sits near their oldest
   end), every delivered and unacknowledged message (``unacked``: the workers' fetches and retries), the
   ``DEPTH`` first tasks staged for each owner in the bulk queues and the feeder's releases not yet confirmed sent
   (``fairshare.py``). A message names its jobs in its ``argsrepr`` header; a staged task in its arguments;
3. one not found whose record still says ``queued`` after the snapshot has no message.

A job can hide deeper than ``DEPTH`` in a queue only behind more than ``DEPTH`` messages that are older still and
whose jobs are no longer queued (a mass cancel leaves its messages until workers drop them): the audit then counts
it until those are consumed. ``CACHE_S`` keeps scrapes from repeating the reads.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import redis

from auk_worker.service.queues.celery_app import worker_queues
from auk_worker.service.connect.settings import VARIANTS

OLDEST = 100  # oldest queued jobs looked at
DEPTH = 500  # oldest messages read per queue, first tasks per staged list
DEEP = 10_000  # the same, to confirm that a job is missing before it is sent again (resend.py)
GRACE_S = 60.0  # a job queued this long should have a message that a worker can see
CACHE_S = 10.0
_JOB_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")


@dataclass(frozen=True)
class QueueAudit:
    queued_without_message: int  # among the oldest queued jobs, those queued over GRACE_S with no message
    oldest_queued_age_s: float | None  # None: nothing queued
    checked: int  # oldest queued jobs looked at

    def as_dict(self) -> dict:
        return asdict(self)


def audit_queue(client: redis.Redis, owners: Iterable[str], namespace: str = "auk",
                now: float | None = None) -> QueueAudit:  # fmt: skip
    """One audit (see the module's docstring); ``owners``: the owner ids whose queued jobs are looked at."""
    now = time.time() if now is None else now
    queued, missing = overdue_without_message(client, sorted(set(owners)), namespace, now)
    if not queued:
        return QueueAudit(0, None, 0)
    oldest_age = max(0.0, now - queued[0][0])
    return QueueAudit(len(missing), round(oldest_age, 1), len(queued))


def overdue_without_message(client: redis.Redis, owners: list[str], namespace: str,
                            now: float) -> tuple[list[tuple[float, str]], list[str]]:  # fmt: skip
    """Steps 1-3: the oldest queued jobs (``oldest_queued``), and those of them queued for over ``GRACE_S`` that
    none of the oldest messages names (``without_message``)."""
    queued = oldest_queued(client, owners, namespace)
    overdue = [job for created, job in queued if now - created > GRACE_S]
    return queued, without_message(client, owners, overdue, namespace)


def oldest_queued(client: redis.Redis, owners: list[str], namespace: str = "auk") -> list[tuple[float, str]]:
    """The ``OLDEST`` oldest queued jobs across ``owners``: ``(created, job id)``, oldest first (``ZRANGE`` of each
    owner's ``status:queued`` index, scored by creation time in milliseconds)."""
    pipe = client.pipeline(transaction=False)
    for owner in owners:
        pipe.zrange(f"{namespace}:owner:{owner}:status:queued", 0, OLDEST - 1, withscores=True)
    return sorted((score / 1000, _text(job)) for rows in pipe.execute() for job, score in rows)[:OLDEST]


def without_message(client: redis.Redis, owners: list[str], jobs: Iterable[str], namespace: str = "auk",
                    deep: bool = False) -> list[str]:  # fmt: skip
    """Those of ``jobs`` that no message names and whose record still says ``queued`` after the snapshot. The
    ``DEPTH`` oldest messages of each queue and first tasks of each staged list are read; ``deep``: ``DEEP``."""
    jobs = set(jobs)
    depth = DEEP if deep else DEPTH
    missing = sorted(jobs - _jobs_with_messages(client, owners, namespace, depth)) if jobs else []
    if missing:  # started (or ended) since the snapshot: not missing
        pipe = client.pipeline(transaction=False)
        for job in missing:
            pipe.hget(f"{namespace}:job:{job}", "status")
        missing = [job for job, status in zip(missing, pipe.execute()) if _text(status or "") == "queued"]
    return missing


def _jobs_with_messages(client: redis.Redis, owners: list[str], namespace: str, depth: int) -> set[str]:
    """The job ids that the ``depth`` oldest messages of each queue, the unacknowledged ones, the ``depth`` first
    staged tasks of each list and the feeder's releases not yet confirmed name (one MULTI)."""
    queues = [queue for variant in VARIANTS for queue in worker_queues(variant)]
    pipe = client.pipeline(transaction=True)
    for queue in queues:
        pipe.lrange(queue, -depth, -1)
    pipe.hvals("unacked")
    pipe.hkeys(f"{namespace}:bulk:inflight")
    for queue in queues:
        for owner in owners:
            pipe.lrange(f"{namespace}:bulk:{queue}:owner:{owner}", 0, depth - 1)
    found: set[str] = set()
    for rows in pipe.execute():
        for row in rows:
            found.update(_JOB_ID.findall(_text(row)))
    return found


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class CachedAudit:
    """``audit_queue`` at most once per ``CACHE_S`` (the scrape and ``/readyz`` share it); None while Redis fails."""

    def __init__(self, client: redis.Redis, owners: Iterable[str], namespace: str = "auk") -> None:
        self.client = client
        self.owners = list(owners)
        self.namespace = namespace
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._last: QueueAudit | None = None

    def get(self) -> QueueAudit | None:
        with self._lock:
            if time.monotonic() - self._at >= CACHE_S:
                try:
                    self._last = audit_queue(self.client, self.owners, self.namespace)
                except redis.RedisError:
                    self._last = None
                self._at = time.monotonic()
            return self._last
