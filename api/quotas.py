"""Per-key quotas: request rate (a token bucket in Redis, shared by every API process) and queued jobs.

- Rate: each key has a bucket of ``AUK_QUOTA_BURST`` tokens refilled at ``AUK_QUOTA_RATE`` per second; a request
  takes one, and with none left it is refused (429 ``rate_limited``) with the seconds until the next token as
  ``Retry-After``. The bucket lives in ``auk:rate:{owner}`` (a hash that expires once full again), updated by one
  script against Redis's own clock, so API processes on several hosts share it. When Redis does not answer the
  request is let through: the route then answers 503 itself, and a rate check is no reason to refuse service.
- Queued jobs: a key's jobs that are ``queued`` or ``running`` (the status indexes' sizes, O(1)) plus the ones a
  submission adds must stay within ``AUK_QUOTA_QUEUED_JOBS``; else 429 ``too_many_queued_jobs``, nothing written.
  Two submissions of one key at the same instant may both pass the check: the limit is exact only per request.

Either quota is off at 0.
"""

from __future__ import annotations

import logging

import redis
import redis.asyncio as aioredis

from auk_worker.errors import TooManyRequests
from auk_worker.service.records import scripts
from auk_worker.service.records.jobs import JobStatus
from auk_worker.service.records.store import JobStore

log = logging.getLogger(__name__)

QUEUED_RETRY_AFTER_S = 30  # a key over its queued-jobs quota waits for some of them to finish


class RateLimiter:
    """The per-key request rate, over an asyncio Redis client (the API's event loop never blocks on it)."""

    def __init__(self, client: aioredis.Redis, rate: float, burst: int, namespace: str = "auk") -> None:
        self.client = client
        self.rate = rate
        self.burst = burst
        self.ns = namespace
        self._take = client.register_script(scripts.RATE_TAKE)

    async def take(self, owner: str) -> float:
        """Take one request from ``owner``'s bucket: 0 when admitted, else the seconds until it may try again."""
        try:
            wait = await self._take(keys=[f"{self.ns}:rate:{owner}"], args=[self.rate, self.burst])
        except redis.RedisError as exc:
            log.warning("rate limit for %s not checked (Redis: %s); request admitted", owner, exc)
            return 0.0
        return float(wait)


def check_queued_jobs(store: JobStore, owner: str, adding: int, limit: int) -> None:
    """Refuse (429 ``too_many_queued_jobs``) a submission that would take ``owner`` past ``limit`` unfinished
    jobs; ``limit`` 0 is no limit."""
    if not limit:
        return
    active = store.count(owner, (JobStatus.QUEUED, JobStatus.RUNNING))
    if active + adding > limit:
        raise TooManyRequests(
            f"this API key has {active} jobs queued or running and may have at most {limit}; this request adds "
            f"{adding}. Wait for some to finish", retry_after=QUEUED_RETRY_AFTER_S, code="too_many_queued_jobs",
        )  # fmt: skip
