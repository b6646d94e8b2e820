"""Queued jobs with no message are sent again (``ops/resend.py``), on a real Redis with a real worker.

A job never sent (its message lost with a failed-over master) is suspected by one pass and sent to the recovery
queue by the next; a job whose task waits deep in its key's staged list, beyond what the audit reads, is never
suspected; a suspect whose message turns up before the next pass is not sent. The worker then renders each job
once.
"""

from __future__ import annotations

import time

from prometheus_client import generate_latest

from api.metrics import ApiMetrics
from auk_worker.service.ops import audit
from auk_worker.service.ops.resend import Resender
from auk_worker.service.queues.celery_app import RECOVERY, RENDER_TASK, make_celery, queue_name
from auk_worker.service.queues.fairshare import FairShare
from auk_worker.service.records.jobs import JobStatus
from tests.service.test_worker import OWNER, make_record


def test_a_job_with_no_message_is_sent_again_by_the_second_pass_and_renders_once(
    redis_client, store, settings, start_worker, monkeypatch
) -> None:
    monkeypatch.setattr(audit, "GRACE_S", 0.0)
    monkeypatch.setattr(audit, "DEPTH", 2)
    app = make_celery(settings)
    sent: list[tuple[str, list, str]] = []

    def send(task: str, args: list, queue: str) -> None:
        sent.append((task, args, queue))
        app.send_task(task, args=args, queue=queue)

    def job(n: int):
        return store.create(make_record({"instruction": f"Line {n}.", "gen_seconds": 0.2, "seed": n}))[0]

    lost, late = job(0), job(1)  # never sent; sent between the two passes
    fillers = [job(n) for n in range(2, 5)]
    deep = job(5)
    bulk = queue_name("base", "bulk")
    FairShare(redis_client, 8).stage(OWNER, bulk, [(RENDER_TASK, [f.id]) for f in fillers] + [(RENDER_TASK, [deep.id])])

    resender = Resender(store, [OWNER], send)
    assert resender.run() == [] and sent == []  # suspected, not sent yet
    assert redis_client.pttl(resender.lock_key) > 0  # the period's pass is taken
    assert resender.run() == []  # a second process within the period does nothing
    assert redis_client.smembers(resender.suspects_key) == {lost.id, late.id}

    app.send_task(RENDER_TASK, args=[late.id], queue=late.queue)
    assert resender.pass_once() == [lost.id]
    assert sent == [(RENDER_TASK, [lost.id], queue_name("base", RECOVERY))]
    assert redis_client.smembers(resender.suspects_key) == set()
    assert resender.pass_once() == []  # every job accounted for
    metrics = generate_latest(ApiMetrics(redis_client, store.stats_key()).registry).decode()
    assert "auk_jobs_resent_total 1.0" in metrics

    start_worker("w1")
    ids = [lost.id, late.id, deep.id, *[f.id for f in fillers]]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if all(store.get(i).status == JobStatus.SUCCEEDED for i in ids):
            break
        time.sleep(0.2)
    records = {i: store.get(i) for i in ids}
    assert {i: r.status for i, r in records.items()} == dict.fromkeys(ids, JobStatus.SUCCEEDED)
    assert {i: r.attempts for i, r in records.items()} == dict.fromkeys(ids, 1)
