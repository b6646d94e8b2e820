"""``auk worker``: one Celery worker process per GPU that loads the pipeline once and then serves jobs.

Order of start-up: settings are validated, the heartbeat goes up as ``starting``, the pipeline loads in this
process (the solo pool renders in the main process, so nothing forks after CUDA is initialised), and only then
does the consumer start; the heartbeat says ``ready`` once Celery is consuming. A pipeline that fails to load
leaves the heartbeat at ``failed`` with the error, and the process exits with status 1.

The worker consumes only its variant's queues, interactive before bulk. SIGTERM is Celery's warm shutdown: the
running job finishes and is acknowledged, then the process exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from pathlib import Path

import redis
from celery import signals

from auk_worker.errors import AuKError, ConfigError, InfraError
from auk_worker.service.celery_app import make_celery, worker_queues
from auk_worker.service.health import Heartbeat
from auk_worker.service.notify import notifying_store
from auk_worker.service.settings import VARIANTS, Settings
from auk_worker.service.storage import Storage
from auk_worker.service.tasks import Pipeline, RenderRuntime, register

log = logging.getLogger(__name__)


def load_pipeline(settings: Settings, deploy=None) -> Pipeline:
    """The real pipeline from ``AUK_CHECKPOINT``; the instant fake for ``AUK_PIPELINE=instant``; for
    ``AUK_PIPELINE=random-release`` (benchmarks only: release-size random weights, audio is noise) the pipeline of
    ``bench/models.py``, built on the deploy config's device at its precision."""
    if settings.pipeline == "instant":
        from auk_worker.service.instant import InstantPipeline

        return InstantPipeline.from_env(settings.variant or "base")
    from auk_worker.deploy import load_deploy_config
    from auk_worker.pipeline import AuKPipeline, resolve_device, resolve_precision

    deploy = deploy or load_deploy_config(settings.deploy_config)
    if settings.pipeline == "random-release":
        from bench.models import random_pipeline  # the repository root is on the path: a benchmark worker

        device = resolve_device(deploy.dit.devices)
        log.warning("worker: AUK_PIPELINE=random-release: random weights at release size, for benchmarks only")
        return random_pipeline(settings.variant or "base", device, resolve_precision(deploy.dit.dtype, device), deploy)
    return AuKPipeline.load(settings.checkpoint, deploy)


def run_worker(settings: Settings, deploy=None, *, hostname: str | None = None, loglevel: str = "INFO") -> int:
    """Load the pipeline, then consume this variant's queues until stopped. Returns the exit status."""
    settings.require_storage()
    if settings.pipeline == "auk" and settings.checkpoint is None:
        raise ConfigError("AUK_CHECKPOINT (or --checkpoint) is required for a worker")
    hostname = hostname or socket.gethostname()
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True, socket_connect_timeout=5,
                                  socket_timeout=30, health_check_interval=30)  # fmt: skip
    heartbeat = Heartbeat(client, hostname, settings.variant or "?").start()
    try:
        pipeline = load_pipeline(settings, deploy)
        if settings.variant is not None and pipeline.variant != settings.variant:
            raise ConfigError(
                f"AUK_VARIANT is {settings.variant} but the checkpoint is a {pipeline.variant} checkpoint"
            )
    except Exception as exc:  # noqa: BLE001 - the process boundary: report why, then exit non-zero
        log.exception("worker %s: the pipeline failed to load", hostname)
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
        log.warning("worker %s: storage not reachable at start (%s); jobs will retry", hostname, exc)

    app = make_celery(settings)
    store = notifying_store(client, storage, settings.presign_seconds)  # ended jobs enqueue their webhooks
    runtime = RenderRuntime(settings, pipeline, store, storage, heartbeat,
                            holder=f"{hostname}:{os.getpid()}")  # fmt: skip
    register(app, runtime)

    def on_ready(**_: object) -> None:
        heartbeat.set("ready")
        log.info("worker %s: ready, consuming %s", hostname, ", ".join(worker_queues(variant)))

    signals.worker_ready.connect(on_ready, weak=False)
    worker = app.Worker(
        hostname=f"auk@{hostname}",
        queues=worker_queues(variant),
        pool_cls="solo",
        concurrency=1,
        prefetch_multiplier=1,
        loglevel=loglevel,
        without_gossip=True,
        without_mingle=True,
        without_heartbeat=True,
        quiet=True,
    )
    try:
        worker.start()
    finally:
        heartbeat.stop(remove=True)
    return int(worker.exitcode or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="auk worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (default: AUK_CHECKPOINT)")
    parser.add_argument("--variant", choices=VARIANTS, help="queues to consume; must match the checkpoint "
                        "(default: AUK_VARIANT, else the checkpoint's own)")  # fmt: skip
    parser.add_argument("--deploy-config", type=Path, help="deploy YAML (default: AUK_DEPLOY_CONFIG)")
    parser.add_argument("--hostname", help="this worker's name in heartbeats (default: the host name)")
    parser.add_argument("--loglevel", default="INFO", help="DEBUG, INFO, WARNING, ... (default INFO)")
    parser.add_argument("--pool", default="solo", choices=["solo"],
                        help="solo: jobs run in this process, where the model is loaded (the only choice)")  # fmt: skip
    return parser


def main_worker(argv: list[str] | None = None) -> int:
    """Entry point of ``auk worker`` (and ``python -m auk_worker.service.worker``)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        settings = Settings.from_env()
        overrides: dict[str, object] = {}
        if args.checkpoint is not None:
            overrides["checkpoint"] = args.checkpoint
        if args.variant is not None:
            overrides["variant"] = args.variant
        if args.deploy_config is not None:
            overrides["deploy_config"] = args.deploy_config
        settings = dataclasses.replace(settings, **overrides)
        return run_worker(settings, hostname=args.hostname, loglevel=args.loglevel.upper())
    except AuKError as exc:
        log.error("worker: %s", exc.message)
        return 2


if __name__ == "__main__":
    sys.exit(main_worker())
