"""A worker's life around its broker: Redis dropping mid-job and mid-group, a consumer that stops consuming, and
what the heartbeat says meanwhile.

The Redis-drop tests run their own redis-server with an append-only file, so that it can be stopped and started
again on the same port and data while the session's server goes on serving the other tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from kombu import Connection, Consumer, Exchange, Queue
from kombu.transport import redis as kombu_redis

from auk_worker.service.queues.broker import BrokerConnection, FetchingQoS
from auk_worker.service.queues.celery_app import RENDER_TASK, make_celery, queue_name
from auk_worker.service.queues.grouping import RENDER_GROUP_TASK
from auk_worker.service.worker.heartbeat import Heartbeat
from auk_worker.service.records.workers import public_view
from auk_worker.service.records.jobs import JobRecord, JobStatus
from auk_worker.service.records.store import JobStore
from auk_worker.service.connect.settings import Settings
from auk_worker.service.connect.storage import Storage
from auk_worker.service.records.objects import result_key
from tests.service.conftest import BUCKET
from tests.service.harness import (
    ApiProcess,
    RedisServer,
    S3Server,
    WorkerProcess,
    connection_env,
    free_port,
    wait_until,
)
from tests.service.test_probe import run_probe
from tests.service.test_worker import make_record, wait_for, wavs

OUTAGE_S = 15.0  # how long Redis stays away, as in the reproduction
CONSUMING_AGAIN_S = 10.0  # target: a worker consumes again within this long of Redis answering


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", persist=True).start()
    yield server
    server.stop()


def _env(own_redis: RedisServer, s3_server: S3Server, prefix: str) -> dict[str, str]:
    # The production visibility timeout: nothing here may lean on kombu redelivering after a few seconds.
    return connection_env(own_redis, s3_server, S3_BUCKET=BUCKET, S3_PREFIX=prefix, VARIANT="base",
                          PIPELINE="instant", VISIBILITY_TIMEOUT="3600", RETRY_BACKOFF="0.5", RETRY_MAX="6",
                          INSTANT_STEP_DELAY="0.05")  # fmt: skip


def restart_after(server: RedisServer, seconds: float) -> float:
    """Stop ``server`` (its append-only file keeps every write), start it again on the same port after
    ``seconds``; returns when it answered again (``time.time()``)."""
    server.stop()
    time.sleep(seconds)
    server.start()
    return time.time()


def create(store: JobStore, **body) -> JobRecord:
    record, created = store.create(make_record({"instruction": "Say hello.", "gen_seconds": 0.5, **body}))
    assert created
    return record


def _finish(store: JobStore, storage: Storage, settings: Settings, records: list[JobRecord], back_at: float,
            worker: WorkerProcess) -> None:  # fmt: skip
    """Every job succeeded once, with one WAV each; the worker took its first job within the target of Redis
    answering again; no message waits, and what the broker still holds unacknowledged is of ended jobs."""
    done = [wait_for(store, r.id, lambda r: r.terminal, 90, "a terminal state") for r in records]
    assert all(r.status == JobStatus.SUCCEEDED for r in done), [(r.id, r.status, r.error) for r in done]
    assert all(r.kills == 0 for r in done)
    assert sorted(wavs(storage, settings)) == sorted(r.result["key"] for r in done)  # each attempt its own key
    first_start = min(float(r.held_at) for r in done if float(r.held_at) > back_at)
    print(f"\nconsuming again {first_start - back_at:.2f} s after Redis answered")
    assert first_start - back_at < CONSUMING_AGAIN_S, worker.log_tail(20_000)
    client = store.redis
    waiting = sum(client.llen(q) for q in (queue_name("base", p) for p in ("recovery", "interactive", "bulk")))
    assert waiting == 0
    # The delivery whose acknowledgement Redis never got stays until the visibility timeout, then meets an ended
    # record; nothing else is left.
    for raw in client.hvals("unacked"):
        assert any(r.id in raw for r in done)


def test_redis_drop_mid_job_worker_consumes_again(own_redis, s3_server, tmp_path) -> None:
    """The issue's reproduction: a long job, Redis stopped mid-render, back 15 s later, three more jobs."""
    env = _env(own_redis, s3_server, "drop-job")
    settings = Settings.from_env(env)
    store, storage = JobStore(own_redis.client()), Storage(settings)
    storage.ensure_buckets()
    worker = WorkerProcess(env, "w-drop", tmp_path).start()
    try:
        worker.wait_state(store.redis, "ready", timeout=60)
        long_job = create(store, num_inference_steps=200)  # 10 s of rendering
        make_celery(settings).send_task(RENDER_TASK, args=[long_job.id], queue=long_job.queue)
        wait_for(store, long_job.id, lambda r: (r.progress or {}).get("step", 0) >= 20, 30, "step 20")

        back_at = restart_after(own_redis, OUTAGE_S)
        store = JobStore(own_redis.client())
        later = [create(store) for _ in range(3)]
        for record in later:
            make_celery(settings).send_task(RENDER_TASK, args=[record.id], queue=record.queue)
        _finish(store, storage, settings, [long_job, *later], back_at, worker)
        redone = store.get(long_job.id)
        assert redone.attempts == 2  # its first attempt ended when Redis went away; the reaper sent it again
        log = worker.log_tail(200_000)
        assert "let go of it; sent again" in log
        assert worker.wait_state(store.redis, "ready", timeout=15)["state"] == "ready"
        assert worker.proc.poll() is None
    finally:
        worker.terminate(timeout=30)


def test_redis_drop_mid_group_every_job_done_once(own_redis, s3_server, tmp_path) -> None:
    env = _env(own_redis, s3_server, "drop-group")
    settings = Settings.from_env(env)
    store, storage = JobStore(own_redis.client()), Storage(settings)
    storage.ensure_buckets()
    worker = WorkerProcess(env, "w-drop-group", tmp_path).start()
    try:
        worker.wait_state(store.redis, "ready", timeout=60)
        group = [create(store, priority="bulk", num_inference_steps=200, gen_seconds=s) for s in (0.3, 0.4, 0.5)]
        make_celery(settings).send_task(RENDER_GROUP_TASK, args=[[r.id for r in group]],
                                        queue=queue_name("base", "bulk"))  # fmt: skip
        wait_for(store, group[0].id, lambda r: (r.progress or {}).get("step", 0) >= 20, 30, "step 20")

        back_at = restart_after(own_redis, OUTAGE_S)
        store = JobStore(own_redis.client())
        later = [create(store) for _ in range(3)]
        for record in later:
            make_celery(settings).send_task(RENDER_TASK, args=[record.id], queue=record.queue)
        _finish(store, storage, settings, [*group, *later], back_at, worker)
        assert worker.proc.poll() is None
    finally:
        worker.terminate(timeout=30)


def test_a_wedged_consumer_is_not_ready_within_15_s_then_exits_and_its_restart_consumes(
    own_redis, s3_server, tmp_path, monkeypatch
) -> None:
    """Whatever stops a consumer, health says so: here a ``sitecustomize`` wedges the worker's broker channel after
    its first acknowledgement (it can take no further message, as kombu's own Redis QoS could after an ack that
    failed while Redis was away). Within 15 s its heartbeat says ``stalled``, /readyz counts no ready worker and
    the probe fails; after ``AUK_STALL_TIMEOUT`` it exits 3, and started again (as a supervisor would) it
    consumes."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import auk_worker.service.queues.broker as b\n"
        "class Wedged(b.FetchingQoS):\n"
        "    def ack(self, delivery_tag):\n"
        "        super().ack(delivery_tag)\n"
        "        self.can_consume = lambda: False\n"
        "b.Channel.QoS = Wedged\n"
    )
    env = {**_env(own_redis, s3_server, "wedged"), "AUK_STALL_TIMEOUT": "10"}
    settings = Settings.from_env(env)
    store, storage = JobStore(own_redis.client()), Storage(settings)
    storage.ensure_buckets()
    monkeypatch.setenv("PYTHONPATH", str(shim))
    worker = WorkerProcess(env, "w-wedged", tmp_path).start()
    monkeypatch.delenv("PYTHONPATH")
    api = ApiProcess({**env, "AUK_API_KEYS": "key-wedged-0123456789"}, free_port(), tmp_path / "api.log").start()
    try:
        worker.wait_state(store.redis, "ready", timeout=60)
        long_job = create(store)
        make_celery(settings).send_task(RENDER_TASK, args=[long_job.id], queue=long_job.queue)
        wait_for(store, long_job.id, lambda r: r.terminal, 60, "the first job done")
        done_at = time.time()
        client = own_redis.client()
        wait_until("the heartbeat to say stalled", lambda: worker.heartbeat(client).get("state") == "stalled", 15,
                   worker.proc, worker.log)  # fmt: skip
        stalled_after = time.time() - done_at
        readyz = httpx.get(f"{api.url}/readyz", timeout=10).json()
        assert readyz["workers_ready"] == 0 and readyz["workers"][0]["state"] == "stalled", readyz
        probe = run_probe(own_redis.url, "w-wedged")
        assert probe.returncode == 1 and "stalled" in probe.stdout
        print(f"\nwedged consumer: not ready {stalled_after:.1f} s after its last job")
        assert stalled_after < 15
        assert worker.wait_exit(30) == 3  # AUK_STALL_TIMEOUT: a supervisor starts it again
        assert "has not consumed" in client.hget("auk:worker:w-wedged", "error")

        restarted = WorkerProcess(env, "w-wedged", tmp_path).start()  # without the shim: the service as shipped
        try:
            later = create(store)
            make_celery(settings).send_task(RENDER_TASK, args=[later.id], queue=later.queue)
            for record in (long_job, later):
                assert wait_for(store, record.id, lambda r: r.terminal, 60, "done").status == JobStatus.SUCCEEDED
        finally:
            restarted.terminate(timeout=30)
    finally:
        worker.terminate(timeout=30)
        api.stop()


# ------------------------------------------------------------------------------------------------ the root cause


def _one_delivery(conn: Connection, queue: Queue):
    """Publish one message on ``queue`` and receive it with prefetch 1; returns (message, the channel's QoS)."""
    conn.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])
    got = []
    consumer = Consumer(conn.default_channel, [queue], callbacks=[lambda body, message: got.append(message)])
    consumer.qos(prefetch_count=1)
    consumer.consume()
    conn.drain_events(timeout=5)
    assert len(got) == 1
    return got[0], conn.default_channel.qos


def test_an_ack_that_cannot_reach_redis_frees_the_prefetch_slot(tmp_path) -> None:
    """Kombu's own Redis QoS keeps a delivery whose ack failed, so a prefetch-1 consumer never asks for another
    message (the stall of issue 32); ``ReleasingQoS`` (the service's ``FetchingQoS`` builds on it) frees the slot
    and the error still reaches the caller."""
    queue = Queue("lifecycle-qos", Exchange("lifecycle-qos", type="direct"), routing_key="lifecycle-qos")
    server = RedisServer(tmp_path / "redis").start()
    try:
        for connection_cls, qos_cls in ((Connection, kombu_redis.QoS), (BrokerConnection, FetchingQoS)):
            with connection_cls(server.url) as conn:
                message, qos = _one_delivery(conn, queue)
                assert type(qos) is qos_cls and not qos.can_consume()
                server.stop()
                try:
                    with pytest.raises(redis.ConnectionError):
                        message.ack()
                    assert qos.can_consume() is (qos_cls is FetchingQoS)
                    message.ack_log_error(kombu_redis.logger, conn.connection_errors)  # what Celery calls: logs
                finally:
                    server.start()
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------------ health


def test_a_consumer_that_stops_consuming_is_not_ready_within_15_s(redis_client) -> None:
    """The heartbeat follows the consumer's ticks: an idle worker whose consumer cannot take a message (no credit,
    a wedged channel) or whose event loop stopped ticking is ``stalled``, with Redis answering all along; one that
    stays so for the stall timeout is told to exit."""
    stuck: list[str] = []
    heartbeat = Heartbeat(redis_client, "w-stall", "base", instance="0badcafe", interval_s=0.5, watch_consumer=True,
                          stall_after_s=3.0, stall_timeout_s=6.0, on_stuck=stuck.append).start()  # fmt: skip
    try:
        heartbeat.set("ready")
        for _ in range(8):  # a consuming loop ticks every second
            heartbeat.consumer_tick(True)
            time.sleep(0.5)
        assert redis_client.hget("auk:worker:w-stall", "state") == "ready"

        stalled_at = time.monotonic()
        seen: dict[str, str] = {}

        def not_ready() -> bool:
            heartbeat.consumer_tick(False)  # the loop runs, but the channel has no room for a message
            seen.update(redis_client.hgetall("auk:worker:w-stall"))
            return seen.get("state") == "stalled"

        wait_until("the heartbeat to say stalled", not_ready, 15)
        print(f"\nnot ready {time.monotonic() - stalled_at:.1f} s after the consumer stopped consuming")
        assert "not consuming" in seen["error"]
        assert public_view(seen)["state"] == "stalled" and "job_id" not in public_view(seen)
        wait_until("the stall timeout", lambda: stuck, 15)
        assert "has not consumed" in stuck[0]

        heartbeat.set("busy", job_id="job-1")  # a rendering worker is not judged by ticks: its loop is in the job
        time.sleep(4)
        assert redis_client.hget("auk:worker:w-stall", "state") == "busy"
        heartbeat.set("ready")  # the job ended: a fresh grace period, then the ticks must come back
        heartbeat.consumer_tick(True)
        time.sleep(1)
        assert redis_client.hget("auk:worker:w-stall", "state") == "ready"
        stopped_at = time.monotonic()  # now the loop stops ticking altogether (blocked, or reconnecting)
        wait_until("the heartbeat to say stalled", lambda: redis_client.hget("auk:worker:w-stall", "state") ==
                   "stalled", 15)  # fmt: skip
        print(f"not ready {time.monotonic() - stopped_at:.1f} s after the event loop stopped ticking")
    finally:
        heartbeat.stop(remove=True)
