"""Prometheus metrics of the API and of each worker (``prometheus-client``), named by Prometheus's conventions.

API (``GET /metrics`` on the API's own port), counted in the API process:

- ``auk_api_requests_total{method, route, status}``: requests by route template (``/v1/jobs/{job_id}``; a path no
  route matches is ``route="unmatched"``) and status code;
- ``auk_api_request_duration_seconds{method, route}``: histogram of the time to the response's last byte;

and read from Redis at each scrape, so every API replica reports the same cluster-wide values:

- ``auk_queue_messages{queue}``: broker messages waiting per queue (a bulk message may carry a group of jobs);
- ``auk_queue_unacked_messages``: messages delivered to workers and not yet acknowledged;
- ``auk_jobs_submitted_total``, ``auk_jobs_finished_total{status}``: jobs since the store was created;
- ``auk_jobs_unfinished``: jobs submitted and not yet finished (queued or running);
- ``auk_workers{state}``: workers by heartbeat state; ``auk_redis_up``: whether those reads answered.
- ``auk_jobs_queued_without_message``: queued jobs whose message is nowhere (should always be 0), and
  ``auk_jobs_oldest_queued_age_seconds``: from the queue audit (``audit.py``: bounded reads, cached 10 s).

Worker (an HTTP server on ``AUK_METRICS_PORT``, in the process that renders):

- ``auk_worker_jobs_total{outcome}``: ``succeeded``, ``failed``, ``canceled``, ``retried`` (an infrastructure error
  sent it back), ``skipped`` (a delivery of a job already finished, or whose record has expired);
- ``auk_worker_stage_seconds{stage}``: histogram per stage: ``fetch`` (record and clip), ``render`` (the pipeline
  call), ``upload`` (WAV and record), and the pipeline's own stages (``encode``, ``vae_encode``, ``dit``, ``decode``);
- ``auk_worker_job_seconds``: histogram of a job's time from its start to its recorded success;
- ``auk_worker_model_load_seconds``, ``auk_worker_warmup_seconds``: what loading and warming up the pipeline took;
- ``auk_worker_gpu_memory_bytes{device, kind}``: ``allocated`` and ``reserved`` by torch, on a CUDA worker;
- ``auk_worker_heartbeat_age_seconds``: how old the heartbeat in Redis is (what the API's readiness sees);
- ``auk_worker_info{worker, variant, pipeline}``: 1.

The worker runs Celery's solo pool, so the process that renders is the process that serves the metrics: the
counters need no multiprocess mode. (A prefork pool would render in a child while a server in the parent saw
nothing; that is why the server starts in the rendering process, after the pipeline has loaded.)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from auk_worker.service.audit import CachedAudit
from auk_worker.service.celery_app import worker_queues
from auk_worker.service.health import STATES as WORKER_STATES
from auk_worker.service.health import read_heartbeats
from auk_worker.service.settings import VARIANTS

# A job's stages run from milliseconds (the instant pipeline, an upload) to a minute (a long clip on the CPU).
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
OUTCOMES = ("succeeded", "failed", "canceled", "retried", "skipped")


# ---------------------------------------------------------------------------------------------------- worker


class WorkerMetrics:
    """A worker's metrics in their own registry; ``serve(port)`` exposes them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs = Counter("auk_worker_jobs", "Jobs this worker ended, by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.jobs.labels(outcome)  # every outcome is exported from the start, at 0
        self.stages = Histogram("auk_worker_stage_seconds", "Seconds per stage of a job", ["stage"],
                                buckets=STAGE_BUCKETS, registry=r)  # fmt: skip
        self.job_seconds = Histogram("auk_worker_job_seconds", "Seconds from a job's start to its recorded success",
                                     buckets=STAGE_BUCKETS, registry=r)  # fmt: skip
        self.model_load = Gauge("auk_worker_model_load_seconds", "Seconds the pipeline took to load", registry=r)
        self.warmup = Gauge("auk_worker_warmup_seconds", "Seconds the pipeline took to warm up", registry=r)
        self.info = Gauge("auk_worker_info", "This worker", ["worker", "variant", "pipeline"], registry=r)

    def outcome(self, outcome: str, n: int = 1) -> None:
        self.jobs.labels(outcome).inc(n)

    def succeeded(self, stages: dict[str, float], total_s: float) -> None:
        self.jobs.labels("succeeded").inc()
        for stage, seconds in stages.items():
            self.stages.labels(stage).observe(seconds)
        self.job_seconds.observe(total_s)

    def loaded(self, pipeline: Any, worker: str, variant: str, kind: str) -> None:
        """The pipeline's start-up times (``pipeline.startup``, when it has them) and this worker's identity."""
        startup = getattr(pipeline, "startup", {}) or {}
        self.model_load.set(float(startup.get("load", 0.0)))
        self.warmup.set(float(startup.get("warm_up", 0.0)))
        self.info.labels(worker, variant, kind).set(1)

    def watch_heartbeat(self, read_ts: Callable[[], float | None]) -> None:
        """Export the heartbeat's age, read from Redis at each scrape by ``read_ts`` (epoch seconds or None)."""
        self.registry.register(_HeartbeatAge(read_ts))

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Start the metrics HTTP server on a daemon thread; GPU memory is exported from then on."""
        self.registry.register(_GpuMemory())
        start_http_server(port, addr=addr, registry=self.registry)


class _HeartbeatAge(Collector):
    def __init__(self, read_ts: Callable[[], float | None]) -> None:
        self.read_ts = read_ts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("auk_worker_heartbeat_age_seconds",
                                   "Seconds since the heartbeat in Redis was written")
        try:
            ts = self.read_ts()
        except redis.RedisError:
            ts = None
        if ts is not None:
            family.add_metric([], max(0.0, time.time() - ts))
        yield family


class _GpuMemory(Collector):
    """torch's allocated and reserved CUDA memory per device; nothing on a worker without CUDA (never initialises
    CUDA itself)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("auk_worker_gpu_memory_bytes", "GPU memory held by torch", labels=["device", "kind"])
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            for index in range(torch.cuda.device_count()):
                family.add_metric([str(index), "allocated"], float(torch.cuda.memory_allocated(index)))
                family.add_metric([str(index), "reserved"], float(torch.cuda.memory_reserved(index)))
        yield family


# ---------------------------------------------------------------------------------------------------- API


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
        finished = CounterMetricFamily("auk_jobs_finished", "Jobs finished, by status", labels=["status"])
        done = 0
        for status in ("succeeded", "failed", "canceled"):
            count = int(stats.get(status, 0))
            done += count
            finished.add_metric([status], count)
        yield finished
        yield GaugeMetricFamily("auk_jobs_unfinished", "Jobs submitted and not finished (queued or running)",
                                value=max(0, submitted - done))  # fmt: skip
        audit = self.audit.get() if self.audit is not None else None
        if audit is not None:
            yield GaugeMetricFamily("auk_jobs_queued_without_message", "Queued jobs whose message is in no queue, "
                                    "no unacknowledged set and no staged list (should be 0; audit.py)",
                                    value=audit.queued_without_message)  # fmt: skip
            yield GaugeMetricFamily("auk_jobs_oldest_queued_age_seconds", "Seconds the oldest queued job has waited",
                                    value=audit.oldest_queued_age_s or 0.0)  # fmt: skip
        workers = GaugeMetricFamily("auk_workers", "Workers by heartbeat state", labels=["state"])
        for state in WORKER_STATES:
            workers.add_metric([state], sum(1 for beat in beats if beat.get("state") == state))
        yield workers


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
