"""``GET /backlog``: the render tasks waiting for a worker, per variant and priority (``backlog.py``), for KEDA.

KEDA's ``metrics-api`` trigger reads one number from it (``valueLocation: base.bulk``) and scales a pool on it:
the Celery queue's list, the bulk fair share's per-key lists and its in-flight releases together. Unauthenticated,
like ``/metrics`` and ``/readyz``: counts only, nothing of any key's jobs.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from api.deps import Services, services
from api.responses import BacklogView
from api.openapi import documented
from auk_worker.service.queues.backlog import Backlog
from auk_worker.service.connect.settings import VARIANTS

router = APIRouter(tags=["operations"])


@router.get("/backlog", **documented(BacklogView, 503, description="Tasks waiting, per variant and priority."))
async def backlog(svc: Services = Depends(services)) -> dict:
    """Render tasks waiting for a worker, per variant: ``interactive``, ``bulk`` (the Celery queue and the tasks the
    fair share still holds per key) and ``recovery`` (jobs sent again after their worker died). A bulk task is a
    render group of up to ``max_num_seqs`` jobs."""
    return await run_in_threadpool(Backlog(svc.redis, VARIANTS).read)
