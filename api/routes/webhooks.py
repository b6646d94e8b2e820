"""``/v1/webhooks/secret``: the calling key's webhook signing secret (Standard Webhooks ``whsec_...``).

``GET`` returns it, creating it on first use; ``POST .../rotate`` makes a new one, and the previous one goes on
signing beside it (a second ``v1,`` signature in ``webhook-signature``) for a day, so a receiver can switch
without dropping a delivery.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api.auth import caller
from api.deps import Services, services
from api.responses import RotatedSecret, WebhookSecret
from api.openapi import V1_ERRORS, documented

router = APIRouter(prefix="/v1", tags=["webhooks"], responses=V1_ERRORS)


@router.get("/webhooks/secret", summary="The key's webhook signing secret (created on first use)",
            **documented(WebhookSecret))
def get_secret(owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    return {"secret": svc.webhook_secrets.get(owner)}


@router.post("/webhooks/secret/rotate", summary="A new signing secret; the previous one signs too for a day",
             **documented(RotatedSecret))
def rotate_secret(owner: str = Depends(caller), svc: Services = Depends(services)) -> dict:
    secret = svc.webhook_secrets.rotate(owner)
    return {"secret": secret, "previous_valid_for_s": int(svc.webhook_secrets.grace_s)}
