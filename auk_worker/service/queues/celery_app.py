"""The Celery app shared by the API (which only sends ``auk.render`` by name) and the worker (which runs it).

Reliability settings, each for a reason:

- ``task_acks_late`` + ``worker_prefetch_multiplier=1``: a job leaves Redis only after its WAV is stored and its
  record says so, and a worker holds one job at a time.
- ``task_reject_on_worker_lost``: a job whose process died is requeued rather than acknowledged.
- ``visibility_timeout`` (``AUK_VISIBILITY_TIMEOUT``): with the Redis broker, a job delivered but never
  acknowledged (its worker was SIGKILLed, the machine lost power) is redelivered after this many seconds. It must
  exceed the longest job, or a job still rendering is handed to a second worker as well. Every worker sweeps
  for expired deliveries every ``restore_interval`` seconds. This is the last resort: a dead worker's jobs are
  sent again within seconds by the reaper (``recovery.py``), and the late redelivery meets an ended record.
- ``queue_order_strategy=priority``: a worker polls its queues in the order given, so ``interactive`` drains
  before ``bulk``.
- No result backend: the job record in Redis is the result (one backend less to connect to, and ``send_task``
  builds no result to track).
- ``amqp=BrokerAMQP`` and ``broker_transport`` (``broker.py``): every broker connection frees its prefetch slot
  when an acknowledgement cannot reach Redis, and reconnects every couple of seconds, so a worker consumes again
  soon after Redis returns; a worker fetches atomically and every publisher wakes idle workers (``fetch.py``).
- A worker also consumes ``auk.<variant>.recovery`` before its other queues: the reaper (``recovery.py``) sends
  there the jobs whose worker died, so they run again next rather than behind the whole queue.
- Remote control and task events on: ``celery -A auk_worker.service.queues.celery_app inspect ping`` is answered by a
  worker busy or idle (it renders in a pool thread beside its consumer: ``worker/main.py``), and Flower
  (``celery -A auk_worker.service.queues.celery_app flower``) sees workers, their heartbeats and every task from
  ``task-sent`` (published by the API) to ``task-succeeded``.

Building the app connects to nothing. The module's ``app`` (what ``celery -A`` looks for) is built from the
environment on first access.
"""

from __future__ import annotations

from celery import Celery

from auk_worker.service.queues.broker import BrokerAMQP, transport_path
from auk_worker.service.connect.redis import broker_pool_limit, broker_transport_options, broker_url
from auk_worker.service.connect.settings import Settings

RENDER_TASK = "auk.render"
PRIORITIES = ("interactive", "bulk")  # polling order
RECOVERY = "recovery"  # the jobs the reaper sends again; polled first


def queue_name(variant: str, priority: str) -> str:
    return f"auk.{variant}.{priority}"


def worker_queues(variant: str) -> list[str]:
    """The queues a worker of ``variant`` consumes, highest priority first."""
    return [queue_name(variant, priority) for priority in (RECOVERY, *PRIORITIES)]


def restore_interval(visibility_timeout: int) -> int:
    return max(1, min(60, visibility_timeout // 3))


def make_celery(settings: Settings) -> Celery:
    url = broker_url(settings)
    app = Celery("auk", broker=url, amqp=BrokerAMQP, set_as_current=False)
    app.conf.update(
        broker_transport=transport_path(url),  # every connection, the producer pool's too (broker.py)
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout,
            "queue_order_strategy": "priority",
            # How often a worker sweeps for deliveries older than the visibility timeout (kombu's default
            # sweep is every 10 s x 10 calls); a third of the timeout, at most a minute, bounds the extra wait.
            "unacked_restore_interval": restore_interval(settings.visibility_timeout),
            "unacked_restore_throttle": 1,
            **broker_transport_options(settings),  # Sentinel: the master's name
        },
        broker_connection_retry_on_startup=True,
        broker_pool_limit=broker_pool_limit(settings),
        task_default_queue=queue_name(settings.variant or "base", "interactive"),
        worker_hijack_root_logger=False,
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_enable_remote_control=True,
        enable_utc=True,
    )
    return app


_app: Celery | None = None


def __getattr__(name: str) -> Celery:
    """``app`` for ``celery -A auk_worker.service.queues.celery_app`` (inspect, control, events, Flower): built from the
    environment's ``AUK_*`` settings on first access, never at import."""
    global _app
    if name == "app":
        if _app is None:
            _app = make_celery(Settings.from_env())
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
