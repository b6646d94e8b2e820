"""What the pools are scaled on is the true backlog: the real API over HTTP, the session's Redis and SeaweedFS,
three keys' batches held by the fair share, then a real instant-pipeline worker draining them.

With a bulk queue depth of 2, the Celery list ``auk.base.bulk`` holds 2 tasks while 22 wait; ``GET /backlog``
(KEDA's ``metrics-api`` trigger) and ``auk_queue_backlog`` (``/metrics``) must say 22, follow the records while a
worker drains them, and reach 0 when nothing waits (KEDA's cue to scale back to zero).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.service.harness import ApiProcess, free_port

KEYS = ("key-backlog-alpha-0123456", "key-backlog-bravo-0123456", "key-backlog-charlie-012345")
DEPTH = 2
LINES = {KEYS[0]: 12, KEYS[1]: 7, KEYS[2]: 3}  # base bulk lines per key
FLASH_LINES = 4  # a flash batch of the first key: no flash worker runs, they stay waiting
INTERACTIVE = 2  # base interactive jobs


@pytest.fixture
def api(service_env: dict[str, str], tmp_path: Path) -> Iterator[ApiProcess]:
    env = {**service_env, "AUK_BULK_QUEUE_DEPTH": str(DEPTH), "AUK_API_KEYS": ",".join(KEYS)}
    proc = ApiProcess(env, free_port(), tmp_path / "api.log").start()
    yield proc
    proc.stop()


def _batch(http: httpx.Client, tag: str, lines: int, variant: str = "base") -> None:
    body = "\n".join(json.dumps({"instruction": f"{tag} {i}", "gen_seconds": 0.2, "num_inference_steps": 2,
                                 "variant": variant, "custom_id": f"{tag}-{i}"}) for i in range(lines))  # fmt: skip
    created = http.post("/v1/batches", content=body, headers={"Content-Type": "application/x-ndjson"})
    assert created.status_code == 202, created.text


def waiting_of(backlog: dict) -> dict:
    return {variant: {priority: counts["waiting"] for priority, counts in priorities.items()}
            for variant, priorities in backlog.items()}  # fmt: skip


def queued_records(client: redis.Redis) -> int:
    """Jobs whose record says queued, from the per-key status indexes: the backlog as the records tell it."""
    return sum(int(client.zcard(key)) for key in client.scan_iter("auk:owner:*:status:queued"))


def test_backlog_counts_what_the_fair_share_holds(api, service_env, start_worker, redis_client) -> None:
    clients = {key: httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
               for key in KEYS}  # fmt: skip
    try:
        for n, (key, lines) in enumerate(LINES.items()):
            _batch(clients[key], f"k{n}", lines)
        _batch(clients[KEYS[0]], "fl", FLASH_LINES, variant="flash")
        for i in range(INTERACTIVE):
            job = clients[KEYS[1]].post("/v1/jobs", json={"instruction": f"now {i}", "gen_seconds": 0.2,
                                                          "num_inference_steps": 2})  # fmt: skip
            assert job.status_code == 202, job.text
    finally:
        for http in clients.values():
            http.close()
    bulk = sum(LINES.values())
    deadline = time.monotonic() + 10
    while redis_client.llen("auk.base.bulk") < DEPTH or redis_client.llen("auk.flash.bulk") < DEPTH:
        assert time.monotonic() < deadline, api.log_tail()
        time.sleep(0.05)
    # What KEDA read before: the Celery list, never past the depth.
    assert redis_client.llen("auk.base.bulk") == DEPTH
    expected = {"base": {"interactive": INTERACTIVE, "bulk": bulk, "recovery": 0},
                "flash": {"interactive": 0, "bulk": FLASH_LINES, "recovery": 0}}  # fmt: skip
    assert waiting_of(httpx.get(f"{api.url}/backlog", timeout=10).json()) == expected
    assert queued_records(redis_client) == bulk + FLASH_LINES + INTERACTIVE
    metrics = httpx.get(f"{api.url}/metrics", timeout=10).text
    assert f'auk_queue_backlog{{priority="bulk",variant="base"}} {float(bulk)}' in metrics
    assert f'auk_queue_backlog{{priority="bulk",variant="flash"}} {float(FLASH_LINES)}' in metrics

    # A worker drains the base work: the backlog follows the records (a task taken but not yet marked running
    # is the one they may differ by) and ends at 0 for base, while flash's waits on.
    worker = start_worker("backlog-w1", AUK_BULK_QUEUE_DEPTH=str(DEPTH), AUK_INSTANT_STEP_DELAY="0.02")
    samples = []
    deadline = time.monotonic() + 120
    while True:
        backlog = httpx.get(f"{api.url}/backlog", timeout=10).json()
        queued = queued_records(redis_client) - FLASH_LINES
        base = sum(counts["waiting"] for counts in backlog["base"].values())
        samples.append((base, queued, sum(counts["rendering"] for counts in backlog["base"].values())))
        if base == 0 and queued == 0:
            break
        assert time.monotonic() < deadline, (samples[-5:], worker.log_tail())
        time.sleep(0.1)
    assert all(abs(base - queued) <= 1 for base, queued, _ in samples), samples
    assert len({base for base, _, _ in samples}) > 3, samples  # it was watched while it drained, not only at the ends
    assert {rendering for _, _, rendering in samples} <= {0, 1}  # one worker: at most one task at a time
    assert any(rendering for _, _, rendering in samples), samples  # ... and its task was seen
    assert waiting_of(backlog)["flash"] == expected["flash"]
    deadline = time.monotonic() + 30
    while (demand := httpx.get(f"{api.url}/backlog", timeout=10).json()["base"]["bulk"]["demand"]) != 0:
        assert time.monotonic() < deadline, demand  # the last task's worker goes back to ready: nothing keeps it
        time.sleep(0.1)
