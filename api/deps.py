"""The API's clients, built once per app, and the FastAPI dependency that hands them to a route.

Routes reach Redis only through the stores (``JobStore``, ``UploadStore``); the client itself is here for the
readiness check's heartbeats and to be closed when the app stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from celery import Celery
from fastapi import Request

from auk_worker.service.celery_app import make_celery
from auk_worker.service.jobs import JobStore
from auk_worker.service.settings import Settings
from auk_worker.service.storage import Storage
from auk_worker.service.uploads import UploadStore

REDIS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Services:
    """The API's clients, built once per app."""

    settings: Settings
    redis: redis.Redis
    store: JobStore
    uploads: UploadStore
    storage: Storage
    celery: Celery


def build_services(settings: Settings) -> Services:
    """Every client over ``settings``; nothing connects until it is first used."""
    client = redis.Redis.from_url(
        settings.redis_url, decode_responses=True,
        socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
    )  # fmt: skip
    return Services(
        settings=settings,
        redis=client,
        store=JobStore(client),
        uploads=UploadStore(client),
        storage=Storage(settings),
        celery=make_celery(settings),
    )


def services(request: Request) -> Services:
    """FastAPI dependency: the app's clients."""
    return request.app.state.services
