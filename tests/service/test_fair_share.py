"""Bulk work from different keys is interleaved: the real API over HTTP, a real instant-pipeline worker, the
session's Redis and SeaweedFS.

Key A sends a 60-line batch, then key B a 6-line one. With first-in-first-out bulk queues B's batch would wait for
all of A's; with the per-key staging and round-robin feeder (``auk_worker/service/queues/fairshare.py``) B's batch is done
while A's is still running, both have progressed, and the Celery bulk queue never holds more than its depth.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.harness import ApiProcess, free_port

KEY_A, KEY_B = "key-fair-alpha-0123456789", "key-fair-bravo-0123456789"
DEPTH = 2


@pytest.fixture
def fair_env(service_env: dict[str, str]) -> dict[str, str]:
    return {**service_env, "AUK_BULK_QUEUE_DEPTH": str(DEPTH), "AUK_INSTANT_STEP_DELAY": "0.03"}


@pytest.fixture
def api(fair_env: dict[str, str], tmp_path: Path) -> Iterator[ApiProcess]:
    proc = ApiProcess({**fair_env, "AUK_API_KEYS": f"{KEY_A},{KEY_B}"}, free_port(), tmp_path / "api.log").start()
    yield proc
    proc.stop()


def _batch(http: httpx.Client, tag: str, lines: int) -> str:
    body = "\n".join(json.dumps({"instruction": f"{tag} {i}", "gen_seconds": 0.2, "num_inference_steps": 2,
                                 "custom_id": f"{tag}-{i}"}) for i in range(lines))  # fmt: skip
    created = http.post("/v1/batches", content=body, headers={"Content-Type": "application/x-ndjson"})
    assert created.status_code == 202, created.text
    return created.json()["id"]


def test_two_keys_batches_progress_together(api, fair_env, start_worker, redis_client) -> None:
    worker = start_worker("fair-w1", AUK_BULK_QUEUE_DEPTH=str(DEPTH), AUK_INSTANT_STEP_DELAY="0.03")
    worker.wait_state(redis_client, "ready", timeout=60)
    depths: list[int] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            depths.append(redis_client.llen("auk.base.bulk"))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    alpha = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    bravo = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30)
    with alpha, bravo:
        a_id = _batch(alpha, "a", 60)
        time.sleep(0.3)  # A's batch is running when B's arrives
        b_id = _batch(bravo, "b", 6)
        deadline = time.monotonic() + 120
        while (b := bravo.get(f"/v1/batches/{b_id}").json())["status"] != "done":
            assert time.monotonic() < deadline, (b, worker.log_tail())
            time.sleep(0.05)
        a = alpha.get(f"/v1/batches/{a_id}").json()
        assert b["counts"]["succeeded"] == 6
        assert a["status"] == "running" and 0 < a["counts"]["succeeded"] < 60, a["counts"]
        while (a := alpha.get(f"/v1/batches/{a_id}").json())["status"] != "done":
            assert time.monotonic() < deadline, (a, worker.log_tail())
            time.sleep(0.1)
        assert a["counts"]["succeeded"] == 60
    watching.set()
    watcher.join()
    assert max(depths) <= DEPTH, max(depths)
    assert not redis_client.keys("auk:bulk:auk.base.bulk:owner:*")  # nothing left staged
    assert redis_client.hlen("auk:bulk:inflight") == 0
