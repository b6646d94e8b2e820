"""Store-behind (``auk_worker/service/worker/board.py``): a worker stores one group while it renders the next.

In process, two group tasks run on two threads as Celery's pool runs them, over the real Redis and SeaweedFS, with
a pipeline that notes when each render holds the GPU and a storage whose uploads take 0.3 s: the renders never
overlap, the second group's render runs while the first group's uploads do, and every job ends once with its own
object. Then a real worker process with ``AUK_STORE_BEHIND=on`` holds two groups at once, and its heartbeat lists
the jobs of both, so that the reaper never takes a job whose audio is still being stored.
"""

from __future__ import annotations

import threading
import time

from auk_worker.deploy import load_deploy_config
from auk_worker.service.connect.storage import Storage
from auk_worker.service.queues.celery_app import make_celery, queue_name
from auk_worker.service.queues.grouping import RENDER_GROUP_TASK
from auk_worker.service.records.jobs import JobStatus
from auk_worker.service.records.objects import result_key
from auk_worker.service.records.store import JobStore
from auk_worker.service.worker.board import OneRender, TaskBoard, tasks_at_once
from auk_worker.service.worker.group import render_group
from auk_worker.service.worker.instant import InstantPipeline
from auk_worker.service.worker.runtime import RenderRuntime
from tests.service.harness import REPO
from tests.service.test_worker import make_record, wait_terminal, wavs

UPLOAD_S = 0.3


class NotedPipeline(InstantPipeline):
    """The instant pipeline, noting (start, end) of every render call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renders: list[tuple[float, float]] = []

    def render_batch(self, requests, on_step=None):
        started = time.monotonic()
        time.sleep(0.2)  # a render that takes a while
        try:
            return super().render_batch(requests, on_step=on_step)
        finally:
            self.renders.append((started, time.monotonic()))


class SlowStorage(Storage):
    """Uploads that take ``UPLOAD_S``, each noted as (start, end)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.uploads: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def put_bytes(self, *args, **kwargs):
        started = time.monotonic()
        time.sleep(UPLOAD_S)
        try:
            return super().put_bytes(*args, **kwargs)
        finally:
            with self._lock:
                self.uploads.append((started, time.monotonic()))


def test_tasks_at_once() -> None:
    assert [tasks_at_once(mode, 8) for mode in ("auto", "on", "off")] == [2, 2, 1]
    assert [tasks_at_once(mode, 1) for mode in ("auto", "on", "off")] == [1, 2, 1]


def test_the_board_shows_every_running_tasks_jobs_and_gives_each_job_to_one_task() -> None:
    shown: list[list[str]] = []
    board = TaskBoard(shown.append)
    a, mine_a = board.started(["a1", "a2"])
    b, mine_b = board.started(["a2", "b1"])  # a2 again: the first task holds it
    assert (mine_a, mine_b) == (["a1", "a2"], ["b1"])
    board.ended(a)
    board.ended(b)
    assert shown == [["a1", "a2"], ["a1", "a2", "b1"], ["b1"], []]


def test_a_group_renders_while_the_previous_one_uploads_one_render_at_a_time(store, settings, redis_client) -> None:
    deploy = load_deploy_config(REPO / "config" / "auk.yaml")
    noted = NotedPipeline("base", deploy, 0.0)
    storage = SlowStorage(settings)
    rt = RenderRuntime(settings, OneRender(noted), store, storage)
    groups = []
    for _ in range(2):
        records = [store.create(make_record({"instruction": "Say hello.", "priority": "bulk"}))[0] for _ in range(3)]
        groups.append([r.id for r in records])

    def run(ids: list[str]) -> None:
        token, _ = rt.board.started(ids)
        try:
            assert render_group(rt, ids) == {}
        finally:
            rt.board.ended(token)

    first = threading.Thread(target=run, args=(groups[0],))
    first.start()
    while not noted.renders:  # the second task arrives while the first renders, as a prefetched one does
        time.sleep(0.01)
    second = threading.Thread(target=run, args=(groups[1],))
    second.start()
    first.join(30)
    second.join(30)

    (r1_start, r1_end), (r2_start, r2_end) = sorted(noted.renders)
    assert r1_end <= r2_start, noted.renders  # one render at a time
    first_uploads = sorted(storage.uploads)[:3]
    assert r2_start < max(end for _, end in first_uploads), (noted.renders, storage.uploads)  # overlapped
    assert rt.pipeline.busy_s >= (r1_end - r1_start) + (r2_end - r2_start) - 0.01
    for ids in groups:
        for record in store.get_many(ids):
            assert record.status == JobStatus.SUCCEEDED and record.attempts == 1
    assert sorted(wavs(storage, settings)) == sorted(result_key(settings.s3_prefix, i) for ids in groups for i in ids)
    assert rt.board.held() == []


def test_a_store_behind_worker_holds_two_groups_and_its_heartbeat_lists_both(
    start_worker, store: JobStore, settings, redis_client
) -> None:
    worker = start_worker("w-store-behind", AUK_STORE_BEHIND="on", AUK_INSTANT_STEP_DELAY="0.05")
    groups = []
    for _ in range(3):
        records = [store.create(make_record({"instruction": "Say hello.", "priority": "bulk"}))[0] for _ in range(2)]
        groups.append([r.id for r in records])
    app = make_celery(settings)
    for ids in groups:
        app.send_task(RENDER_GROUP_TASK, args=[ids], queue=queue_name("base", "bulk"))
    most_groups = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listed = set((redis_client.hget("auk:worker:w-store-behind", "job_id") or "").split(","))
        most_groups = max(most_groups, sum(1 for ids in groups if set(ids) <= listed))
        if all(r is not None and r.terminal for r in store.get_many([i for ids in groups for i in ids])):
            break
        time.sleep(0.02)
    for ids in groups:
        for job_id in ids:
            assert wait_terminal(store, job_id).status == JobStatus.SUCCEEDED, worker.log_tail()
    assert most_groups == 2, worker.log_tail()
    assert "stores one group while it renders the next" in worker.log_tail(1_000_000)
