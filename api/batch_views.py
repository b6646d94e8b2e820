"""A batch as the API shows it (``GET /v1/batches/{id}``, the listing, cancel): ``batches.public_batch`` plus its
webhook's delivery state."""

from __future__ import annotations

from typing import Any

from api.deps import Services
from auk_worker.service.records.batches import public_batch


def batch_record(svc: Services, batch: dict[str, Any]) -> dict[str, Any]:
    body = public_batch(batch, svc.storage, svc.settings.presign_seconds)
    body["webhook"] = svc.notifier.view("batch", batch["id"], batch["webhook_url"])
    return body
