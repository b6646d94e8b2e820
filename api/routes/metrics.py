"""``GET /metrics``: the API's Prometheus exposition (``auk_worker/service/worker/metrics.py`` lists the names)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

router = APIRouter(tags=["operations"])


@router.get("/metrics", summary="Prometheus metrics of this API process", response_class=Response,
            responses={200: {"description": "The Prometheus text exposition.",
                             "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    """Request counts and latencies of this process; queue depths, job counts and workers read from Redis."""
    body = await run_in_threadpool(generate_latest, request.app.state.metrics.registry)  # the Redis reads block
    return Response(body, media_type=CONTENT_TYPE_LATEST)
