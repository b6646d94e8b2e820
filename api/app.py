"""The REST API: an app factory over one ``Settings``.

``create_app(settings)`` builds the FastAPI app with its clients (Redis job store, S3 storage, the Celery app
used only to send tasks by name). Nothing connects at import time; ``make_app()`` reads the environment and is
what ``uvicorn --factory api.app:make_app`` (and ``python -m api``) serves; the module attribute ``app`` is the
same, built on first access.

The API never imports torch: it validates, writes the job record, sends ``auk.render`` by name and reads status.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from api.auth import KeyRing
from api.errors import error_response, install_error_handlers, too_large
from auk_worker.errors import InfraError
from auk_worker.service.celery_app import make_celery
from auk_worker.service.health import read_heartbeats
from auk_worker.service.jobs import JobStore
from auk_worker.service.settings import Settings
from auk_worker.service.storage import Storage

log = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 5.0
MULTIPART_OVERHEAD = 64 * 1024  # boundaries and part headers around an uploaded file
JSON_BODY_LIMIT = 1024 * 1024  # a job request is a few kilobytes
SERVING_STATES = ("ready", "busy")  # a worker with its pipeline loaded: idle, or rendering and taking the next job


@dataclass(frozen=True)
class Services:
    """The API's clients, built once per app."""

    settings: Settings
    redis: redis.Redis
    store: JobStore
    storage: Storage
    celery: Celery


def services(request: Request) -> Services:
    """FastAPI dependency: the app's clients."""
    return request.app.state.services


def build_services(settings: Settings) -> Services:
    client = redis.Redis.from_url(
        settings.redis_url, decode_responses=True,
        socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
    )
    return Services(
        settings=settings,
        redis=client,
        store=JobStore(client),
        storage=Storage(settings),
        celery=make_celery(settings),
    )


def create_app(settings: Settings) -> FastAPI:
    """The API over ``settings``; refuses to build without API keys or storage settings."""
    settings.require_api_keys()
    settings.require_storage()
    built = build_services(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            built.storage.ensure_buckets()
        except InfraError as exc:  # the API still starts; /readyz reports storage until it answers
            log.warning("storage: buckets not checked at start-up: %s", exc)
        yield
        built.redis.close()

    app = FastAPI(
        title="AuK render service",
        version="0.1.0",
        description="Enqueue AuK speech renders, follow their progress and fetch the WAVs.",
        lifespan=lifespan,
    )
    app.state.services = built
    app.state.keyring = KeyRing(settings.api_keys)
    install_error_handlers(app)

    from api.routes_batches import MAX_BATCH_BYTES
    from api.routes_batches import router as batches_router
    from api.routes_jobs import router as jobs_router
    from api.routes_uploads import router as uploads_router

    app.include_router(uploads_router)
    app.include_router(jobs_router)
    app.include_router(batches_router)

    # (what, limit): the upload and the batch are checked again while read; this refuses early on the header.
    limits = {"/v1/uploads": ("the upload", settings.max_upload_bytes),
              "/v1/batches": ("the batch", MAX_BATCH_BYTES)}  # fmt: skip

    @app.middleware("http")
    async def refuse_oversized_bodies(request: Request, call_next):
        """Refuse a declared body over its route's limit before it is read or spooled (413 naming the limit)."""
        path = request.url.path
        if not path.startswith("/v1/"):
            return await call_next(request)
        what, limit = limits.get(path, ("the request body", JSON_BODY_LIMIT))
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD:
            return error_response(too_large(what, limit))
        return await call_next(request)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    def readyz() -> JSONResponse:
        """Redis and storage answer; which workers hold a fresh heartbeat and in what state."""
        return readiness(built)

    return app


def readiness(svc: Services) -> JSONResponse:
    """200 when Redis and storage answer (503 otherwise), with ``workers_ready`` and every worker's heartbeat."""
    checks: dict[str, Any] = {}
    try:
        checks["redis"] = bool(svc.redis.ping())
    except redis.RedisError as exc:
        log.warning("readyz: redis: %s", exc)
        checks["redis"] = False
    checks["storage"] = svc.storage.ping()
    workers: list[dict] = []
    if checks["redis"]:
        try:
            workers = read_heartbeats(svc.redis)
        except redis.RedisError as exc:
            log.warning("readyz: heartbeats: %s", exc)
    ready = sum(1 for worker in workers if worker.get("state") in SERVING_STATES)
    ok = checks["redis"] and checks["storage"]
    body = {"status": "ready" if ok else "unavailable", **checks, "workers_ready": ready, "workers": workers}
    return JSONResponse(body, status_code=200 if ok else 503)


def make_app() -> FastAPI:
    """The app from the environment (uvicorn ``--factory`` target)."""
    return create_app(Settings.from_env())


_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    """``api.app:app`` for servers that want an instance: built from the environment on first access."""
    global _app
    if name == "app":
        if _app is None:
            _app = make_app()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
