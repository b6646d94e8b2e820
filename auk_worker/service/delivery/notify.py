"""Webhook notifications of finished work, and the job store that sends them.

A job that names a ``webhook_url`` gets one delivery when it ends (``job.succeeded``, ``job.failed``,
``job.canceled``); a batch that names one gets ``batch.completed`` once its manifest is stored. The delivery id is
derived from the record (``msg_job_<id>``, ``msg_batch_<id>``), so every path that sees the end may enqueue it and
the first enqueue stands: the transition itself (``NotifyingJobStore``), a redelivered task that meets an ended job,
and whichever process writes the batch's results. ``webhooks/`` signs, sends and retries.

The event's ``data`` is the record as the API shows it, with a freshly presigned result URL when storage is at hand.
"""

from __future__ import annotations

import logging
from typing import Any

from auk_worker.service.records.jobs import JobRecord
from auk_worker.service.records.store import JobStore
from auk_worker.service.records.transitions import Transition
from auk_worker.service.delivery.webhooks.store import WebhookStore, delivery_id_for

log = logging.getLogger(__name__)


class Notifier:
    """Enqueues the webhook deliveries of ended jobs and completed batches."""

    def __init__(self, deliveries: WebhookStore, storage: Any | None = None, presign_seconds: int = 3600) -> None:
        self.deliveries = deliveries
        self.storage = storage  # a ``Storage``, to presign result URLs; None leaves them out
        self.presign_seconds = presign_seconds

    def job_ended(self, record: JobRecord | None) -> str | None:
        """Enqueue ``job.<status>`` for an ended job that names a webhook; the delivery id, or None."""
        url = (record.request or {}).get("webhook_url") if record is not None else None
        if not url or not record.terminal:
            return None
        data = record.to_public()
        result = data.get("result")
        if result and result.get("key") and self.storage is not None:
            data["result"] = {**result, "url": self.storage.presign_get(result["key"], self.presign_seconds,
                                                                        bucket=result.get("bucket"))}  # fmt: skip
        delivery_id = self.deliveries.enqueue(record.owner, url, f"job.{record.status.value}", data,
                                              delivery_id=delivery_id_for("job", record.id))  # fmt: skip
        log.info("job %s: webhook %s enqueued for %s", record.id, delivery_id, url)
        return delivery_id

    def batch_completed(self, owner: str, batch_id: str, url: str | None, data: dict[str, Any]) -> str | None:
        """Enqueue ``batch.completed`` with the batch's public record ``data``; the delivery id, or None."""
        if not url:
            return None
        delivery_id = self.deliveries.enqueue(owner, url, "batch.completed", data,
                                              delivery_id=delivery_id_for("batch", batch_id))  # fmt: skip
        log.info("batch %s: webhook %s enqueued for %s", batch_id, delivery_id, url)
        return delivery_id

    def view(self, kind: str, record_id: str, url: str | None) -> dict[str, Any] | None:
        """The record's ``webhook`` field: None without a URL; ``waiting`` until the record ends; then the
        delivery's state (``pending``, ``delivered`` or ``failed``), attempts, last status and next attempt."""
        if not url:
            return None
        state = self.deliveries.state(delivery_id_for(kind, record_id))
        if state is None:
            return {"url": url, "state": "waiting", "attempts": 0, "last_status": None, "last_error": None,
                    "delivered_at": None, "next_attempt_at": None}  # fmt: skip
        return {"url": url, **state}


class NotifyingJobStore(JobStore):
    """A ``JobStore`` whose terminal transitions (finish, fail, cancel) enqueue the job's webhook, if it has one.

    The delivery is enqueued after the transition; if Redis fails in between, the task's retry meets the ended
    job and enqueues it then (``worker/outcome.ended_elsewhere``). The worker itself does not use this store: its
    ``outcome.py`` fires the webhook after each ending."""

    def __init__(self, redis_client: Any, notifier: Notifier, namespace: str = "auk", retain_s: int = 0) -> None:
        super().__init__(redis_client, namespace, retain_s)
        self.notifier = notifier

    def finish(self, *args: Any, **kwargs: Any) -> Transition:
        return self._told(super().finish(*args, **kwargs))

    def fail(self, *args: Any, **kwargs: Any) -> Transition:
        return self._told(super().fail(*args, **kwargs))

    def cancel(self, *args: Any, **kwargs: Any) -> JobRecord | None:
        record = super().cancel(*args, **kwargs)
        self.notifier.job_ended(record)
        return record

    def _told(self, outcome: Transition) -> Transition:
        self.notifier.job_ended(outcome.record)
        return outcome
