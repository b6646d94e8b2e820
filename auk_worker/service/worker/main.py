"""``auk worker``: one Celery worker process per GPU that loads the pipeline once and then serves jobs.

Order of start-up: settings are validated, the heartbeat goes up as ``starting``, the pipeline loads in this
process (nothing forks after CUDA is initialised), and only then does the consumer start; the heartbeat says
``ready`` once Celery is consuming. A pipeline that fails to load leaves the heartbeat at ``failed`` with the
error, and the process exits with status 1.

**One render at a time, off the consumer's thread.** Celery's threads pool with prefetch 1 a slot: the consumer's
event loop stays in the main thread (it answers ``inspect ping`` and remote control, sends the ``worker-heartbeat``
events Flower counts a worker online by, and handles signals) while a pool thread renders. One slot, or two with
store-behind (``board.py``: a group's uploads and records overlap the next group's render; the pipeline still
renders one call at a time).
The task's ``task-started`` event goes out as that thread takes the task. The pipeline was loaded (and its CUDA
graphs captured, its kernels compiled) in the main thread; the render thread pins the pipeline's CUDA device first
(the current device is per thread). Celery's time limits need the prefork pool and are not used.

The worker consumes only its variant's queues, recovery before interactive before bulk, and runs a bulk
feeder (``fairshare.py``) that releases staged batch tasks round-robin across keys. SIGTERM (or Ctrl-C) is a
graceful stop (``stopping.py``): the running job finishes within ``AUK_STOP_GRACE``, else goes back to the queue as
an operator stop that counts no crash; the log says which.

Identity: ``AUK_WORKER_ID`` (or ``--worker-id``, alias ``--hostname``) names the heartbeat; by default it is
``"<host name>-gpu<first CUDA index of the deploy config>"``, or ``"<host name>-cpu"`` without CUDA (the instant
pipeline never uses it), so two hosts, or two GPUs of one host, never share one. Every start also draws an
instance id (8 hex digits); a job's record names its holder as ``"<worker id>/<instance id>"``, so a container
that comes back under the same worker id after a crash is a new holder, and the job it died with counts a kill.

Health: a consumer bootstep (``ConsumerWatch``) ticks the heartbeat from Celery's event loop every second with
whether the consumer can take a message, so the heartbeat says ``stalled`` (not ready) when the consumer is not
consuming; a worker stalled for ``AUK_STALL_TIMEOUT`` seconds while Redis answers exits with status 3. The
heartbeat thread also runs the reaper (``recovery.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import socket
import sys
import threading
from pathlib import Path

import redis
from celery import Celery, bootsteps, signals

from auk_worker.errors import AuKError, ConfigError, InfraError
from auk_worker.service.worker.caches import use_compile_caches
from auk_worker.service.queues.celery_app import RENDER_TASK, make_celery, worker_queues
from auk_worker.service.queues.grouping import RENDER_GROUP_TASK
from auk_worker.service.queues.fairshare import FairShare, Feeder
from auk_worker.service.worker.board import OneRender, tasks_at_once
from auk_worker.service.worker.heartbeat import Heartbeat
from auk_worker.service.records.store import JobStore
from auk_worker.service.delivery.notify import Notifier
from auk_worker.service.delivery.webhooks.store import WebhookStore
from auk_worker.service.connect.logs import configure_logging, set_identity
from auk_worker.service.worker.metrics import WorkerMetrics
from auk_worker.service.worker.recovery import Reaper
from auk_worker.service.connect.redis import RedisFailedOver, ReplicationBarrier, redis_client
from auk_worker.service.delivery.replies import ReplySender
from auk_worker.service.connect.settings import VARIANTS, Settings, worker_id_or_none
from auk_worker.service.connect.storage import Storage
from auk_worker.service.worker.runtime import Pipeline, RenderRuntime
from auk_worker.service.worker.stopping import GracefulStop
from auk_worker.service.worker.tasks import register
from auk_worker.voice_cache import VoiceCache

log = logging.getLogger(__name__)

EXIT_STUCK = 3  # the consumer stopped consuming and did not come back while Redis answered
TICK_S = 1.0  # how often the consumer's event loop reports to the heartbeat


def default_worker_id(settings: Settings, deploy=None) -> str:
    """``"<host name>-gpu<first CUDA index of the deploy config>"``, or ``"<host name>-cpu"`` without CUDA."""
    host = socket.gethostname()
    if settings.pipeline == "instant":
        return f"{host}-cpu"
    import torch  # the real pipeline is about to load it anyway

    if not torch.cuda.is_available():
        return f"{host}-cpu"
    from auk_worker.deploy import load_deploy_config

    deploy = deploy or load_deploy_config(settings.deploy_config)
    return f"{host}-gpu{int(deploy.encoder.devices.split(',')[0])}"


def consumer_watch(heartbeat: Heartbeat) -> type[bootsteps.StartStopStep]:
    """A consumer bootstep that tells ``heartbeat`` every ``TICK_S`` from the event loop whether the consumer can
    take a message (its channel has prefetch room, so it has asked Redis for one or is about to). The loop does
    not tick while it reconnects; while a job renders (in the pool's thread) it ticks that it cannot consume, and
    the heartbeat, saying ``busy``, does not count that against it."""

    class ConsumerWatch(bootsteps.StartStopStep):
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def __init__(self, parent, **kwargs) -> None:
            super().__init__(parent, **kwargs)
            self.tref = None

        def start(self, c) -> None:
            self.tref = c.timer.call_repeatedly(TICK_S, self.tick, (c,))

        def stop(self, c) -> None:
            if self.tref is not None:
                self.tref.cancel()
                self.tref = None

        shutdown = stop

        @staticmethod
        def tick(c) -> None:
            consumer = c.task_consumer
            heartbeat.consumer_tick(consumer is not None and consumer.channel.qos.can_consume())

    return ConsumerWatch


def _exit_stuck(heartbeat: Heartbeat, reason: str) -> None:
    """Say why in the heartbeat and leave at once (from the heartbeat thread: the main thread is the stuck one);
    an idle worker holds no job, and its broker delivery, if any, comes back after the visibility timeout."""
    log.critical("worker %s: %s; exiting so that a supervisor starts it again", heartbeat.worker_id, reason)
    heartbeat.set("failed", error=reason)
    heartbeat.stop(remove=False)
    logging.shutdown()
    os._exit(EXIT_STUCK)


def _reaper(settings: Settings, store: JobStore) -> Reaper:
    """The reaper, sending through its own Celery app (it runs in the heartbeat thread)."""
    sender: Celery = make_celery(settings)

    def send(job_id: str, queue: str) -> None:
        sender.send_task(RENDER_TASK, args=[job_id], queue=queue)

    return Reaper(store, send)


def _note_delivery(records: JobStore, holder: str):
    """A ``task_received`` handler: the jobs of a message this worker received, before it starts them, are marked
    as delivered to it, so that the reaper can send them again if it dies first (``recovery.py``)."""

    def on_received(request=None, **_: object) -> None:
        if request is None or request.name not in (RENDER_TASK, RENDER_GROUP_TASK) or not request.args:
            return
        first = request.args[0]
        job_ids = [str(job_id) for job_id in first] if isinstance(first, list) else [str(first)]
        try:
            records.mark_delivered(job_ids, holder)
        except redis.RedisError as exc:  # the start that follows will find Redis down too, and retry
            log.warning("worker %s: delivery of %s not noted: %s", holder, ",".join(job_ids), exc)

    return on_received


def load_pipeline(settings: Settings, deploy=None) -> Pipeline:
    """The real pipeline from ``AUK_CHECKPOINT``; the instant fake for ``AUK_PIPELINE=instant``; for
    ``AUK_PIPELINE=random-release`` (benchmarks only: release-size random weights, audio is noise) the pipeline of
    ``auk_worker/pipeline/random_weights.py``, built on the deploy config's device at its precision."""
    if settings.pipeline == "instant":
        from auk_worker.service.worker.instant import InstantPipeline

        return InstantPipeline.from_env(settings.variant or "base")
    from auk_worker.deploy import load_deploy_config
    from auk_worker.pipeline import AuKPipeline, resolve_device, resolve_precision

    deploy = deploy or load_deploy_config(settings.deploy_config)
    if settings.pipeline == "random-release":
        from auk_worker.pipeline.random_weights import random_pipeline

        device = resolve_device(deploy.dit.devices)
        log.warning("worker: AUK_PIPELINE=random-release: random weights at release size, for benchmarks only")
        return random_pipeline(settings.variant or "base", device, resolve_precision(deploy.dit.dtype, device), deploy)
    return AuKPipeline.load(settings.checkpoint, deploy)


def run_worker(settings: Settings, deploy=None, *, worker_id: str | None = None, loglevel: str = "INFO") -> int:
    """Load the pipeline, then consume this variant's queues until stopped. Returns the exit status."""
    settings.require_storage()
    if settings.pipeline == "auk" and settings.checkpoint is None:
        raise ConfigError("AUK_CHECKPOINT (or --checkpoint) is required for a worker")
    worker_id = worker_id or settings.worker_id or default_worker_id(settings, deploy)
    instance = secrets.token_hex(4)
    if settings.storage_retry_deadline_s >= settings.visibility_timeout:
        log.warning("worker %s: AUK_STORAGE_RETRY_DEADLINE (%g s) is not below AUK_VISIBILITY_TIMEOUT (%d s): a job "
                    "waiting that long for storage is handed to a second worker as well", worker_id,
                    settings.storage_retry_deadline_s, settings.visibility_timeout)  # fmt: skip
    client = redis_client(settings, socket_connect_timeout=5, socket_timeout=30, health_check_interval=30)
    set_identity(worker=worker_id)
    store = JobStore(client, retain_s=settings.retain_records_s)  # the reaper's: a job it fails expires too
    heartbeat = Heartbeat(client, worker_id, settings.variant or "?", instance=instance, watch_consumer=True,
                          stall_timeout_s=settings.stall_timeout, on_beat=_reaper(settings, store).run)  # fmt: skip
    heartbeat.on_stuck = lambda reason: _exit_stuck(heartbeat, reason)
    heartbeat.start()
    log.info("worker %s: instance %s starting (pid %d)", worker_id, instance, os.getpid())
    try:
        use_compile_caches(settings.cache_dir)  # before the pipeline imports torch
        pipeline = load_pipeline(settings, deploy)
        if settings.variant is not None and pipeline.variant != settings.variant:
            raise ConfigError(
                f"AUK_VARIANT is {settings.variant} but the checkpoint is a {pipeline.variant} checkpoint"
            )
    except Exception as exc:  # noqa: BLE001 - the process boundary: report why, then exit non-zero
        log.exception("worker %s: the pipeline failed to load", worker_id)
        heartbeat.set("failed", error=f"{type(exc).__name__}: {exc}")
        heartbeat.stop(remove=False)
        return 1
    variant = pipeline.variant
    settings = dataclasses.replace(settings, variant=variant)
    heartbeat.set_variant(variant)

    storage = Storage(settings)
    try:
        storage.ensure_buckets()
    except InfraError as exc:  # jobs retry on their own; do not refuse to start over a storage blip
        log.warning("worker %s: storage not reachable at start (%s); jobs will retry", worker_id, exc)

    app = make_celery(settings)
    app.conf.broker_transport_options = {**app.conf.broker_transport_options, "fetch_holder": heartbeat.holder,
                                         "fault_kill_after_fetch": settings.fault_kill_after_fetch}  # fetch.py
    app.steps["consumer"].add(consumer_watch(heartbeat))
    records = JobStore(client, retain_s=settings.retain_records_s)
    notifier = Notifier(WebhookStore(client), storage, settings.presign_seconds)  # ended jobs' webhooks (outcome.py)
    barrier = ReplicationBarrier.from_settings(client, settings) if settings.redis_wait_replicas else None
    voice_cache = VoiceCache(settings.voice_cache_bytes)
    pipeline.voice_cache = voice_cache  # the pipeline keeps a voice's prepared pieces in the same cache
    stop = GracefulStop(records, heartbeat.holder, variant, _sender(app), settings.stop_grace_s, worker_id)
    at_once = tasks_at_once(settings.store_behind, pipeline.deploy.dit.max_num_seqs)
    metrics = WorkerMetrics()
    runtime = RenderRuntime(settings, OneRender(pipeline, on_turn=metrics.render_busy.inc), records, storage,
                            heartbeat, barrier=barrier, holder=heartbeat.holder,
                            replies=ReplySender.from_settings(settings), notifier=notifier, voice_cache=voice_cache,
                            stop=stop, metrics=metrics)  # fmt: skip
    _serve_metrics(runtime.metrics, settings, pipeline, client, heartbeat, worker_id)
    register(app, runtime)
    feeder = Feeder(FairShare(client, settings.bulk_queue_depth), _sender(app)).start()
    signals.task_postrun.connect(_after_bulk_task(feeder), weak=False)  # a bulk task done makes room in its queue

    def on_ready(**_: object) -> None:
        heartbeat.set("ready")
        log.info("worker %s: ready, consuming %s%s", worker_id, ", ".join(worker_queues(variant)),
                 "; stores one group while it renders the next" if at_once > 1 else "")  # fmt: skip

    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutting_down.connect(lambda how="Warm", **_: stop.requested(how), weak=False)
    signals.task_prerun.connect(_render_thread_setup(pipeline), weak=False)
    signals.task_received.connect(_note_delivery(store, heartbeat.holder), weak=False)
    if barrier is not None:

        def before_ack(task_id: str | None = None, args: tuple | None = None, **_: object) -> None:
            """A task's record transitions reach the replicas before its message is acknowledged: a failover
            cannot then take back a job's end once the broker forgot the job."""
            try:
                barrier.wait(f"task {task_id} {list(args or ())}")
            except (RedisFailedOver, redis.RedisError) as exc:  # the new master delivers the job again
                log.warning("worker %s: task %s ended on a master that was failed over: %s", worker_id,
                            task_id, exc)  # fmt: skip

        signals.task_postrun.connect(before_ack, weak=False, dispatch_uid="auk-replication-barrier")
    worker = app.Worker(
        hostname=f"auk@{worker_id}",
        queues=worker_queues(variant),
        pool_cls="threads",  # render threads; the consumer keeps the main thread (see the module docstring)
        concurrency=at_once,  # 2 with store-behind: one task stores while the next renders (board.py)
        prefetch_multiplier=1,
        loglevel=loglevel,
        without_gossip=True,
        without_mingle=True,
        without_heartbeat=False,  # worker-heartbeat events: Flower's "online", sent during renders too
        quiet=True,
    )
    try:
        worker.start()
    finally:
        feeder.stop()
        heartbeat.stop(remove=True)
    return int(worker.exitcode or 0)


def _after_bulk_task(feeder: Feeder):
    """A ``task_postrun`` handler: nudge the feeder when the task came from a bulk queue (an interactive one made
    no room there; the feeder's own wake-up covers the rest)."""

    def nudge(task=None, **_: object) -> None:
        routing_key = ((getattr(getattr(task, "request", None), "delivery_info", None) or {}).get("routing_key") or "")
        if not routing_key or routing_key.endswith(".bulk"):
            feeder.nudge()

    return nudge


def _render_thread_setup(pipeline: Pipeline):
    """A ``task_prerun`` handler (it runs in the render thread): pin the pipeline's CUDA device there once. Made in
    the loading thread: a device given as plain ``cuda`` is that thread's current device, while a new thread starts
    on device 0, and ``set_device`` takes only an index."""
    pinned = threading.local()
    torch = sys.modules.get("torch")  # only the real pipeline loads torch
    device = getattr(pipeline, "device", None)
    index = None
    if torch is not None and getattr(device, "type", None) == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()

    def setup(**_: object) -> None:
        if index is None or getattr(pinned, "done", False):
            return
        pinned.done = True
        torch.cuda.set_device(index)

    return setup


def _sender(app):
    def send(task: str, args: list, queue: str) -> None:
        app.send_task(task, args=args, queue=queue)

    return send


def _serve_metrics(metrics: WorkerMetrics, settings: Settings, pipeline: Pipeline, client: redis.Redis,
                   heartbeat: Heartbeat, worker_id: str) -> None:  # fmt: skip
    """Start-up times and identity into the metrics; their HTTP server on ``AUK_METRICS_PORT`` when it is set."""
    metrics.loaded(pipeline, worker_id, pipeline.variant, settings.pipeline)
    if settings.metrics_port is None:
        return

    def heartbeat_ts() -> float | None:
        ts = client.hget(heartbeat.key, "ts")
        return float(ts) if ts else None

    metrics.watch_heartbeat(heartbeat_ts)
    metrics.serve(settings.metrics_port, settings.metrics_host)
    log.info("worker %s: metrics on %s:%d", worker_id, settings.metrics_host, settings.metrics_port)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="auk worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (default: AUK_CHECKPOINT)")
    parser.add_argument("--variant", choices=VARIANTS, help="queues to consume; must match the checkpoint "
                        "(default: AUK_VARIANT, else the checkpoint's own)")  # fmt: skip
    parser.add_argument("--deploy-config", type=Path, help="deploy YAML (default: AUK_DEPLOY_CONFIG)")
    parser.add_argument("--worker-id", "--hostname", dest="worker_id",
                        help="this worker's id, which names its heartbeat (default: AUK_WORKER_ID, else "
                             "<host name>-gpu<first CUDA index of the deploy config>, or <host name>-cpu)")  # fmt: skip
    parser.add_argument("--loglevel", default="INFO", help="DEBUG, INFO, WARNING, ... (default INFO)")
    parser.add_argument("--pool", default="threads", choices=["threads"],
                        help="threads: one render thread in this process, where the model is loaded, beside the "
                             "consumer (the only choice)")  # fmt: skip
    return parser


def main_worker(argv: list[str] | None = None) -> int:
    """Entry point of ``auk worker`` (and ``python -m auk_worker.service.worker.main``)."""
    args = _parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        configure_logging(settings.log_format, args.loglevel)
        overrides: dict[str, object] = {}
        if args.checkpoint is not None:
            overrides["checkpoint"] = args.checkpoint
        if args.variant is not None:
            overrides["variant"] = args.variant
        if args.deploy_config is not None:
            overrides["deploy_config"] = args.deploy_config
        if args.worker_id is not None:
            overrides["worker_id"] = worker_id_or_none(args.worker_id, "--worker-id")
        settings = dataclasses.replace(settings, **overrides)
        return run_worker(settings, loglevel=args.loglevel.upper())
    except AuKError as exc:
        log.error("worker: %s", exc.message)
        return 2


if __name__ == "__main__":
    sys.exit(main_worker())
