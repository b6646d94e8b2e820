"""The webhooks' two Redis stores.

- **WebhookSecrets**: one secret per owner (API key), created on first use, rotatable; the previous one keeps
  signing beside the new one for a grace period, so receivers can switch without losing a delivery.
- **WebhookStore**: a delivery is a Redis hash, written with its entry in a sorted set of due deliveries in one
  script (``records/scripts.py``), so a crash loses none. Times are Redis server time, so dispatchers on hosts with
  skewed clocks agree.

Keys (namespace ``auk``): ``auk:webhook:{id}`` (hash), ``auk:webhooks:due`` (zset: id by due time, or by lease expiry
while in flight), ``auk:webhook_secret:{owner}`` (hash: current, previous, previous_until).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import redis

from auk_worker.service.delivery.webhooks.signing import DELIVERY_ID, event_body, new_secret
from auk_worker.service.records import scripts


def _iso(epoch: str | float | None) -> str | None:
    if epoch in (None, ""):
        return None
    stamp = datetime.fromtimestamp(float(epoch), timezone.utc)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")



class WebhookSecrets:
    """One signing secret per owner. The client must use ``decode_responses=True``."""

    def __init__(self, redis_client: redis.Redis, namespace: str = "auk", grace_s: float = 24 * 3600) -> None:
        self.redis = redis_client
        self.ns = namespace
        self.grace_s = grace_s
        self._rotate = redis_client.register_script(scripts.WEBHOOK_ROTATE)

    def key(self, owner: str) -> str:
        return f"{self.ns}:webhook_secret:{owner}"

    def get(self, owner: str) -> str:
        """The owner's current secret, created on first use (two first uses agree on one)."""
        self.redis.hsetnx(self.key(owner), "current", new_secret())
        return self.redis.hget(self.key(owner), "current")

    def rotate(self, owner: str) -> str:
        """A new current secret; the previous one still signs for ``grace_s`` seconds."""
        return self._rotate(keys=[self.key(owner)], args=[new_secret(), time.time(), self.grace_s])

    def signing_secrets(self, owner: str) -> list[str]:
        """The secrets a delivery is signed with now: the current one, then the previous one during its grace."""
        raw = self.redis.hgetall(self.key(owner))
        current = raw.get("current") or self.get(owner)
        if raw.get("previous") and float(raw.get("previous_until") or 0) > time.time():
            return [current, raw["previous"]]
        return [current]


@dataclass(frozen=True)
class RetryPolicy:
    """When to try a failed delivery again: ``draw * min(cap_s, base_s * 2 ** (attempts - 1))`` seconds after the
    attempt, ``draw`` uniform in [0, 1) (full jitter); failed after ``max_attempts`` or once the next attempt would
    fall more than ``max_age_s`` after the delivery was enqueued."""

    base_s: float = 30.0
    cap_s: float = 6 * 3600.0
    max_attempts: int = 15
    max_age_s: float = 3 * 24 * 3600.0

    def delay(self, attempts: int, draw: float) -> float:
        return draw * min(self.cap_s, self.base_s * 2 ** (attempts - 1))


@dataclass(frozen=True)
class Delivery:
    """One delivery as stored: its event body (the exact bytes sent and signed) and its attempts so far."""

    id: str
    owner: str
    url: str
    event_type: str
    body: bytes
    state: str  # pending | delivered | failed
    attempts: int
    created_at: float  # Redis server time, epoch seconds
    last_attempt_at: float | None
    next_attempt_at: float | None
    last_status: int | None
    last_error: str | None
    delivered_at: float | None
    lease: str | None

    @classmethod
    def from_hash(cls, raw: Mapping[str, str]) -> Delivery:
        def number(name: str) -> float | None:
            return float(raw[name]) if raw.get(name) else None

        return cls(raw["id"], raw["owner"], raw["url"], raw["event_type"], raw["body"].encode(), raw["state"],
                   int(raw.get("attempts") or 0), float(raw["created_at"]), number("last_attempt_at"),
                   number("next_attempt_at"), int(raw["last_status"]) if raw.get("last_status") else None,
                   raw.get("last_error") or None, number("delivered_at"), raw.get("lease") or None)

    def public(self) -> dict[str, Any]:
        """The shape shown on a job or batch record."""
        return {"state": self.state, "attempts": self.attempts, "last_status": self.last_status,
                "last_error": self.last_error, "delivered_at": _iso(self.delivered_at),
                "next_attempt_at": _iso(self.next_attempt_at) if self.state == "pending" else None}


def delivery_id_for(kind: str, record_id: str) -> str:
    """A deterministic delivery id (``msg_job_<id>``), so enqueueing a record's event twice sends it once."""
    return f"msg_{kind}_{record_id}"


class WebhookStore:
    """Deliveries in Redis. The client must use ``decode_responses=True``."""

    def __init__(self, redis_client: redis.Redis, namespace: str = "auk", policy: RetryPolicy | None = None,
                 retain_s: int = 0) -> None:  # fmt: skip
        self.redis = redis_client
        self.ns = namespace
        self.policy = policy or RetryPolicy()
        self.retain_s = retain_s  # a delivered or failed delivery is kept this long (0: forever), as job records are
        self.due_key = f"{namespace}:webhooks:due"
        self._enqueue = redis_client.register_script(scripts.WEBHOOK_ENQUEUE)
        self._claim = redis_client.register_script(scripts.WEBHOOK_CLAIM)
        self._finish = redis_client.register_script(scripts.WEBHOOK_FINISH)

    def key(self, delivery_id: str) -> str:
        return f"{self.ns}:webhook:{delivery_id}"

    def enqueue(self, owner: str, url: str, event_type: str, data: Mapping[str, Any], *,
                delivery_id: str | None = None) -> str:
        """Persist a delivery of the event ``{"type": event_type, "timestamp": now, "data": data}`` to ``url``,
        due now. With a ``delivery_id`` that exists already, nothing changes (the first enqueue stands)."""
        delivery_id = delivery_id or f"msg_{uuid.uuid4().hex}"
        if not DELIVERY_ID.match(delivery_id):
            raise ValueError(f"a delivery id is 1-128 letters, digits, '_' or '-': {delivery_id!r}")
        body = event_body(event_type, data).decode()
        fields = {"id": delivery_id, "owner": owner, "url": url, "event_type": event_type, "body": body,
                  "state": "pending", "attempts": 0}
        self._enqueue(keys=[self.key(delivery_id), self.due_key],
                      args=[delivery_id, *[item for pair in fields.items() for item in pair]])
        return delivery_id

    def get(self, delivery_id: str) -> Delivery | None:
        raw = self.redis.hgetall(self.key(delivery_id))
        return Delivery.from_hash(raw) if raw else None

    def state(self, delivery_id: str) -> dict[str, Any] | None:
        """``{"state", "attempts", "last_status", "last_error", "delivered_at", "next_attempt_at"}`` or None."""
        delivery = self.get(delivery_id)
        return delivery.public() if delivery else None

    def claim(self, lease_s: float) -> tuple[Delivery, str] | None:
        """Take the earliest due delivery for ``lease_s`` seconds: (the delivery, its lease token), or None."""
        token = uuid.uuid4().hex
        flat = self._claim(keys=[self.due_key], args=[f"{self.ns}:webhook:", lease_s, token])
        return (Delivery.from_hash(dict(zip(flat[::2], flat[1::2]))), token) if flat else None

    def finish(self, delivery: Delivery, token: str, outcome: str, *, delay_s: float = 0.0,
               status: int | None = None, error: str | None = None) -> bool:
        """Record an attempt's outcome (``delivered``, ``failed`` or ``retry`` after ``delay_s``); False when the
        lease was lost (it ran out and another dispatcher holds the delivery now)."""
        if outcome not in ("delivered", "failed", "retry"):
            raise ValueError(f"unknown outcome {outcome!r}")
        written = bool(self._finish(keys=[self.key(delivery.id), self.due_key],
                                    args=[delivery.id, token, outcome, delay_s, "" if status is None else status,
                                          error or ""]))  # fmt: skip
        if written and outcome != "retry" and self.retain_s:
            self.redis.expire(self.key(delivery.id), self.retain_s)
        return written

    def seconds_until_due(self) -> float | None:
        """Seconds until the earliest delivery falls due (0 if one is due now), None if there is none."""
        first = self.redis.zrange(self.due_key, 0, 0, withscores=True)
        if not first:
            return None
        seconds, micros = self.redis.time()
        return max(0.0, first[0][1] - (seconds + micros / 1e6))
