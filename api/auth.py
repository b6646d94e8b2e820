"""Bearer API keys: who is calling, as an owner id.

Keys come from ``AUK_API_KEYS``. A caller is known by its owner id, the first 16 hex digits of the key's
SHA-256, which is what job and batch records store; raw keys are never written anywhere.
"""

from __future__ import annotations

import hmac

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from auk_worker.errors import Unauthorized
from auk_worker.service.records.jobs import owner_id


class KeyRing:
    """The accepted keys, compared in constant time."""

    def __init__(self, api_keys: tuple[str, ...]) -> None:
        self._keys = tuple(key.encode("utf-8") for key in api_keys)

    def owner_for(self, authorization: str | None) -> str:
        """Owner id for an ``Authorization: Bearer <key>`` header; 401 for a missing or unknown key."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("missing bearer token: send 'Authorization: Bearer <API key>'")
        candidate = token.encode("utf-8")
        matches = [hmac.compare_digest(candidate, key) for key in self._keys]  # every key compared, always
        if not any(matches):
            raise Unauthorized("the API key is not valid")
        return owner_id(token)


# The scheme as the OpenAPI document declares it on every route that depends on ``caller``. It never refuses by
# itself (``auto_error=False``): the request guard and ``KeyRing`` answer a missing or bad key with the API's 401.
bearer = HTTPBearer(scheme_name="bearer", bearerFormat="API key",
                    description="An API key from AUK_API_KEYS: `Authorization: Bearer <key>`.", auto_error=False)


def caller(request: Request, _: HTTPAuthorizationCredentials | None = Security(bearer)) -> str:
    """FastAPI dependency: the calling key's owner id (as the request guard found it, else from the header)."""
    owner = request.scope.get("state", {}).get("owner")
    if owner:
        return owner
    keyring: KeyRing = request.app.state.keyring
    return keyring.owner_for(request.headers.get("authorization"))
