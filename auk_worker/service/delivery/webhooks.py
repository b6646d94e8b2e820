"""Webhooks in the Standard Webhooks scheme: signing, per-owner secrets, durable deliveries, and their dispatcher.

Longer than 400 lines: the signature scheme, the two Redis stores and the dispatcher that joins them are one
feature, read top to bottom in the order a delivery meets them.

- **Signing** (standard-webhooks/standard-webhooks ``spec/standard-webhooks.md``): a secret is ``whsec_`` + base64
  of random bytes; a request carries ``webhook-id`` (the delivery's id, the same on every retry),
  ``webhook-timestamp`` (integer seconds of this attempt) and ``webhook-signature``: ``v1,<base64 HMAC-SHA256 of
  "{id}.{timestamp}.{body}">``, space-separated when signed with several secrets (a rotation's grace period).
  ``verify`` is the receiver's side, with a timestamp tolerance against replays.
- **WebhookSecrets**: one secret per owner (API key), created on first use, rotatable; the previous one keeps
  signing beside the new one for a grace period, so receivers can switch without losing a delivery.
- **WebhookStore**: a delivery is a Redis hash, written with its entry in a sorted set of due deliveries in one
  script, so a crash loses none. Times are Redis server time, so dispatchers on hosts with skewed clocks agree.
- **WebhookDispatcher**: threads that claim one due delivery at a time (a Lua script: it moves the delivery's due
  time forward by a lease and counts the attempt, so no other dispatcher sends that attempt while the lease runs),
  re-check the URL with the guard (DNS may have changed since the job was submitted), POST the stored body to the
  checked address, and record the outcome; only the lease holder's outcome is written. A non-2xx answer, a timeout
  or a connection error is retried after ``draw * min(cap, base * 2 ** (attempts - 1))`` seconds (exponential
  backoff with full jitter, ``draw`` uniform in [0, 1)), or later if the receiver sent ``Retry-After``, until
  ``max_attempts`` or ``max_age_s``; then the delivery is ``failed``. ``410 Gone`` and a URL the guard now refuses
  fail it at once. Delivery is at least once: a request that outlives its lease may overlap a retry, which is why
  receivers deduplicate by ``webhook-id``, as the spec says.

Keys (namespace ``auk``): ``auk:webhook:{id}`` (hash), ``auk:webhooks:due`` (zset: id by due time, or by lease expiry
while in flight), ``auk:webhook_secret:{owner}`` (hash: current, previous, previous_until).

Run standalone with ``python -m auk_worker.service.delivery.webhooks``; inside another process, ``WebhookDispatcher.start()``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import hmac
import json
import logging
import random
import re
import secrets as random_source
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import redis

from auk_worker.errors import InputError
from auk_worker.urlguard import UrlGuard, UrlPolicy, UrlUnresolvable, pinned_request

log = logging.getLogger(__name__)

EVENT_TYPES = ("job.succeeded", "job.failed", "job.canceled", "batch.completed")
SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # the spec asks for 24 to 64 random bytes
DEFAULT_TOLERANCE_S = 300
_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # no "." (the signed content is "{id}.{timestamp}.{body}")


# -- signing --------------------------------------------------------------------------------------------------------


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


def _iso(epoch: str | float | None) -> str | None:
    if epoch in (None, ""):
        return None
    stamp = datetime.fromtimestamp(float(epoch), timezone.utc)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- per-owner secrets ----------------------------------------------------------------------------------------------

# KEYS: secret hash. ARGV: new secret, now, grace seconds. The old current secret keeps signing until now + grace.
_ROTATE = """
local old = redis.call('HGET', KEYS[1], 'current')
if old then redis.call('HSET', KEYS[1], 'previous', old, 'previous_until', tonumber(ARGV[2]) + tonumber(ARGV[3])) end
redis.call('HSET', KEYS[1], 'current', ARGV[1])
return ARGV[1]
"""


class WebhookSecrets:
    """One signing secret per owner. The client must use ``decode_responses=True``."""

    def __init__(self, redis_client: redis.Redis, namespace: str = "auk", grace_s: float = 24 * 3600) -> None:
        self.redis = redis_client
        self.ns = namespace
        self.grace_s = grace_s
        self._rotate = redis_client.register_script(_ROTATE)

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


# -- deliveries -----------------------------------------------------------------------------------------------------

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n"

# KEYS: delivery hash, due zset. ARGV: id, then field/value pairs. Returns 0 when the id exists already.
_ENQUEUE = _NOW + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local fields = {}
for i = 2, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], 'created_at', now, 'next_attempt_at', now, unpack(fields))
redis.call('ZADD', KEYS[2], now, ARGV[1])
return 1
"""

# KEYS: due zset. ARGV: hash key prefix, lease seconds, lease token. Claims the earliest due delivery: its due time
# moves to the lease's end, its attempt is counted. Returns {} or the delivery's fields.
_CLAIM = _NOW + """
while true do
  local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1)
  if #due == 0 then return {} end
  local key = ARGV[1] .. due[1]
  if redis.call('HGET', key, 'state') == 'pending' then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), due[1])
    redis.call('HINCRBY', key, 'attempts', 1)
    redis.call('HSET', key, 'lease', ARGV[3], 'last_attempt_at', now)
    return redis.call('HGETALL', key)
  end
  redis.call('ZREM', KEYS[1], due[1])
end
"""

# KEYS: delivery hash, due zset. ARGV: id, lease token, outcome (delivered|failed|retry), delay, status, error.
# Only the lease holder writes; returns 0 to anyone else.
_FINISH = _NOW + """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'lease', '', 'last_status', ARGV[5], 'last_error', ARGV[6])
if ARGV[3] == 'retry' then
  local at = now + tonumber(ARGV[4])
  redis.call('HSET', KEYS[1], 'next_attempt_at', at)
  redis.call('ZADD', KEYS[2], at, ARGV[1])
else
  redis.call('HSET', KEYS[1], 'state', ARGV[3], 'next_attempt_at', '', ARGV[3] .. '_at', now)
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return 1
"""


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
        self._enqueue = redis_client.register_script(_ENQUEUE)
        self._claim = redis_client.register_script(_CLAIM)
        self._finish = redis_client.register_script(_FINISH)

    def key(self, delivery_id: str) -> str:
        return f"{self.ns}:webhook:{delivery_id}"

    def enqueue(self, owner: str, url: str, event_type: str, data: Mapping[str, Any], *,
                delivery_id: str | None = None) -> str:
        """Persist a delivery of the event ``{"type": event_type, "timestamp": now, "data": data}`` to ``url``,
        due now. With a ``delivery_id`` that exists already, nothing changes (the first enqueue stands)."""
        delivery_id = delivery_id or f"msg_{uuid.uuid4().hex}"
        if not _ID.match(delivery_id):
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


# -- the dispatcher -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """What one POST came to: a status (None without an answer), an error sentence, whether to stop retrying and
    the receiver's ``Retry-After`` in seconds."""

    status: int | None
    error: str | None = None
    final: bool = False
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class WebhookDispatcher:
    """Sends due deliveries from ``threads`` threads; ``jitter`` draws the full-jitter factor (tests pin it)."""

    def __init__(self, store: WebhookStore, secrets: WebhookSecrets, guard: UrlGuard, *, timeout_s: float = 10.0,
                 threads: int = 2, idle_s: float = 1.0, jitter: Callable[[], float] = random.random,
                 client: httpx.Client | None = None) -> None:
        self.store = store
        self.secrets = secrets
        self.guard = guard
        self.timeout_s = timeout_s
        # The lease outlasts a request's connect, write, read and pool timeouts (each up to timeout_s) and DNS.
        self.lease_s = 4 * timeout_s + 5
        self.threads = threads
        self.idle_s = idle_s
        self.jitter = jitter
        # No proxy from the environment (the guard decides where a webhook goes) and no pooled connections (a
        # pooled TLS connection to an address was verified for the host that opened it, not the next one).
        self.client = client or httpx.Client(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0),
                                             headers={"User-Agent": "auk-webhooks/1"})
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []

    def run_once(self) -> bool:
        """Claim one due delivery and attempt it; False when none was due."""
        claimed = self.store.claim(self.lease_s)
        if claimed is None:
            return False
        delivery, token = claimed
        attempt = self._post(delivery)
        policy = self.store.policy
        delay = policy.delay(delivery.attempts, self.jitter())
        if attempt.retry_after_s is not None:
            delay = max(delay, min(attempt.retry_after_s, policy.cap_s))
        age = (delivery.last_attempt_at or delivery.created_at) - delivery.created_at
        if attempt.ok:
            outcome = "delivered"
        elif attempt.final or delivery.attempts >= policy.max_attempts or age + delay > policy.max_age_s:
            outcome = "failed"
        else:
            outcome = "retry"
        if not self.store.finish(delivery, token, outcome, delay_s=delay, status=attempt.status, error=attempt.error):
            log.warning("webhook %s: lease lost during attempt %d; its outcome is not recorded", delivery.id,
                        delivery.attempts)
        else:
            log.info("webhook %s: attempt %d to %s: %s (%s)", delivery.id, delivery.attempts, delivery.url,
                     outcome, attempt.status or attempt.error)
        return True

    def _post(self, delivery: Delivery) -> Attempt:
        try:
            checked = self.guard.check(delivery.url)
        except UrlUnresolvable as exc:
            return Attempt(None, exc.message)
        except InputError as exc:  # refused now (the address may have changed since submission) or malformed
            return Attempt(None, f"{exc.code}: {exc.message}", final=True)
        timestamp = int(time.time())
        headers = {"Content-Type": "application/json",
                   **signed_headers(self.secrets.signing_secrets(delivery.owner), delivery.id, timestamp,
                                    delivery.body)}
        try:
            response = pinned_request(self.client, "POST", checked, headers=headers, content=delivery.body,
                                      timeout=self.timeout_s, stream=True)
            try:
                status = response.status_code
                if 200 <= status < 300:
                    return Attempt(status)
                snippet = _first_bytes(response, 200)
                retry_after = _retry_after(response.headers.get("Retry-After"))
            finally:
                response.close()
        except httpx.TimeoutException:
            return Attempt(None, f"no answer within {self.timeout_s:g} s")
        except httpx.HTTPError as exc:
            return Attempt(None, f"{type(exc).__name__}: {exc}")
        words = f"receiver answered {status}" + (f": {snippet}" if snippet else "")
        return Attempt(status, words, final=status == 410, retry_after_s=retry_after)

    # -- threads ----------------------------------------------------------------------------------------------------
    def start(self) -> WebhookDispatcher:
        self._stop.clear()
        for index in range(self.threads):
            worker = threading.Thread(target=self._loop, name=f"webhooks-{index}", daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop claiming; an attempt in flight finishes (at most its timeout) before its thread ends."""
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout)
        self._workers.clear()

    def close(self) -> None:
        self.stop()
        self.client.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self.run_once():
                    continue
                wait = self.store.seconds_until_due()
            except redis.RedisError as exc:  # Redis down: try again later, never end the thread
                log.warning("webhooks: Redis unavailable (%s); retrying in %.1f s", exc, self.idle_s)
                wait = self.idle_s
            except Exception:  # the thread's boundary: a delivery left claimed is retried when its lease ends
                log.exception("webhooks: attempt failed unexpectedly")
                wait = self.idle_s
            self._stop.wait(self.idle_s if wait is None else min(max(wait, 0.01), self.idle_s))


def _first_bytes(response: httpx.Response, limit: int) -> str:
    data = b""
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) >= limit:
            break
    return data[:limit].decode("utf-8", "replace").strip()


def main(argv: Sequence[str] | None = None) -> int:
    """Run a dispatcher until SIGINT or SIGTERM; defaults from the ``AUK_*`` settings (``AUK_WEBHOOK_*``)."""
    from auk_worker.service.connect.redis import redis_client
    from auk_worker.service.connect.settings import Settings

    settings = Settings.from_env()
    parser = argparse.ArgumentParser(prog="python -m auk_worker.service.delivery.webhooks", description=main.__doc__)
    parser.add_argument("--redis-url", default=settings.redis_url, help="default: AUK_REDIS_URL")
    parser.add_argument("--allow", default=settings.webhook_allow,
                        help="hosts and networks called although not public (comma list; default: AUK_WEBHOOK_ALLOW)")
    parser.add_argument("--threads", type=int, default=max(1, settings.webhook_threads))
    parser.add_argument("--timeout", type=float, default=settings.webhook_timeout_s, help="seconds per request")
    parser.add_argument("--idle", type=float, default=1.0, help="longest sleep between looks for due deliveries")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = args.redis_url
    client = redis_client(replace(settings, redis_url=url), socket_connect_timeout=2, socket_timeout=5)
    policy = RetryPolicy(base_s=settings.webhook_retry_base_s, cap_s=settings.webhook_retry_cap_s,
                         max_attempts=settings.webhook_max_attempts)
    deliveries = WebhookStore(client, policy=policy, retain_s=settings.retain_records_s)
    dispatcher = WebhookDispatcher(deliveries, WebhookSecrets(client),
                                   UrlGuard(UrlPolicy.parse(args.allow)), timeout_s=args.timeout,
                                   threads=args.threads, idle_s=args.idle)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    dispatcher.start()
    log.info("webhooks: dispatching from %s with %d threads", url.split("@")[-1], args.threads)
    stopped.wait()
    dispatcher.close()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
