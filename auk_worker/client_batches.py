"""``auk page`` and ``auk cancel``: a batch's listening-page link, and cancelling a job or a whole batch.

Plain HTTP (httpx) with the same ``AUK_API_URL`` and ``AUK_API_KEY`` as the other client commands:

    auk page BATCH_ID [--expires SECONDS]    # http://<api>/batches/<id>?exp=...&sig=... (opens without a key)
    auk cancel ID                            # a job, or every job of a batch that has not ended

``page_link`` is also what ``auk submit --batch`` prints after the batch is queued.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import httpx

DEFAULT_API_URL = "http://127.0.0.1:8000"


class CommandError(Exception):
    """An answer the user should read: the API's error message, or why it was not reached."""


def _connect() -> httpx.Client:
    api_key = os.environ.get("AUK_API_KEY", "").strip()
    if not api_key:
        raise CommandError("AUK_API_KEY is not set: export the API key the service gave you")
    base = os.environ.get("AUK_API_URL", DEFAULT_API_URL).rstrip("/")
    return httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {api_key}"})


def _call(http: httpx.Client, method: str, path: str, **kwargs: object) -> httpx.Response:
    try:
        response = http.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise CommandError(f"cannot reach the API at {http.base_url}: {exc}") from None
    if response.is_error and response.status_code != 404:
        try:
            error = response.json()["error"]
            raise CommandError(f"HTTP {response.status_code} {error['code']}: {error['message']}")
        except (ValueError, KeyError, TypeError):
            raise CommandError(f"HTTP {response.status_code}: {response.text[:500]}") from None
    return response


def page_link(batch_id: str, expires_in: int | None = None) -> str:
    """A signed link to the batch's listening page, on the API address this client uses."""
    with _connect() as http:
        response = _call(http, "GET", f"/v1/batches/{batch_id}/link",
                         params={"expires_in": expires_in} if expires_in else {})  # fmt: skip
        if response.status_code == 404:
            raise CommandError(f"no batch {batch_id!r} for this API key")
        return str(http.base_url).rstrip("/") + response.json()["path"]


def _page(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="auk page", description="Print a signed link to a batch's listening page.")
    p.add_argument("id")
    p.add_argument("--expires", type=int, default=None, help="seconds the link works (default: the server's, 1 h)")
    args = p.parse_args(argv)
    print(page_link(args.id, args.expires))
    return 0


def _cancel(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="auk cancel", description="Cancel a job, or every unfinished job of a batch.")
    p.add_argument("id")
    args = p.parse_args(argv)
    with _connect() as http:
        for resource in ("jobs", "batches"):
            response = _call(http, "POST", f"/v1/{resource}/{args.id}/cancel")
            if response.status_code != 404:
                print(json.dumps(response.json(), indent=2))
                return 0
    raise CommandError(f"no job or batch {args.id!r} for this API key")


COMMANDS = {"page": _page, "cancel": _cancel}


def main_batches(command: str, argv: list[str]) -> int:
    """Run ``auk page`` or ``auk cancel``; returns the exit status."""
    try:
        return COMMANDS[command](argv)
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
