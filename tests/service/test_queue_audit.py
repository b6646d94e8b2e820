"""The queue audit (``audit.py``): queued jobs with no message, and the oldest queued job's age, on a real Redis.

Jobs whose message waits in a queue, sits in the unacknowledged set (a worker fetched it) or is staged for the
bulk feeder are accounted for; a queued job whose message was dropped is counted once it has been queued longer
than the grace, and the count reaches the API's ``/metrics`` and ``/readyz``. The reads stay bounded with 5,000
queued jobs in front of the oldest ones.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from prometheus_client import generate_latest

from auk_worker.service.ops import audit
from auk_worker.service.ops.audit import CachedAudit, audit_queue
from auk_worker.service.queues.celery_app import RENDER_TASK, make_celery, queue_name
from auk_worker.service.records.requests import JobRequest
from auk_worker.service.queues.fairshare import FairShare
from api.deps import build_services
from api.metrics import ApiMetrics
from api.submit import submit_batch
from tests.service.test_worker import OWNER, make_record


def test_a_queued_job_without_a_message_is_counted_and_reported(redis_client, store, settings, monkeypatch) -> None:
    app = make_celery(settings)
    jobs = [store.create(make_record({"instruction": f"Line {i}.", "gen_seconds": 0.2}))[0] for i in range(4)]
    in_queue, fetched, staged, lost = jobs
    app.send_task(RENDER_TASK, args=[in_queue.id], queue=in_queue.queue)
    app.send_task(RENDER_TASK, args=[fetched.id], queue=fetched.queue)
    raw = redis_client.rpop(fetched.queue)  # what the fetch script moves into the unacknowledged set
    tag = json.loads(raw)["properties"]["delivery_tag"]
    redis_client.hset("unacked", tag, f'[{raw},"","{fetched.queue}"]')
    FairShare(redis_client, 8).stage(OWNER, "auk.base.bulk", [(RENDER_TASK, [staged.id])])
    # ``lost`` was never sent: its message is nowhere.

    now = time.time()
    fresh = audit_queue(redis_client, [OWNER], now=now)
    assert fresh.queued_without_message == 0 and fresh.checked == 4  # within the grace: not counted yet
    later = audit_queue(redis_client, [OWNER], now=now + audit.GRACE_S + 5)
    assert later.queued_without_message == 1 and later.oldest_queued_age_s >= audit.GRACE_S + 5

    # The API's metric and /readyz detail read the same (cached) audit.
    monkeypatch.setattr(audit, "GRACE_S", 0.0)
    cached = CachedAudit(redis_client, [OWNER])
    text = generate_latest(ApiMetrics(redis_client, store.stats_key(), audit=cached).registry).decode()
    assert "auk_jobs_queued_without_message 1.0" in text and "auk_jobs_oldest_queued_age_seconds" in text
    assert cached.get().as_dict()["queued_without_message"] == 1
    monkeypatch.undo()
    store.start(lost.id, "w-test/0000")  # started since: no longer queued, not counted
    assert audit_queue(redis_client, [OWNER], now=now + audit.GRACE_S + 5).queued_without_message == 0

    # Bounded: 5,000 newer queued jobs and their messages do not change what is read or found.
    for i in range(5000):
        job = store.create(make_record({"instruction": f"More {i}.", "gen_seconds": 0.2}))[0]
        app.send_task(RENDER_TASK, args=[job.id], queue=job.queue)
    started = time.perf_counter()
    busy = audit_queue(redis_client, [OWNER], now=time.time() + audit.GRACE_S + 5)
    took_ms = (time.perf_counter() - started) * 1000
    assert busy.checked == audit.OLDEST and busy.queued_without_message == 0
    print(f"\naudit with 5,004 queued jobs: {took_ms:.1f} ms")



def test_a_large_batch_waiting_in_its_staged_list_is_not_counted(redis_client, settings, monkeypatch) -> None:
    """The staged tasks of a batch are in line order (``grouping.in_line_order``), so its oldest queued jobs are
    among the first tasks the audit reads, however the lines' lengths sort them into groups."""
    monkeypatch.setattr(audit, "OLDEST", 10)
    monkeypatch.setattr(audit, "DEPTH", 400)  # of about 750 tasks: the lines' lengths scatter them through the list
    svc = build_services(dataclasses.replace(settings, deploy_config=Path("config/auk-bulk.yaml")))  # groups of 8
    lines = [(n, JobRequest(instruction=f"Line {n}.", gen_seconds=0.2 + (n * 7919 % 50) / 10, custom_id=f"l-{n}"))
             for n in range(6000)]  # fmt: skip
    created, _ = submit_batch(svc, OWNER, lines, [])
    staged = svc.fair.staged(OWNER, queue_name("base", "bulk"))
    assert staged > 2 * audit.DEPTH - 100, staged
    firsts = [min(int(r.split("-")[1]) for r in task_custom_ids(svc, task))
              for task in redis_client.lrange(f"auk:bulk:{queue_name('base', 'bulk')}:owner:{OWNER}", 0, -1)]
    assert firsts == sorted(firsts)  # released from the first lines towards the last
    later = audit_queue(redis_client, [OWNER], now=time.time() + audit.GRACE_S + 5)
    assert later.checked == audit.OLDEST and later.queued_without_message == 0, later
    assert created["total"] == 6000


def task_custom_ids(svc, task: str) -> list[str]:
    args = json.loads(task)["args"]
    ids = args[0] if isinstance(args[0], list) else args
    return [svc.store.get(job_id).custom_id for job_id in ids]
