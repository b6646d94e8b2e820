"""Prometheus metrics of a worker (``prometheus-client``), named by Prometheus's conventions; the API's are in
``api/metrics.py``.

Worker (an HTTP server on ``AUK_METRICS_PORT``, in the process that renders):

- ``auk_worker_jobs_total{outcome}``: ``succeeded``, ``failed``, ``canceled``, ``retried`` (an infrastructure error
  sent it back), ``skipped`` (a delivery of a job already finished, or whose record has expired);
- ``auk_worker_stage_seconds{stage}``: histogram per stage: ``fetch`` (record and clip), ``render`` (the pipeline
  call), ``upload`` (WAV and record), and the pipeline's own stages (``encode``, ``vae_encode``, ``dit``, ``decode``);
- ``auk_worker_job_seconds``: histogram of a job's time from its start to its recorded success;
- ``auk_worker_render_busy_seconds_total``: seconds the pipeline spent in render calls (one at a time): over a
  window, its rate is the share of the worker's time the GPU had work;
- ``auk_worker_model_load_seconds``, ``auk_worker_warmup_seconds``: what loading and warming up the pipeline took;
- ``auk_worker_gpu_memory_bytes{device, kind}``: ``allocated`` and ``reserved`` by torch, on a CUDA worker;
- ``auk_worker_heartbeat_age_seconds``: how old the heartbeat in Redis is (what the API's readiness sees);
- ``auk_worker_info{worker, variant, pipeline}``: 1.

The worker runs Celery's threads pool, so the process that renders is the process that serves the metrics: the
counters need no multiprocess mode. (A prefork pool would render in a child while a server in the parent saw
nothing; that is why the server starts in the rendering process, after the pipeline has loaded.)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# A job's stages run from milliseconds (the instant pipeline, an upload) to a minute (a long clip on the CPU).
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
OUTCOMES = ("succeeded", "failed", "canceled", "retried", "skipped")



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
        self.render_busy = Counter("auk_worker_render_busy_seconds", "Seconds the pipeline spent rendering",
                                   registry=r)  # fmt: skip
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
        """The pipeline's start-up times (``pipeline.startup``) and this worker's identity."""
        startup = pipeline.startup
        self.model_load.set(float(startup.get("load", 0.0)))
        self.warmup.set(float(startup.get("warm_up", 0.0)))
        self.info.labels(worker, variant, kind).set(1)

    def watch_heartbeat(self, read_ts: Callable[[], float | None]) -> None:
        """Export the heartbeat's age, read from Redis at each scrape by ``read_ts`` (epoch seconds or None)."""
        self.registry.register(_HeartbeatAge(read_ts))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
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

