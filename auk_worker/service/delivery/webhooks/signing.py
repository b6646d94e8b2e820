"""Standard Webhooks signing (standard-webhooks/standard-webhooks ``spec/standard-webhooks.md``): a secret is
``whsec_`` + base64 of random bytes; a request carries ``webhook-id`` (the delivery's id, the same on every retry),
``webhook-timestamp`` (integer seconds of this attempt) and ``webhook-signature``: ``v1,<base64 HMAC-SHA256 of
"{id}.{timestamp}.{body}">``, space-separated when signed with several secrets (a rotation's grace period).
``verify`` is the receiver's side, with a timestamp tolerance against replays. No Redis, no HTTP: a receiver can
import this alone.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets as random_source
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from auk_worker.errors import InputError

EVENT_TYPES = ("job.succeeded", "job.failed", "job.canceled", "batch.completed")
SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # the spec asks for 24 to 64 random bytes
DEFAULT_TOLERANCE_S = 300
DELIVERY_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # no "." (the signed content is "{id}.{timestamp}.{body}")


class WebhookVerificationError(InputError):
    """A webhook request whose headers are missing, too old or too new, or whose signature does not match."""

    code = "invalid_webhook_signature"


def new_secret(nbytes: int = SECRET_BYTES) -> str:
    if not 24 <= nbytes <= 64:
        raise ValueError(f"a webhook secret has 24 to 64 random bytes, not {nbytes}")
    return SECRET_PREFIX + base64.b64encode(random_source.token_bytes(nbytes)).decode()


def _key(secret: str) -> bytes:
    raw = secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX) else secret
    try:
        key = base64.b64decode(raw, validate=True)
    except binascii.Error:
        raise ValueError("a webhook secret is 'whsec_' followed by base64") from None
    if not key:
        raise ValueError("a webhook secret must not be empty")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256 of "{msg_id}.{timestamp}.{body}">``."""
    digest = hmac.new(_key(secret), f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(secrets: Sequence[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers, signed with every secret given (current first)."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(secret, msg_id, timestamp, body) for secret in secrets),
    }


def verify(secret: str, headers: Mapping[str, str], body: bytes | str, *, tolerance_s: float = DEFAULT_TOLERANCE_S,
           now: float | None = None) -> None:
    """Check a received webhook; ``WebhookVerificationError`` says why it is refused. ``body`` is the raw request
    body, exactly as received: a JSON body parsed and serialised again no longer matches its signature."""
    lower = {name.lower(): value for name, value in headers.items()}
    msg_id, stamp, signatures = (lower.get(n) for n in ("webhook-id", "webhook-timestamp", "webhook-signature"))
    if not (msg_id and stamp and signatures):
        raise WebhookVerificationError("missing webhook-id, webhook-timestamp or webhook-signature header")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookVerificationError(f"webhook-timestamp is not integer seconds: {stamp!r}") from None
    offset = timestamp - (time.time() if now is None else now)
    if abs(offset) > tolerance_s:
        raise WebhookVerificationError(f"webhook-timestamp is {abs(offset):.0f} s too {'new' if offset > 0 else 'old'}")
    expected = sign(secret, msg_id, timestamp, body.encode() if isinstance(body, str) else body)
    for candidate in signatures.split(" "):
        if candidate.startswith("v1,") and hmac.compare_digest(candidate.encode(), expected.encode()):
            return
    raise WebhookVerificationError("no webhook-signature matches the body")


def event_body(event_type: str, data: Mapping[str, Any], occurred_at: datetime | None = None) -> bytes:
    """The JSON event ``{"type", "timestamp", "data"}`` as the bytes that are sent and signed."""
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown webhook event type {event_type!r}; one of {', '.join(EVENT_TYPES)}")
    stamp = (occurred_at or datetime.now(timezone.utc)).astimezone(timezone.utc)
    event = {"type": event_type, "timestamp": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
             "data": dict(data)}
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
