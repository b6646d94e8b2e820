"""The user CLI over the REST API: ``auk submit``, ``auk status``, ``auk wait`` and ``auk fetch``.

Built on the public client (``auk_client.Client``): ``AUK_API_URL`` (default http://127.0.0.1:8000) and the
bearer key ``AUK_API_KEY``.
``auk_worker.cli`` (the ``auk`` entry point) hands these four commands to ``main_client(command, argv)``; ``auk page``
and ``auk cancel`` are in ``cli_batches.py``.

    auk submit --instruction "Say hello." --gen-seconds 3          # one job; prints its record
    auk submit --audio ref.wav --instruction "..."                  # uploads the clip first
    auk submit --voice voice_... --instruction "..." --format flac  # a saved voice, FLAC out
    auk submit --batch jobs.jsonl                                   # one job per line, each with custom_id
    auk status ID          auk wait ID          auk fetch ID -o out/

An ID is a job's or a batch's; the commands look it up as a job first, then as a batch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from auk_client.client import ApiError, Client
from auk_client.types import TERMINAL
from auk_worker.formats import FORMATS

log = logging.getLogger(__name__)

DEFAULT_API_URL = "http://127.0.0.1:8000"


class ClientError(Exception):
    """An answer the user should read (the API's own error message, or why the API was not reached)."""


def api_address() -> tuple[str, str]:
    """``(AUK_API_URL, AUK_API_KEY)``, what every client command talks to (the user's machine's environment, not
    the service's settings); ``ClientError`` when no key is set."""
    api_key = os.environ.get("AUK_API_KEY", "").strip()
    if not api_key:
        raise ClientError("AUK_API_KEY is not set: export the API key the service gave you")
    return os.environ.get("AUK_API_URL", DEFAULT_API_URL), api_key


class Api:
    """The commands' view of the API: ``auk_client.Client`` plus the lookups the commands share. Every API error
    becomes ``ClientError`` with the API's message (a batch's bad lines listed)."""

    def __init__(self, base_url: str, api_key: str, timeout: float = 60.0) -> None:
        self.client = Client(base_url, api_key, timeout=timeout)

    def close(self) -> None:
        self.client.close()

    def call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except ApiError as exc:
            raise ClientError(_error_text(exc)) from None

    def job_or_batch(self, ident: str) -> tuple[str, dict]:
        """``("job", record)`` or ``("batch", record)`` for an id; ClientError when it is neither."""
        for kind, find in (("job", self.client.find_job), ("batch", self.client.find_batch)):
            found = self.call(find, ident)
            if found is not None:
                return kind, found.raw
        raise ClientError(f"no job or batch {ident!r} for this API key")

    def batch_jobs(self, batch_id: str) -> list[dict]:
        return [job.raw for job in self.call(self.client.batch_jobs, batch_id)]


def _error_text(exc: ApiError) -> str:
    if not exc.status:
        return exc.message
    text = f"HTTP {exc.status} {exc.code}: {exc.message}"
    if isinstance(exc.details, list):
        lines = [f"  line {d['line']}: {d['message']}" for d in exc.details if isinstance(d, dict) and "line" in d]
        if lines:
            text += "\n" + "\n".join(lines)
    return text


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


# -- submit ------------------------------------------------------------------------------------------------------
def _submit_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="auk submit", description="Enqueue one job, or a JSONL batch with --batch.")
    p.add_argument("--batch", type=Path, help="a JSONL file: one job request per line, each with custom_id")
    p.add_argument("--instruction", help="the instruction text")
    clip = p.add_mutually_exclusive_group()
    clip.add_argument("--audio", type=Path, help="a local audio file: uploaded first, then used as the clip")
    clip.add_argument("--audio-key", help="an object key in the service's input bucket")
    clip.add_argument("--voice", help="a voice_id (POST /v1/voices) as the clip")
    p.add_argument("--gen-seconds", type=float, help="target length (required without audio)")
    p.add_argument("--variant", choices=("base", "flash"))
    p.add_argument("--steps", type=int, dest="num_inference_steps")
    p.add_argument("--guidance-scale", type=float)
    p.add_argument("--sway", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--format", choices=tuple(FORMATS), dest="response_format", help="output format (default wav)")
    p.add_argument("--custom-id")
    p.add_argument("--priority", choices=("interactive", "bulk"))
    p.add_argument("--idempotency-key", help="a repeated key returns the job (or batch) it made instead of a new one")
    args = p.parse_args(argv)
    if args.batch is None and not args.instruction:
        p.error("give --instruction for one job, or --batch FILE.jsonl")
    if args.batch is not None and (args.instruction or args.audio or args.audio_key):
        p.error("--batch takes its jobs from the file; leave out --instruction and --audio")
    return args


JOB_FIELDS = ("instruction", "gen_seconds", "voice", "variant", "num_inference_steps", "guidance_scale", "sway",
              "seed", "response_format", "custom_id", "priority")


def _submit(api: Api, argv: Sequence[str]) -> int:
    args = _submit_args(argv)
    if args.batch is not None:
        try:
            data = args.batch.read_bytes()
        except OSError as exc:
            raise ClientError(f"cannot read {args.batch}: {exc.strerror}") from None
        headers = {"Content-Type": "application/x-ndjson"}
        if args.idempotency_key:
            headers["Idempotency-Key"] = args.idempotency_key
        batch = api.call(api.client.request, "POST", "/v1/batches", content=data, headers=headers)
        _print_json(batch)
        print(f"batch {batch['id']}: {batch['total']} jobs queued; follow it with `auk wait {batch['id']}`",
              file=sys.stderr)
        _announce_page(batch["id"])
        return 0
    body: dict[str, Any] = {name: getattr(args, name) for name in JOB_FIELDS if getattr(args, name) is not None}
    if args.audio is not None:
        try:
            payload = args.audio.read_bytes()
        except OSError as exc:
            raise ClientError(f"cannot read {args.audio}: {exc.strerror}") from None
        upload = api.call(api.client.upload, payload, args.audio.name)
        body["audio"] = {"upload_id": upload.upload_id}
    elif args.audio_key is not None:
        body["audio"] = {"key": args.audio_key}
    job = api.call(api.client.submit_job, body, args.idempotency_key)
    _print_json(job.raw)
    return 0


def page_link(batch_id: str, expires_in: int | None = None) -> str:
    """A signed link to the batch's listening page, on the API address this client uses."""
    with Client(*api_address()) as client:
        try:
            return client.batch_link(batch_id, expires_in)
        except ApiError as exc:
            if exc.status == 404:
                raise ClientError(f"no batch {batch_id!r} for this API key") from None
            raise ClientError(str(exc)) from None



def _announce_page(batch_id: str) -> None:
    """Print the batch's listening-page link (``auk page``), or why there is none; the batch is queued either way."""
    try:
        print(f"listen: {page_link(batch_id)}", file=sys.stderr)
    except ClientError as exc:
        print(f"no page link ({exc}); try `auk page {batch_id}` later", file=sys.stderr)


# -- status / wait -----------------------------------------------------------------------------------------------
def _status(api: Api, argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="auk status", description="Print a job's or a batch's record.")
    p.add_argument("id")
    args = p.parse_args(argv)
    _, record = api.job_or_batch(args.id)
    _print_json(record)
    return 0


def _job_exit(job: dict) -> int:
    if job["status"] == "succeeded":
        return 0
    error = job.get("error") or {}
    print(f"job {job['id']}: {job['status']}: {error.get('message', '')}", file=sys.stderr)
    return 1


def _batch_exit(batch: dict) -> int:
    counts = batch["counts"]
    bad = counts.get("failed", 0) + counts.get("canceled", 0)
    if bad:
        print(f"batch {batch['id']}: {bad} of {batch['total']} jobs did not succeed", file=sys.stderr)
    return 1 if bad else 0


def _wait(api: Api, argv: Sequence[str]) -> int:
    from tqdm import tqdm

    p = argparse.ArgumentParser(prog="auk wait", description="Wait for a job or batch, with a progress bar.")
    p.add_argument("id")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (exit 2)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    kind, record = api.job_or_batch(args.id)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    bar = tqdm(total=None, unit="step" if kind == "job" else "job", disable=args.quiet, file=sys.stderr,
               desc=f"{kind} {args.id[:12]}")
    try:
        while True:
            done, total, label = _progress(kind, record)
            if total and bar.total != total:
                bar.total = total
            bar.n = done
            bar.set_postfix_str(label, refresh=False)
            bar.refresh()
            if _finished(kind, record):
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"\n{kind} {args.id}: still {label} after {args.timeout:g} s", file=sys.stderr)
                return 2
            time.sleep(args.interval)
            getter = api.client.get_job if kind == "job" else api.client.get_batch
            record = api.call(getter, args.id).raw
    finally:
        bar.close()
    _print_json(record)
    return _job_exit(record) if kind == "job" else _batch_exit(record)


def _progress(kind: str, record: dict) -> tuple[int, int | None, str]:
    """(done, total, status label) for the bar: Euler steps of a job, finished jobs of a batch."""
    if kind == "job":
        progress = record.get("progress") or {}
        total = progress.get("total")
        step = progress.get("step", 0)
        if record["status"] == "succeeded" and total:
            step = total
        return step, total, record["status"]
    counts = record["counts"]
    done = sum(counts.get(status, 0) for status in TERMINAL)
    label = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    return done, record["total"], label


def _finished(kind: str, record: dict) -> bool:
    return record["status"] in TERMINAL if kind == "job" else record["status"] == "done"


# -- fetch -------------------------------------------------------------------------------------------------------
def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "job"


def _download(http: httpx.Client, url: str, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".part")
    try:
        with http.stream("GET", url) as response:
            if response.is_error:
                raise ClientError(f"download of {dest.name} failed: HTTP {response.status_code}")
            with open(tmp, "wb") as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
    except httpx.HTTPError as exc:
        raise ClientError(f"download of {dest.name} failed: {exc}") from None
    tmp.replace(dest)


def _extension(job: dict) -> str:
    spec = FORMATS.get((job.get("result") or {}).get("format", "wav"))
    return spec.extension if spec is not None else "wav"


def _fetch(api: Api, argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="auk fetch", description="Download a job's audio, or every clip of a batch.")
    p.add_argument("id")
    p.add_argument("-o", "--out", type=Path, default=Path("."), help="directory to write into (default: .)")
    args = p.parse_args(argv)
    kind, record = api.job_or_batch(args.id)
    args.out.mkdir(parents=True, exist_ok=True)
    # Presigned URLs carry their own signature: fetched without the API key.
    with httpx.Client(timeout=api.client.http.timeout, follow_redirects=True) as plain:
        if kind == "job":
            if record["status"] != "succeeded":
                raise ClientError(f"job {args.id} is {record['status']}; only a succeeded job has audio")
            dest = args.out / f"{record['id']}.{_extension(record)}"
            _download(plain, record["result"]["url"], dest)
            print(dest)
            return 0
        if record["status"] != "done":
            print(f"batch {args.id} is {record['status']}; fetching the jobs that have finished", file=sys.stderr)
        written = 0
        names: set[str] = set()
        for job in api.batch_jobs(args.id):
            if job["status"] != "succeeded":
                continue
            name = _safe_name(job.get("custom_id") or job["id"])
            if name in names:  # two custom_ids that differ only in characters a file name cannot hold
                name = f"{name}-{job['id']}"
            names.add(name)
            dest = args.out / f"{name}.{_extension(job)}"
            _download(plain, job["result"]["url"], dest)
            written += 1
        manifest = record.get("manifest")
        if manifest:
            _download(plain, manifest["url"], args.out / f"batch-{args.id}.manifest.jsonl")
        print(f"{written} clips written to {args.out}")
        return _batch_exit(record) if record["status"] == "done" else 1


COMMANDS = {"submit": _submit, "status": _status, "wait": _wait, "fetch": _fetch}


def main_client(command: str, argv: list[str]) -> int:
    """Run one of ``submit``, ``status``, ``wait``, ``fetch``; returns the exit status."""
    if command not in COMMANDS:
        print(f"unknown command {command!r}: use submit, status, wait or fetch", file=sys.stderr)
        return 2
    try:
        api = Api(*api_address())
    except ClientError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](api, argv)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        api.close()
