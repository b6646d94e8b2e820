"""The webhook dispatcher: threads that claim one due delivery at a time (a Lua script: it moves the delivery's due
time forward by a lease and counts the attempt, so no other dispatcher sends that attempt while the lease runs),
re-check the URL with the guard (DNS may have changed since the job was submitted), POST the stored body to the
checked address, and record the outcome; only the lease holder's outcome is written. A non-2xx answer, a timeout
or a connection error is retried after ``draw * min(cap, base * 2 ** (attempts - 1))`` seconds (exponential
backoff with full jitter, ``draw`` uniform in [0, 1)), or later if the receiver sent ``Retry-After``, until
``max_attempts`` or ``max_age_s``; then the delivery is ``failed``. ``410 Gone`` and a URL the guard now refuses
fail it at once. Delivery is at least once: a request that outlives its lease may overlap a retry, which is why
receivers deduplicate by ``webhook-id``, as the spec says.

Run standalone with ``python -m auk_worker.service.delivery.webhooks`` (``main``); inside another process,
``WebhookDispatcher.start()``.
"""

from __future__ import annotations

import argparse
import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from email.utils import parsedate_to_datetime

import httpx
import redis

from auk_worker.errors import InputError
from auk_worker.service.delivery.webhooks.signing import signed_headers
from auk_worker.service.delivery.webhooks.store import Delivery, RetryPolicy, WebhookSecrets, WebhookStore
from auk_worker.urlguard import UrlGuard, UrlPolicy, UrlUnresolvable, pinned_request

log = logging.getLogger(__name__)


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
