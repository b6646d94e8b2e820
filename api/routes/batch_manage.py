"""Managing batches: ``GET /v1/batches`` (the key's batches, newest first), ``POST /v1/batches/{id}/cancel`` and
``GET /v1/batches/{id}/link`` (a signed link to the batch's listening page, ``batch_page.py``).

Cancel stops what has not ended (``BatchBook.cancel``: queued jobs end ``canceled``, running ones at their next
step) and then stores the batch's results at once, since every job has ended: the manifest lists the canceled
lines, the error file holds them, and the batch's webhook goes out. Another key's batch answers 404 like one that
does not exist.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from api.auth import caller
from api.batch_views import batch_record
from api.deps import Services, services
from api.links import MAX_LINK_SECONDS, LinkSigner
from api.models import BatchCanceled, BatchLink, BatchPage
from api.openapi import V1_ERRORS, documented
from auk_worker.errors import Conflict, InputError, NotFound
from auk_worker.service.records.batches import write_results

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["batches"], responses=V1_ERRORS)


@router.get("/batches", summary="List the caller's batches, newest first, with their counts",
            **documented(BatchPage, 422))
def list_batches(
    owner: str = Depends(caller),
    svc: Services = Depends(services),
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: str | None = None,
) -> dict:
    try:
        batches, next_cursor = svc.batches.list(owner, limit=limit, cursor=cursor)
    except ValueError as exc:
        raise InputError(f"cursor: {exc}", code="invalid_request") from None
    return {"data": [batch_record(svc, batch) for batch in batches], "next_cursor": next_cursor}


@router.post("/batches/{batch_id}/cancel", summary="Cancel a batch: its queued and running jobs end canceled",
             **documented(BatchCanceled, 404, 409, 422))
def cancel_batch(batch_id: str, owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    batch = svc.batches.owned(batch_id, owner)
    if batch is None:
        raise NotFound(f"no batch {batch_id!r}")
    if batch["done"] and batch["manifest_key"]:
        raise Conflict(f"batch {batch_id!r} has ended ({batch['counts']['canceled']} canceled) and cannot be "
                       "canceled", code="already_finished")  # fmt: skip
    batch, canceled = svc.batches.cancel(batch_id, owner)
    if batch["done"] and batch["manifest_key"] is None:  # also a retry after storage refused the first time
        write_results(svc.store, svc.storage, svc.settings.s3_prefix, batch_id, notifier=svc.notifier)
        batch = svc.batches.get(batch_id)
    body = batch_record(svc, batch)
    body["canceled_now"] = canceled
    return body


@router.get("/batches/{batch_id}/link", summary="A signed link to the batch's listening page",
            **documented(BatchLink, 404, 422))
def batch_link(
    batch_id: str,
    request: Request,
    owner: str = Depends(caller),
    svc: Services = Depends(services),
    expires_in: Annotated[int | None, Query(ge=60, le=MAX_LINK_SECONDS)] = None,
) -> dict:
    if svc.batches.owned(batch_id, owner) is None:
        raise NotFound(f"no batch {batch_id!r}")
    signer: LinkSigner = request.app.state.links
    exp, sig = signer.sign(batch_id, expires_in)
    path = f"/batches/{batch_id}?exp={exp}&sig={sig}"
    return {"path": path, "url": str(request.base_url).rstrip("/") + path, "expires_at": exp}
