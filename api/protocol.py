"""uvicorn's h11 protocol with a deadline on the request head.

uvicorn times out an idle keep-alive connection, but not one that opens and sends nothing, nor a request head that
arrives a byte at a time: such connections stay open for good. This protocol closes a connection whose request
line and headers are not complete ``head_timeout_s`` after the connection opened or the head's first byte came
(after a response, uvicorn's keep-alive timer covers the wait for the next request's first byte). Bodies are the
request guard's (``api/guard.py``).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimeoutH11Protocol(H11Protocol):
    head_timeout_s = 15.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()  # part of a head: it must be complete in time
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request head took over %g s", self.head_timeout_s)
            self.transport.close()


def with_head_timeout(seconds: float) -> type[HeadTimeoutH11Protocol]:
    """The protocol class for ``uvicorn.run(http=...)`` with its head deadline set."""
    return type("HeadTimeoutH11Protocol", (HeadTimeoutH11Protocol,), {"head_timeout_s": seconds})
