"""A job's send through a broker that is away for a moment (``api/submit.py: send_render``), on real Redis servers.

The record is written to one Redis and the task sent to a broker Redis that is not up yet, as when a master dies
between the two writes and the sentinels have not named the next one: the send is tried again until the broker
answers; the record is looked for afterwards and a lost one answers 503 ``redis_failover``; a broker that stays
away past the window fails the record and answers 503.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

from api import submit
from api.deps import build_services
from auk_dev.local import RedisServer, free_port
from auk_worker.errors import InfraError
from auk_worker.service.connect.redis import RedisFailedOver
from auk_worker.service.queues.celery_app import make_celery
from auk_worker.service.records.jobs import JobStatus
from auk_worker.service.records.requests import JobRequest

OWNER = "send-retry"
REQUEST = JobRequest(instruction="The last train leaves at midnight.", gen_seconds=0.5)


@pytest.fixture
def late_broker(tmp_path: Path):
    """A broker Redis on a port chosen now and started by ``up()`` (from a thread, after a delay)."""
    server = RedisServer(tmp_path / "broker", port=free_port())
    yield server
    server.stop()


def services_sending_to(settings, broker: RedisServer):
    svc = build_services(settings)
    return dataclasses.replace(svc, celery=make_celery(dataclasses.replace(settings, redis_url=broker.url)))


def later(delay_s: float, *steps) -> threading.Thread:
    def run() -> None:
        time.sleep(delay_s)
        for step in steps:
            step()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_send_refused_for_a_moment_is_tried_again_until_the_broker_answers(settings, redis_client, late_broker):
    svc = services_sending_to(settings, late_broker)
    started = later(1.5, late_broker.start)
    record, created = submit.submit_job(svc, OWNER, REQUEST, "key-1")
    started.join()
    assert created
    assert svc.store.get(record.id).status == JobStatus.QUEUED
    messages = late_broker.client().lrange(record.queue, 0, -1)
    assert len(messages) == 1 and record.id in messages[0]


def test_a_record_lost_while_the_send_waited_answers_a_failover(settings, redis_client, late_broker):
    svc = services_sending_to(settings, late_broker)

    def lose_the_record() -> None:  # the new master never had it
        for key in redis_client.keys("auk:job:*"):
            redis_client.delete(key)

    started = later(1.5, lose_the_record, late_broker.start)
    with pytest.raises(RedisFailedOver, match="same Idempotency-Key"):
        submit.submit_job(svc, OWNER, REQUEST, "key-2")
    started.join()
    assert late_broker.client().llen(queue := submit.queue_name(REQUEST.variant, REQUEST.priority)) == 1, queue


def test_a_broker_away_past_the_window_fails_the_record(settings, redis_client, late_broker, monkeypatch):
    monkeypatch.setattr(submit, "SEND_WINDOW_S", 1.0)
    svc = services_sending_to(settings, late_broker)
    with pytest.raises(InfraError, match="could not be enqueued") as refused:
        submit.submit_job(svc, OWNER, REQUEST, "key-3")
    assert refused.value.code == InfraError.code
    (key,) = redis_client.keys("auk:job:*")
    record = svc.store.get(key.removeprefix("auk:job:"))
    assert record.status == JobStatus.FAILED and record.error["code"] == InfraError.code
