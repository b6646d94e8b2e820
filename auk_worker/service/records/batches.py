"""Batches as their owner manages them: the owner's index, cancel, and the result files beside the WAVs.

``JobStore`` writes a batch and counts its jobs; ``BatchBook`` keeps what an owner manages on top of it, in the same
batch hash and one more index:

- ``auk:owner:{owner}:batches``  zset: the owner's batch ids scored by creation time (ms), newest-first listing
- ``auk:batch:{id}`` fields ``webhook_url``, ``canceled_at``, ``error_key``, ``error_count``

Cancel marks the batch (``canceled_at``), then cancels every job that has not ended through ``JobStore.cancel``:
a queued job's message is skipped when a worker meets it, and a running one stops at its next step (the worker's
step callback reads the record, ``worker/steps.Progress``), so the model code needs no cancel path of its own.

``write_results`` stores the batch's results once every job has ended: an error file (JSONL, one line per job that
did not succeed: ``custom_id``, ``job_id``, ``status`` and ``error``, as OpenAI's Batch API ``error_file``), then
the manifest (one line per job), then marks the batch done and enqueues its ``batch.completed`` webhook. Its
records no longer change, so two writers (a worker and the API after a cancel) store the same bytes.
"""

from __future__ import annotations

import builtins
import json
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from auk_worker.service.records.jobs import JobStatus, TERMINAL, batch_from_hash, utc_now
from auk_worker.service.records.store import JobStore
from auk_worker.service.records.objects import error_file_key, manifest_key

log = logging.getLogger(__name__)


def _ms(stamp: str) -> int:
    return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000)


def parse_cursor(cursor: str) -> tuple[int, str]:
    """``"<created ms>-<id>"`` (the job listing's form); ValueError for anything else."""
    score, _, after_id = cursor.partition("-")
    if not (score.isascii() and score.isdigit() and len(score) <= 16 and after_id):
        raise ValueError(f"bad cursor {cursor!r}")
    return int(score), after_id


def batch_state(counts: Mapping[str, int], total: int, manifest_stored: bool) -> str:
    """``running`` while a job of the batch is not terminal, ``finishing`` until its manifest is stored, then
    ``done``: a caller who waits for ``done`` always finds the manifest (and the error file) linked."""
    finished = sum(counts.get(status.value, 0) for status in TERMINAL)
    if finished < total:
        return "running"
    return "done" if manifest_stored else "finishing"


class BatchBook:
    """The owner's view of batches, over a ``JobStore`` (same Redis, same namespace)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.redis = store.redis
        self.ns = store.ns

    def owner_key(self, owner: str) -> str:
        return f"{self.ns}:owner:{owner}:batches"

    def register(self, batch_id: str, owner: str, webhook_url: str | None = None) -> None:
        """Index a batch ``JobStore.create_batch`` wrote under its owner, with its webhook URL (before its tasks go)."""
        created = self.redis.hget(self.store.batch_key(batch_id), "created_at") or utc_now()
        pipe = self.redis.pipeline(transaction=True)
        pipe.zadd(self.owner_key(owner), {batch_id: _ms(created)})
        if webhook_url:
            pipe.hset(self.store.batch_key(batch_id), "webhook_url", webhook_url)
        pipe.execute()

    def get(self, batch_id: str) -> dict[str, Any] | None:
        return self.store.get_batch(batch_id)

    def owned(self, batch_id: str, owner: str) -> dict[str, Any] | None:
        """The batch if ``owner`` made it; None for a missing or foreign one (they look the same)."""
        batch = self.get(batch_id)
        return batch if batch is not None and batch["owner"] == owner else None

    def list(self, owner: str, limit: int = 20, cursor: str | None = None) -> tuple[builtins.list[dict], str | None]:
        """The owner's batches newest first; ``next_cursor`` (``"<created ms>-<id>"``) is None on the last page."""
        top: float | str = "+inf"
        after: tuple[int, str] | None = None
        if cursor:
            after = parse_cursor(cursor)
            top = after[0]
        rows = self.redis.zrevrangebyscore(self.owner_key(owner), top, "-inf", start=0,
                                           num=limit + 1 + (64 if after else 0), withscores=True)  # fmt: skip
        if after is not None:  # equal scores come in reverse id order: skip the ids at or above the cursor's
            rows = [(m, s) for m, s in rows if not (int(s) == after[0] and m >= after[1])]
        rows = rows[: limit + 1]
        pipe = self.redis.pipeline(transaction=False)
        for batch_id, _ in rows:
            pipe.hgetall(self.store.batch_key(batch_id))
        batches = [batch_from_hash(raw) for raw in pipe.execute() if raw]
        page = batches[:limit]
        next_cursor = f"{_ms(page[-1]['created_at'])}-{page[-1]['id']}" if len(batches) > limit and page else None
        return page, next_cursor

    def cancel(self, batch_id: str, owner: str) -> tuple[dict[str, Any] | None, int]:
        """Cancel the owner's batch: ``(the batch after it, jobs canceled now)``; ``(None, 0)`` when it is not the
        owner's. Jobs that had already ended keep their state."""
        batch = self.owned(batch_id, owner)
        if batch is None:
            return None, 0
        if not batch["done"]:  # a batch that only waits for its results to be stored was not canceled
            self.redis.hsetnx(self.store.batch_key(batch_id), "canceled_at", utc_now())
        canceled = 0
        ids = self.redis.zrange(self.store.batch_jobs_key(batch_id), 0, -1)
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            for record in self.store.get_many(chunk):
                if record is not None and record.status not in TERMINAL:
                    canceled += self.store.cancel(record.id, owner) is not None
        log.info("batch %s: canceled by its owner (%d jobs stopped)", batch_id, canceled)
        return self.get(batch_id), canceled


def result_lines(store: JobStore, batch_id: str) -> tuple[list[str], list[str]]:
    """The manifest's lines (every job) and the error file's (every job that did not succeed), as JSON text."""
    manifest, errors = [], []
    for record in store.batch_records(batch_id):
        line: dict[str, Any] = {"custom_id": record.custom_id, "job_id": record.id, "status": record.status.value}
        if record.status == JobStatus.SUCCEEDED and record.result:
            line["key"] = record.result["key"]
        else:
            line["error"] = record.error
            errors.append(json.dumps(line, separators=(",", ":")))
        manifest.append(json.dumps(line, separators=(",", ":")))
    return manifest, errors


def write_results(store: JobStore, storage: Any, prefix: str, batch_id: str, notifier: Any | None = None) -> str:
    """Store the error file (if a job did not succeed) and the manifest, mark the batch done, and enqueue its
    ``batch.completed`` webhook through ``notifier`` (a ``delivery.notify.Notifier``; records never import
    delivery, so it is handed in). Returns the manifest key.

    An ``InfraError`` from storage leaves the batch not done; the next writer (a retried task) tries again."""
    manifest, errors = result_lines(store, batch_id)
    book = BatchBook(store)
    if errors:
        key = error_file_key(prefix, batch_id)
        storage.put_bytes(key, ("\n".join(errors) + "\n").encode(), "application/x-ndjson")
        store.redis.hset(store.batch_key(batch_id), mapping={"error_key": key, "error_count": len(errors)})
    key = manifest_key(prefix, batch_id)
    storage.put_bytes(key, ("\n".join(manifest) + "\n").encode(), "application/x-ndjson")
    store.set_batch_manifest(batch_id, key)
    log.info("batch %s: manifest of %d jobs written to %s (%d not succeeded)", batch_id, len(manifest), key,
             len(errors))  # fmt: skip
    batch = book.get(batch_id)
    if notifier is not None and batch is not None and batch["webhook_url"]:
        notifier.batch_completed(batch["owner"], batch_id, batch["webhook_url"],
                                 public_batch(batch, storage, notifier.presign_seconds))  # fmt: skip
    return key


def public_batch(batch: dict[str, Any], storage: Any, presign_seconds: int) -> dict[str, Any]:
    """A batch as callers see it: counts, status, and once done its manifest and error file with presigned URLs."""
    status = batch_state(batch["counts"], batch["total"], manifest_stored=bool(batch["manifest_key"]))
    files: dict[str, Any] = {"manifest": None, "error_file": None}
    if status == "done":
        for name, key in (("manifest", batch["manifest_key"]), ("error_file", batch["error_key"])):
            if key:
                files[name] = {"key": key, "url": storage.presign_get(key, presign_seconds)}
    if files["error_file"]:
        files["error_file"]["lines"] = batch["error_count"]
    return {"id": batch["id"], "total": batch["total"], "counts": batch["counts"], "status": status,
            "created_at": batch["created_at"], "finished_at": batch["finished_at"] if status == "done" else None,
            "canceled_at": batch["canceled_at"], **files}  # fmt: skip
