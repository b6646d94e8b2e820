"""``JobStore``: the job and batch records in Redis, their read side (``jobs.py``), listings (``listing.py``) and
transitions (``transitions.py``) in one object, as the API and the worker use them."""

from __future__ import annotations

from auk_worker.service.connect.redis import redis_client
from auk_worker.service.connect.settings import Settings
from auk_worker.service.records.listing import JobListing
from auk_worker.service.records.transitions import JobTransitions


class JobStore(JobTransitions, JobListing):
    """Job and batch records in Redis. The client must use ``decode_responses=True``.

    ``retain_s``: how long a finished job's record and idempotency key (and an ended batch) stay; 0 keeps them.
    """

    @classmethod
    def from_settings(cls, settings: Settings, namespace: str = "auk") -> JobStore:
        return cls(redis_client(settings, socket_connect_timeout=2, socket_timeout=5), namespace)
