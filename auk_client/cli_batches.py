"""``auk page`` and ``auk cancel``: a batch's listening-page link, and cancelling a job or a whole batch.

Built on ``auk_client.Client``, with the same ``AUK_API_URL`` and ``AUK_API_KEY`` as the other client commands:

    auk page BATCH_ID [--expires SECONDS]    # http://<api>/batches/<id>?exp=...&sig=... (opens without a key)
    auk cancel ID                            # a job, or every job of a batch that has not ended

``page_link`` (in ``cli.py``) is also what ``auk submit --batch`` prints after the batch is queued.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from auk_client.cli import ClientError, api_address, page_link
from auk_client.client import ApiError, Client


def _connect() -> Client:
    return Client(*api_address())


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
                    raise ClientError(str(exc)) from None
    raise ClientError(f"no job or batch {args.id!r} for this API key")


COMMANDS = {"page": _page, "cancel": _cancel}


def main_batches(command: str, argv: list[str]) -> int:
    """Run ``auk page`` or ``auk cancel``; returns the exit status."""
    try:
        return COMMANDS[command](argv)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
