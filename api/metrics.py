"""Prometheus metrics of the API (``prometheus-client``), named by Prometheus's conventions; a worker's own are in
``auk_worker/service/worker/metrics.py``.

API (``GET /metrics`` on the API's own port), counted in the API process:

- ``auk_api_requests_total{method, route, status}``: requests by route template (``/v1/jobs/{job_id}``; a path no
  route matches is ``route="unmatched"``) and status code;
- ``auk_api_request_duration_seconds{method, route}``: histogram of the time to the response's last byte;

and read from Redis at each scrape, so every API replica reports the same cluster-wide values:

- ``auk_queue_backlog{variant, priority}``: render tasks waiting for a worker wherever they wait (the Celery queue,
  and for bulk the fair share's per-key lists: ``queues/backlog.py``), what the pools are scaled on;
- ``auk_queue_rendering{variant, priority}``: render tasks busy workers render now;
- ``auk_jobs_queued_without_message``: queued jobs whose message is nowhere (should always be 0), and
  ``auk_jobs_oldest_queued_age_seconds``: from the queue audit (``ops/audit.py``: bounded reads, cached 10 s);
- ``auk_queue_messages{queue}``: broker messages waiting per queue (a bulk message may carry a group of jobs);
- ``auk_queue_unacked_messages``: messages delivered to workers and not yet acknowledged;
- ``auk_jobs_submitted_total``, ``auk_jobs_finished_total{status}``: jobs since the store was created;
- ``auk_jobs_unfinished``: jobs submitted and not yet finished (queued or running);
- ``auk_workers{state}``: workers by heartbeat state; ``auk_redis_up``: whether those reads answered.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from auk_worker.service.connect.settings import VARIANTS
from auk_worker.service.ops.audit import CachedAudit
from auk_worker.service.ops.resend import RESENT
from auk_worker.service.queues.backlog import Backlog
from auk_worker.service.queues.celery_app import worker_queues
from auk_worker.service.records.workers import STATES as WORKER_STATES
from auk_worker.service.records.workers import read_heartbeats

REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)



class ApiMetrics:
    """The API's request metrics and its scrape-time reads of Redis, in their own registry."""

    def __init__(self, client: redis.Redis, stats_key: str, namespace: str = "auk",
                 registry: CollectorRegistry | None = None, audit: CachedAudit | None = None) -> None:  # fmt: skip
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("auk_api_requests", "HTTP requests by route template and status",
                                ["method", "route", "status"], registry=self.registry)  # fmt: skip
        self.latency = Histogram("auk_api_request_duration_seconds", "Seconds from a request to its response's end",
                                 ["method", "route"], buckets=REQUEST_BUCKETS, registry=self.registry)  # fmt: skip
        self.registry.register(_ServiceState(client, stats_key, namespace, audit))

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)


class _ServiceState(Collector):
    """Queue depths, job counts and worker states, read from Redis when scraped."""

    def __init__(self, client: redis.Redis, stats_key: str, namespace: str, audit: CachedAudit | None = None) -> None:
        self.audit = audit
        self.client = client
        self.stats_key = stats_key
        self.namespace = namespace
        self.queues = [q for variant in VARIANTS for q in worker_queues(variant)]
        self.backlog = Backlog(client, VARIANTS, namespace)

    def collect(self) -> Iterable[Any]:
        up = GaugeMetricFamily("auk_redis_up", "Whether Redis answered this scrape's reads")
        try:
            pipe = self.client.pipeline(transaction=False)
            for queue in self.queues:
                pipe.llen(queue)
            pipe.hlen("unacked")  # kombu's Redis transport: delivered, not yet acknowledged
            pipe.hgetall(self.stats_key)
            *depths, unacked, stats = pipe.execute()
            beats = read_heartbeats(self.client, self.namespace)
            waiting = self.backlog.read()
        except redis.RedisError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        queued = GaugeMetricFamily("auk_queue_messages", "Broker messages waiting per queue", labels=["queue"])
        for queue, depth in zip(self.queues, depths):
            queued.add_metric([queue], depth)
        yield queued
        yield GaugeMetricFamily("auk_queue_unacked_messages", "Messages delivered and not yet acknowledged",
                                value=unacked)  # fmt: skip
        submitted = int(stats.get("submitted", 0))
        yield CounterMetricFamily("auk_jobs_submitted", "Jobs submitted", value=submitted)
        yield CounterMetricFamily("auk_jobs_resent", "Queued jobs sent again because no message named them "
                                  "(ops/resend.py)", value=int(stats.get(RESENT, 0)))  # fmt: skip
        finished = CounterMetricFamily("auk_jobs_finished", "Jobs finished, by status", labels=["status"])
        done = 0
        for status in ("succeeded", "failed", "canceled"):
            count = int(stats.get(status, 0))
            done += count
            finished.add_metric([status], count)
        yield finished
        yield GaugeMetricFamily("auk_jobs_unfinished", "Jobs submitted and not finished (queued or running)",
                                value=max(0, submitted - done))  # fmt: skip
        workers = GaugeMetricFamily("auk_workers", "Workers by heartbeat state", labels=["state"])
        for state in WORKER_STATES:
            workers.add_metric([state], sum(1 for beat in beats if beat.get("state") == state))
        yield workers
        backlog = GaugeMetricFamily("auk_queue_backlog", "Render tasks waiting for a worker, wherever they wait",
                                    labels=["variant", "priority"])  # fmt: skip
        rendering = GaugeMetricFamily("auk_queue_rendering", "Render tasks workers render now",
                                      labels=["variant", "priority"])  # fmt: skip
        for variant, priorities in waiting.items():
            for priority, counts in priorities.items():
                backlog.add_metric([variant, priority], counts["waiting"])
                rendering.add_metric([variant, priority], counts["rendering"])
        yield backlog
        yield rendering
        audit = self.audit.get() if self.audit is not None else None
        if audit is not None:
            yield GaugeMetricFamily("auk_jobs_queued_without_message", "Queued jobs whose message is in no queue, "
                                    "no unacknowledged set and no staged list (should be 0; ops/audit.py)",
                                    value=audit.queued_without_message)  # fmt: skip
            yield GaugeMetricFamily("auk_jobs_oldest_queued_age_seconds", "Seconds the oldest queued job has waited",
                                    value=audit.oldest_queued_age_s or 0.0)  # fmt: skip


class RequestMetricsMiddleware:
    """ASGI middleware: each HTTP request counted by its route template and status, timed to its last byte."""

    def __init__(self, app: Any, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception that escapes every handler

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe(scope["method"], template, status, time.perf_counter() - started)
