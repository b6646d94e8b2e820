"""``auk page`` and ``auk cancel``: a batch's listening-page link, and cancelling a job or a whole batch.

Built on ``auk_client.Client``, with the same ``AUK_API_URL`` and ``AUK_API_KEY`` as the other client commands:

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

from auk_client import ApiError, Client

DEFAULT_API_URL = "http://127.0.0.1:8000"


class CommandError(Exception):
    """An answer the user should read: the API's error message, or why it was not reached."""


def _connect() -> Client:
    api_key = os.environ.get("AUK_API_KEY", "").strip()
    if not api_key:
        raise CommandError("AUK_API_KEY is not set: export the API key the service gave you")
    return Client(os.environ.get("AUK_API_URL", DEFAULT_API_URL), api_key)


def page_link(batch_id: str, expires_in: int | None = None) -> str:
    """A signed link to the batch's listening page, on the API address this client uses."""
    with _connect() as client:
        try:
            return client.batch_link(batch_id, expires_in)
        except ApiError as exc:
            if exc.status == 404:
                raise CommandError(f"no batch {batch_id!r} for this API key") from None
            raise CommandError(str(exc)) from None


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
    with _connect() as client:
        for cancel in (client.cancel_job, client.cancel_batch):
            try:
                print(json.dumps(cancel(args.id).raw, indent=2))
                return 0
            except ApiError as exc:
                if exc.status != 404:
                    raise CommandError(str(exc)) from None
    raise CommandError(f"no job or batch {args.id!r} for this API key")


COMMANDS = {"page": _page, "cancel": _cancel}


def main_batches(command: str, argv: list[str]) -> int:
    """Run ``auk page`` or ``auk cancel``; returns the exit status."""
    try:
        return COMMANDS[command](argv)
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
