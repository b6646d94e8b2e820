"""The REST API: an app factory over one ``Settings``.

``create_app(settings)`` builds the FastAPI app over its clients (``api/deps.py``), its error mapping
(``api/errors.py``), its routes (``api/routes/``), their OpenAPI document (``api/openapi.py``, ``api/responses.py``)
and, in front of them, the request guard (``api/guard.py``: the key, the per-key quotas and the body limits,
checked before any body is read). Nothing connects at import time; ``make_app()`` reads the environment and is
what ``uvicorn --factory api.app:make_app`` (and ``python -m api``) serves; the module attribute ``app`` is the
same, built on first access.

The API never imports torch: it validates, writes the job record, sends ``auk.render`` by name and reads status.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from api.auth import KeyRing
from api.deps import build_services, start_dispatcher
from api.errors import install_error_handlers
from api.guard import JSON_BODY_LIMIT, KeySlots, RequestGuard
from api.batch_page_links import LinkSigner
from api.openapi import install_openapi, operation_id
from api.routes import (audio, backlog, batch_page, batches, health, jobs, metrics, speech, uploads,
                        voices, webhooks)
from auk_worker.errors import InfraError
from auk_worker.service.queues.fairshare import Feeder
from api.quotas import RateLimiter
from auk_worker.service.ops import resend, retention
from auk_worker.service.ops.resend import Resender
from api.metrics import ApiMetrics, RequestMetricsMiddleware
from auk_worker.service.connect.redis import async_redis_client
from auk_worker.service.connect.settings import Settings

log = logging.getLogger(__name__)

RATE_TIMEOUT_S = 1.0  # a rate check waits this long for Redis, then lets the request through


def create_app(settings: Settings) -> FastAPI:
    """The API over ``settings``; refuses to build without API keys or storage settings."""
    settings.require_api_keys()
    settings.require_storage()
    built = build_services(settings)
    # a short timeout: a rate check is not worth a long wait
    rate_client = async_redis_client(settings, socket_timeout=RATE_TIMEOUT_S, socket_connect_timeout=RATE_TIMEOUT_S)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            built.storage.ensure_buckets()
        except InfraError as exc:  # the API still starts; /readyz reports storage until it answers
            log.warning("storage: buckets not checked at start-up: %s", exc)
        dispatcher = start_dispatcher(built)
        feeder = Feeder(built.fair, built.send).start()  # bulk tasks move while any API or worker is up
        _, stop_sweeper = retention.start_background(settings, built.store, built.storage)
        stop_resender = resend.start_background(Resender(built.store, built.audit.owners, built.send))
        try:
            yield
        finally:
            stop_resender.set()
            stop_sweeper.set()
            feeder.stop()
            if dispatcher is not None:
                dispatcher.close()
            built.redis.close()
            await built.replies.close()
            await rate_client.aclose()

    app = FastAPI(
        title="AuK render service",
        version="0.1.0",
        description="Enqueue AuK speech renders, follow their progress and fetch the audio; or render speech in one call.",
        lifespan=lifespan,
        generate_unique_id_function=operation_id,
    )
    app.state.services = built
    app.state.keyring = KeyRing(settings.api_keys)
    app.state.links = LinkSigner(settings)
    install_error_handlers(app)
    routers = (uploads, jobs, audio, batches, batch_page, webhooks, speech, voices, health, metrics,
               backlog)
    for routes in routers:
        app.include_router(routes.router)
    install_openapi(app)

    # (what, limit) of each route's body: the guard cuts a body there, whatever its headers say.
    limits = {"/v1/uploads": ("the upload", settings.max_upload_bytes),
              "/v1/batches": ("the batch", batches.MAX_BATCH_BYTES),
              "/v1/voices": ("the voice upload", settings.max_upload_bytes),
              # a reference clip inline as base64: 4/3 of the upload limit
              "/v1/audio/speech": ("the request body", JSON_BODY_LIMIT + settings.max_upload_bytes * 4 // 3)}  # fmt: skip

    rate = None
    if settings.quota_rate > 0:
        rate = RateLimiter(rate_client, settings.quota_rate, settings.quota_burst)
    app.add_middleware(
        RequestGuard,
        keyring=app.state.keyring,
        limit_for=lambda path: limits.get(path, ("the request body", JSON_BODY_LIMIT)),
        body_timeout_s=settings.body_timeout_s,
        body_min_rate=settings.body_min_rate,
        rate=rate,
        slots=KeySlots(settings.quota_in_flight, settings.quota_in_flight_queue) if settings.quota_in_flight else None,
    )
    app.state.metrics = ApiMetrics(built.redis, built.store.stats_key(), audit=built.audit)
    app.add_middleware(RequestMetricsMiddleware, metrics=app.state.metrics)  # outermost: a 413 is counted too
    return app


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
