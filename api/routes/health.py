"""``/healthz`` (the process is alive) and ``/readyz`` (Redis and storage answer; which workers are serving)."""

from __future__ import annotations

import logging
from typing import Any

import redis
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from api.deps import Services, services
from api.responses import Alive, Readiness
from api.openapi import documented
from auk_worker.service.records.workers import SERVING_STATES, public_view, read_heartbeats

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])

@router.get("/healthz", **documented(Alive, description="The process is alive."))
def healthz() -> dict:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz", **documented(Readiness, description="Redis and storage answer.", more={
    503: {"model": Readiness, "description": "Redis or storage does not answer."}}))
def readyz(svc: Services = Depends(services)) -> JSONResponse:
    """Redis and storage answer; which workers hold a fresh heartbeat: id, state, variant, heartbeat age."""
    return readiness(svc)


def readiness(svc: Services) -> JSONResponse:
    """200 when Redis and storage answer (503 otherwise), with ``workers_ready`` and every worker's id, state,
    variant and heartbeat age (never a job id: this is unauthenticated)."""
    checks: dict[str, Any] = {}
    try:
        checks["redis"] = svc.store.ping()
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
    audit = svc.audit.get() if checks["redis"] else None  # counts and an age only: no job id
    body = {"status": "ready" if ok else "unavailable", **checks, "workers_ready": ready,
            "workers": [public_view(worker) for worker in workers],
            "queue": audit.as_dict() if audit is not None else None}  # fmt: skip
    return JSONResponse(body, status_code=200 if ok else 503)
