"""The API's clients, built once per app, and the FastAPI dependency that hands them to a route.

Routes reach Redis only through the stores (``JobStore``, ``UploadStore``, ``BatchBook``, the webhook stores,
``VoiceStore``, ``ReplyWaiter``); the client itself is here for the readiness check's heartbeats and to be closed
when the app stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from celery import Celery
from fastapi import Request

from auk_worker.service.ops.audit import CachedAudit
from auk_worker.service.records.batches import BatchBook
from auk_worker.service.queues.celery_app import make_celery
from auk_worker.service.queues.fairshare import FairShare
from auk_worker.service.records.store import JobStore
from auk_worker.service.delivery.notify import Notifier, NotifyingJobStore
from auk_worker.service.connect.redis import ReplicationBarrier, redis_client
from auk_worker.service.delivery.replies import ReplyWaiter
from auk_worker.service.connect.settings import Settings
from auk_worker.service.connect.storage import Storage
from auk_worker.service.records.uploads import UploadStore
from auk_worker.service.records.voices import VoiceStore
from auk_worker.service.delivery.webhooks.dispatch import WebhookDispatcher
from auk_worker.service.delivery.webhooks.store import RetryPolicy, WebhookSecrets, WebhookStore
from auk_worker.service.records.jobs import owner_id
from auk_worker.urlguard import UrlGuard, UrlPolicy
from auk_worker.voice_catalogue import VoiceCatalogue, load_catalogue

REDIS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Services:
    """The API's clients, built once per app."""

    settings: Settings
    redis: redis.Redis
    store: JobStore
    uploads: UploadStore
    storage: Storage
    celery: Celery
    batches: BatchBook
    notifier: Notifier  # enqueues the webhooks of ended jobs and batches (``store`` calls it on every end)
    webhooks: WebhookStore
    webhook_secrets: WebhookSecrets
    webhook_guard: UrlGuard
    barrier: ReplicationBarrier  # run before a 202: the job's writes are on the current master and its replicas
    voices: VoiceStore
    catalogue: VoiceCatalogue  # the built-in voices (AUK_VOICES_FILE), read strictly when the app is built
    replies: ReplyWaiter  # the speech endpoint's wait for its audio (binary, asyncio)
    fair: FairShare
    audit: CachedAudit  # queued jobs with no message, the oldest queued job's age (/readyz, /metrics)

    def send(self, task: str, args: list, queue: str) -> None:
        """Send a task by name (the bulk feeder's way to Celery)."""
        self.celery.send_task(task, args=args, queue=queue)


def build_services(settings: Settings) -> Services:
    """Every client over ``settings``; nothing connects until it is first used. The built-in voices are read now:
    a bad voices file stops the API at start-up."""
    client = redis_client(settings, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    storage = Storage(settings)
    notifier = Notifier(WebhookStore(client), storage, settings.presign_seconds)
    store = NotifyingJobStore(client, notifier, retain_s=settings.retain_records_s)
    policy = RetryPolicy(base_s=settings.webhook_retry_base_s, cap_s=settings.webhook_retry_cap_s,
                         max_attempts=settings.webhook_max_attempts)  # fmt: skip
    return Services(
        settings=settings,
        redis=client,
        store=store,
        uploads=UploadStore(client, retain_s=settings.retain_uploads_s),
        storage=storage,
        celery=make_celery(settings),
        batches=BatchBook(store),
        notifier=notifier,
        webhooks=WebhookStore(client, policy=policy, retain_s=settings.retain_records_s),
        webhook_secrets=WebhookSecrets(client),
        webhook_guard=UrlGuard(UrlPolicy.parse(settings.webhook_allow)),
        barrier=ReplicationBarrier.from_settings(client, settings),
        voices=VoiceStore(client),
        catalogue=load_catalogue(settings.voices_file),
        replies=ReplyWaiter.from_settings(settings),
        fair=FairShare(client, settings.bulk_queue_depth),
        audit=CachedAudit(client, [owner_id(key) for key in settings.api_keys]),
    )


def services(request: Request) -> Services:
    """FastAPI dependency: the app's clients."""
    return request.app.state.services


def start_dispatcher(svc: Services) -> WebhookDispatcher | None:
    """The webhook dispatcher's threads inside the API process (``AUK_WEBHOOK_THREADS``, 0 for none: then run
    ``python -m auk_worker.service.delivery.webhooks`` beside it)."""
    settings = svc.settings
    if settings.webhook_threads == 0:
        return None
    return WebhookDispatcher(svc.webhooks, svc.webhook_secrets, svc.webhook_guard, timeout_s=settings.webhook_timeout_s,
                             threads=settings.webhook_threads).start()  # fmt: skip
