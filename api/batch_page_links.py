"""Short-lived signed links to a batch's listening page: ``/batches/{id}?exp=<unix s>&sig=<HMAC>``.

The signature is HMAC-SHA256 over ``"batch-page.{batch id}.{exp}"`` (base64url, unpadded) with the server's link
secret: ``AUK_LINK_SECRET``, or when unset a key derived from ``AUK_API_KEYS`` (every API replica holds the same
keys, so each verifies every other's links; changing the keys ends the links made before). A link opens that one
batch's page and audio until ``exp`` and nothing else, so it can be handed to a browser or a colleague without the
API key. Only the batch's owner can make one (``GET /v1/batches/{id}/link``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

from auk_worker.errors import Unauthorized
from auk_worker.service.connect.settings import Settings

MAX_LINK_SECONDS = 7 * 24 * 3600


class LinkSigner:
    def __init__(self, settings: Settings) -> None:
        if settings.link_secret:
            self._key = settings.link_secret.encode()
        else:
            keys = "\0".join(sorted(settings.api_keys)).encode()
            self._key = hmac.new(keys, b"auk batch page links", hashlib.sha256).digest()
        self.default_seconds = min(settings.link_seconds, MAX_LINK_SECONDS)

    def _sig(self, batch_id: str, exp: int) -> str:
        digest = hmac.new(self._key, f"batch-page.{batch_id}.{exp}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def sign(self, batch_id: str, seconds: int | None = None, now: float | None = None) -> tuple[int, str]:
        """``(exp, sig)`` for a link that works for ``seconds`` (default ``AUK_LINK_SECONDS``, at most 7 days)."""
        lifetime = min(seconds or self.default_seconds, MAX_LINK_SECONDS)
        exp = int((time.time() if now is None else now) + lifetime)
        return exp, self._sig(batch_id, exp)

    def verify(self, batch_id: str, exp: str | None, sig: str | None, now: float | None = None) -> None:
        """Unauthorized unless ``sig`` signs this batch until ``exp`` and ``exp`` has not passed."""
        if not exp or not sig:
            raise Unauthorized("this page needs a signed link: run `auk page BATCH_ID`, or GET /v1/batches/{id}/link")
        if not (exp.isascii() and exp.isdigit() and len(exp) <= 12):
            raise Unauthorized("the link's exp is not a time")
        if not hmac.compare_digest(sig.encode(), self._sig(batch_id, int(exp)).encode()):
            raise Unauthorized("the link's signature does not match this batch")
        if int(exp) < (time.time() if now is None else now):
            raise Unauthorized("the link has expired: make a new one with `auk page BATCH_ID`")
