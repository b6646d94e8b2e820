"""A worker's graceful stop (``auk_worker/service/stopping.py``) with real worker processes, the session's Redis and
SeaweedFS: SIGTERM lets a job that ends within ``AUK_STOP_GRACE`` finish; a job that does not is released back to
the queue as an operator stop, which never counts toward ``worker_crashed``; the log says which happened.
"""

from __future__ import annotations

import time

from auk_worker.service.records.jobs import JobStatus
from tests.service.test_worker import make_record, submit, wait_for, wait_terminal


def test_a_job_that_ends_within_the_grace_finishes_before_the_worker_stops(start_worker, store, settings,
                                                                           redis_client) -> None:  # fmt: skip
    worker = start_worker("w-stop-finish", AUK_INSTANT_STEP_DELAY="0.1", AUK_STOP_GRACE="20")
    worker.wait_state(redis_client, "ready", timeout=60)
    job = submit(store, settings, num_inference_steps=20)  # about 2 s of rendering
    wait_for(store, job.id, lambda r: r.status == JobStatus.RUNNING and r.progress, 20, "running")
    stopped = time.monotonic()
    assert worker.terminate(timeout=30) == 0, worker.log_tail()
    assert time.monotonic() - stopped < 15  # it waited for the job, not for the grace
    record = store.get(job.id)
    assert record.status == JobStatus.SUCCEEDED and record.attempts == 1 and record.kills == 0
    log = worker.log_tail(20000)
    assert f"job {job.id} may finish within the stop grace of 20 s" in log, log
    assert f"job {job.id} finished within the stop grace" in log, log
    assert redis_client.hlen("unacked") == 0  # acknowledged before the process left: no redelivery
    assert redis_client.llen("auk.base.recovery") == 0


def test_a_job_longer_than_the_grace_is_released_without_counting_a_crash(start_worker, store, settings,
                                                                          redis_client) -> None:  # fmt: skip
    """Stopped four times mid-render (one more than AUK_MAX_KILLS=3), the job is released each time and never
    failed ``worker_crashed``; then a worker lets it finish."""
    job = submit(store, settings, num_inference_steps=400)  # 20 s of rendering at 0.05 s a step
    for attempt in range(1, 5):
        worker = start_worker(f"w-stop-{attempt}", AUK_INSTANT_STEP_DELAY="0.05", AUK_STOP_GRACE="0.5")
        wait_for(store, job.id, lambda r: r.status == JobStatus.RUNNING and r.attempts == attempt and r.progress,
                 60, f"attempt {attempt} running")  # fmt: skip
        stopped = time.monotonic()
        assert worker.terminate(timeout=30) == 0, worker.log_tail()
        assert time.monotonic() - stopped < 10, "the release waited for the render"
        record = store.get(job.id)
        assert record.status == JobStatus.QUEUED and record.kills == 0 and not record.worker, record
        log = worker.log_tail(20000)
        assert f"stop grace of 0.5 s over with job {job.id} rendering; releasing it to the queue" in log, log
        assert f"job {job.id}: released back to auk.base.recovery" in log, log
    assert redis_client.llen("auk.base.recovery") == 1  # one copy waits, first in line
    finisher = start_worker("w-stop-finisher", AUK_INSTANT_STEP_DELAY="0.001")
    record = wait_terminal(store, job.id, timeout=60)
    assert record.status == JobStatus.SUCCEEDED and record.kills == 0 and record.attempts == 5, (
        record, finisher.log_tail())


def test_a_render_that_reaches_no_step_is_released_by_the_watcher(store, redis_client) -> None:
    """The render is stuck in one long call: past the grace and the release time, the watching thread releases the
    record itself (no kill), sends the job to the recovery queue and exits the process (here: records the exit)."""
    from auk_worker.service.worker.stopping import GracefulStop

    job = store.create(make_record({"instruction": "Stuck.", "gen_seconds": 1.0}))[0]
    holder = "w-stuck/0badcafe"
    assert store.start(job.id, holder) is not None
    sent: list[tuple[str, list, str]] = []
    exits: list[int] = []
    stop = GracefulStop(store, holder, "base", lambda *task: sent.append(task), grace_s=0.2, worker_id="w-stuck",
                        exit_process=exits.append, release_s=0.3)  # fmt: skip
    stop.task_started([job.id])
    stop.requested("Warm")
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [0] and stop.expired.is_set()
    record = store.get(job.id)
    assert record.status == JobStatus.QUEUED and record.kills == 0 and not record.worker, record
    assert sent == [("auk.render", [job.id], "auk.base.recovery")]
