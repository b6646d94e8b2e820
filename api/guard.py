"""The request guard: an ASGI middleware in front of every ``/v1/`` route, acting before any body is read.

In order, for each request:

1. The bearer key is checked from the headers alone: a request without a valid key is answered 401 and its body is
   never read (no spooled upload, no buffered JSON). The caller's owner id rides on in ``scope["state"]``.
2. The key's share of this process: at most ``AUK_QUOTA_IN_FLIGHT`` of its requests run at once, up to
   ``AUK_QUOTA_IN_FLIGHT_QUEUE`` more wait their turn (parked, unread, costing nothing), and beyond that it is
   429. So a key that sends sixty requests at once holds a few of the process's threads, not all of them, and
   another key's request starts at once. Then its request rate (``api/quotas.py``): 429 with
   ``Retry-After`` when spent.
3. A declared ``Content-Length`` over the route's limit is 413 at once.
4. Whatever the headers say (chunked, or a wrong length), ``receive`` counts the body's bytes and cuts it at the
   route's limit (413). A body is cut too (408) when its next piece does not arrive within
   ``AUK_API_BODY_TIMEOUT`` or, past that first allowance, it averages less than ``AUK_API_BODY_MIN_RATE``
   bytes per second (a byte every few seconds keeps no connection open for long). Both answers close the
   connection, leaving the rest unread. The body's clock starts when the request arrives, not when its turn
   comes: a slow body parked behind its key's other requests has used its allowance by then and is cut at once
   (what it had sent meanwhile, buffered by the server, still counts).

Refusals leave as the API's usual ``{"error": {...}}`` bodies (``api/errors.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import KeyRing
from api.errors import BodyRefused, error_response, too_large
from auk_worker.errors import AuKError, RequestTimeout, TooManyRequests, Unauthorized
from api.quotas import RateLimiter

log = logging.getLogger(__name__)

MULTIPART_OVERHEAD = 64 * 1024  # boundaries and part headers around an uploaded file
JSON_BODY_LIMIT = 1024 * 1024  # a job request is a few kilobytes
BUFFERED_S = 0.05  # past its deadline a body is still read if it is already there


class GuardedBody:
    """``receive`` for one request: counts body bytes against ``limit``; each piece must come within ``timeout_s``
    and by ``timeout_s + received / min_rate`` seconds after the first wait began. Once the body has ended it passes
    through (a streaming response listens on it for the disconnect)."""

    def __init__(self, receive: Receive, what: str, limit: int, timeout_s: float, min_rate: float,
                 arrived: float | None = None) -> None:  # fmt: skip
        self._receive = receive
        self.what = what
        self.limit = limit
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.received = 0
        self.ended = False
        self.started: float | None = arrived  # monotonic: when the request arrived (else the first read)

    async def __call__(self) -> Message:
        if self.ended:
            return await self._receive()
        now = time.monotonic()
        if self.started is None:
            self.started = now
        budget = self.started + self.timeout_s + self.received / self.min_rate - now
        try:
            # At least a moment: a body that waited out its allowance for a turn may have arrived meanwhile.
            message = await asyncio.wait_for(self._receive(), max(BUFFERED_S, min(self.timeout_s, budget)))
        except asyncio.TimeoutError:
            self.ended = True
            elapsed = time.monotonic() - self.started
            raise BodyRefused(RequestTimeout(
                f"the request body is arriving too slowly: {self.received} bytes in {elapsed:.1f} s (a body may "
                f"pause at most {self.timeout_s:g} s and must average {self.min_rate:g} bytes per second)"
            )) from None  # fmt: skip
        if message["type"] != "http.request":
            self.ended = True
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.limit:
            self.ended = True
            raise BodyRefused(too_large(self.what, self.limit - MULTIPART_OVERHEAD))
        if not message.get("more_body", False):
            self.ended = True
        return message


class KeySlots:
    """At most ``limit`` requests of one key in progress; up to ``queue`` more wait for a slot, first come first
    served; past that, ``TooManyRequests``. One event loop's state: a process serves its own share."""

    def __init__(self, limit: int, queue: int) -> None:
        self.limit = limit
        self.queue = queue
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._users: Counter[str] = Counter()  # requests holding or waiting for a slot, per key

    @asynccontextmanager
    async def hold(self, owner: str) -> AsyncIterator[None]:
        if self._users[owner] >= self.limit + self.queue:
            raise TooManyRequests(
                f"this API key already has {self._users[owner]} requests in progress or waiting; wait for some to "
                "finish", retry_after=1, code="too_many_concurrent_requests")  # fmt: skip
        slots = self._slots.setdefault(owner, asyncio.Semaphore(self.limit))
        self._users[owner] += 1
        try:
            async with slots:
                yield
        finally:
            self._users[owner] -= 1
            if self._users[owner] <= 0:
                del self._users[owner]
                self._slots.pop(owner, None)


class RequestGuard:
    """The middleware (see the module docstring). ``limit_for(path)`` gives ``(what, limit in bytes)``."""

    def __init__(
        self,
        app: ASGIApp,
        keyring: KeyRing,
        limit_for: Callable[[str], tuple[str, int]],
        body_timeout_s: float,
        body_min_rate: float,
        rate: RateLimiter | None,
        slots: KeySlots | None,
    ) -> None:
        self.app = app
        self.keyring = keyring
        self.limit_for = limit_for
        self.body_timeout_s = body_timeout_s
        self.body_min_rate = body_min_rate
        self.rate = rate
        self.slots = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        arrived = time.monotonic()  # the body's deadline runs from here, through any wait for the key's turn
        headers = Headers(scope=scope)
        try:
            owner = self.keyring.owner_for(headers.get("authorization"))
        except Unauthorized as exc:
            await self._refuse(exc, scope, receive, send)
            return
        if self.slots is None:
            await self._admit(owner, headers, scope, receive, send, arrived)
            return
        try:
            async with self.slots.hold(owner):
                await self._admit(owner, headers, scope, receive, send, arrived)
        except TooManyRequests as exc:  # raised before the slot is taken: nothing was sent yet
            await self._refuse(exc, scope, receive, send)

    async def _admit(self, owner: str, headers: Headers, scope: Scope, receive: Receive, send: Send,
                     arrived: float) -> None:  # fmt: skip
        if self.rate is not None:
            wait = await self.rate.take(owner)
            if wait > 0:
                message = (f"this API key is over its request rate ({self.rate.rate:g} per second, bursts of "
                           f"{self.rate.burst}); retry after the time in Retry-After")  # fmt: skip
                await self._refuse(TooManyRequests(message, retry_after=wait), scope, receive, send)
                return
        what, limit = self.limit_for(scope["path"])
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD:
            await self._refuse(too_large(what, limit), scope, receive, send)
            return
        scope.setdefault("state", {})["owner"] = owner
        body = GuardedBody(receive, what, limit + MULTIPART_OVERHEAD, self.body_timeout_s, self.body_min_rate,
                           arrived)  # fmt: skip
        await self.app(scope, body, send)

    @staticmethod
    async def _refuse(error: AuKError, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer ``error`` without reading the body, and close the connection (its body is left unread)."""
        response = error_response(error)
        response.headers["Connection"] = "close"
        await response(scope, receive, send)
