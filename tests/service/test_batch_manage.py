"""Managing batches end to end: the real API and instant-pipeline worker processes over the session's Redis and
SeaweedFS. Listing (newest first, paginated, per key), cancel (queued jobs end canceled, a running group stops at
its next step, the manifest and error file say so) and the error file of lines that failed.

The API and the workers read ``config/auk-bulk.yaml``, so a batch goes out as groups of up to eight jobs: cancel is
tested on the group path.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import soundfile as sf

from auk_worker.cli import main as auk
from tests.service.batch_service import KEY_A, KEY_B, KEY_C, BatchService, batch_service
from tests.service.conftest import BUCKET
from tests.service.harness import REPO


@pytest.fixture(scope="module")
def svc(redis_server, s3_server, tmp_path_factory) -> Iterator[BatchService]:
    with batch_service(redis_server, s3_server, tmp_path_factory.mktemp("manage"), "test-manage",
                       DEPLOY_CONFIG=str(REPO / "config" / "auk-bulk.yaml")) as service:  # fmt: skip
        service.env["AUK_DEPLOY_CONFIG"] = str(REPO / "config" / "auk-bulk.yaml")
        yield service


def submit(http: httpx.Client, lines: list[dict]) -> dict:
    created = http.post("/v1/batches", content="\n".join(json.dumps(line) for line in lines),
                        headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
    assert created.status_code == 202, created.text
    return created.json()


def jsonl(url: str) -> list[dict]:
    response = httpx.get(url, timeout=30)
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def test_listing_is_per_key_newest_first_and_paginated(svc: BatchService, monkeypatch, capsys) -> None:
    with svc.client(KEY_B) as http:
        ids = []
        for n in range(3):  # Flash: no Flash worker runs, so they stay queued
            ids.append(submit(http, [{"instruction": f"b{n}", "gen_seconds": 1, "custom_id": f"{n}-{i}",
                                      "variant": "flash"} for i in range(n + 1)])["id"])  # fmt: skip
            time.sleep(0.005)
        first = http.get("/v1/batches", params={"limit": 2}).json()
        assert [b["id"] for b in first["data"]] == ids[:0:-1] and first["next_cursor"]
        assert [b["total"] for b in first["data"]] == [3, 2]
        assert first["data"][0]["counts"]["queued"] == 3 and first["data"][0]["status"] == "running"
        second = http.get("/v1/batches", params={"limit": 2, "cursor": first["next_cursor"]}).json()
        assert [b["id"] for b in second["data"]] == ids[:1] and second["next_cursor"] is None
        for cursor in ("x", "12", "nan-x", "-1-x"):
            bad = http.get("/v1/batches", params={"cursor": cursor})
            assert bad.status_code == 422 and "cursor" in bad.json()["error"]["message"]
        assert http.get("/v1/batches", params={"limit": 101}).status_code == 422
    with svc.client(KEY_C) as other:
        assert other.get("/v1/batches").json() == {"data": [], "next_cursor": None}
        assert other.post(f"/v1/batches/{ids[0]}/cancel").status_code == 404  # another key's batch is not there

    # Canceling a batch nothing has started: every job ends canceled and its results are stored at once.
    with svc.client(KEY_B) as http:
        canceled = http.post(f"/v1/batches/{ids[2]}/cancel")
        assert canceled.status_code == 200, canceled.text
        body = canceled.json()
        assert body["canceled_now"] == 3 and body["status"] == "done" and body["canceled_at"].endswith("Z")
        assert body["counts"]["canceled"] == 3 and body["counts"]["queued"] == 0
        again = http.post(f"/v1/batches/{ids[2]}/cancel")
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_finished"
        listed = http.get("/v1/batches", params={"limit": 1}).json()["data"][0]
        assert listed["id"] == ids[2] and listed["canceled_at"] == body["canceled_at"]
    manifest = jsonl(body["manifest"]["url"])
    assert [line["status"] for line in manifest] == ["canceled"] * 3
    errors = jsonl(body["error_file"]["url"])
    assert body["error_file"]["lines"] == 3 and body["error_file"]["key"].endswith(f"batch-{ids[2]}.errors.jsonl")
    assert [(e["custom_id"], e["status"], e["error"]["code"]) for e in errors] == [
        ("2-0", "canceled", "canceled"), ("2-1", "canceled", "canceled"), ("2-2", "canceled", "canceled")]

    # `auk cancel` from the command line does the same.
    monkeypatch.setenv("AUK_API_URL", svc.url)
    monkeypatch.setenv("AUK_API_KEY", KEY_B)
    capsys.readouterr()
    assert auk(["cancel", ids[1]]) == 0
    by_cli = json.loads(capsys.readouterr().out)
    assert by_cli["id"] == ids[1] and by_cli["counts"]["canceled"] == 2 and by_cli["manifest"]["url"]
    assert auk(["cancel", ids[1]]) == 1 and "already_finished" in capsys.readouterr().err


def test_a_byte_order_mark_before_the_first_line_is_not_part_of_it(svc: BatchService) -> None:
    """A JSONL file saved by a Windows editor starts with U+FEFF: the batch is taken whole, line 1 included."""
    body = "\ufeff" + "\r\n".join(json.dumps({"instruction": f"bom {i}", "gen_seconds": 1, "custom_id": f"bom-{i}",
                                              "variant": "flash"}) for i in range(2)) + "\r\n"  # fmt: skip
    with svc.client(KEY_C) as http:
        created = http.post("/v1/batches", content=body.encode("utf-8"),
                            headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
        assert created.status_code == 202, created.text
        assert created.json()["total"] == 2 and not created.json().get("errors"), created.json()
        http.post(f"/v1/batches/{created.json()['id']}/cancel")  # no Flash worker runs here


def test_the_error_file_holds_the_lines_that_failed(svc: BatchService) -> None:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(8000, np.float32) + 0.05, 16_000, format="WAV")
    with svc.client() as http:
        upload = http.post("/v1/uploads", files={"file": ("ref.wav", buf.getvalue(), "audio/wav")}).json()
        batch = submit(http, [
            {"instruction": "fine", "gen_seconds": 0.3, "custom_id": "ok-1"},
            {"instruction": "voice gone", "custom_id": "bad-1", "audio": {"upload_id": upload["upload_id"]}},
            {"instruction": "fine", "gen_seconds": 0.2, "custom_id": "ok-2"},
        ])  # fmt: skip
    # The clip disappears before any worker runs: that line fails at the worker, the others succeed.
    svc.s3.client().delete_object(Bucket=BUCKET, Key=f"{svc.prefix}/uploads/{upload['upload_id']}")
    svc.start_worker("manage-1")
    state = svc.wait_batch(batch["id"])
    svc.stop_workers()
    assert state["counts"]["succeeded"] == 2 and state["counts"]["failed"] == 1 and state["canceled_at"] is None
    errors = jsonl(state["error_file"]["url"])
    assert len(errors) == 1 and state["error_file"]["lines"] == 1
    assert errors[0]["custom_id"] == "bad-1" and errors[0]["status"] == "failed"
    assert errors[0]["error"]["code"] == "audio_not_found" and errors[0]["job_id"]
    manifest = jsonl(state["manifest"]["url"])
    assert {m["custom_id"]: m["status"] for m in manifest} == {"ok-1": "succeeded", "bad-1": "failed",
                                                               "ok-2": "succeeded"}  # fmt: skip
    assert state["error_file"]["key"] == state["manifest"]["key"].replace(".manifest.jsonl", ".errors.jsonl")


def test_cancel_stops_the_running_group_at_its_next_step_and_skips_the_queued_one(svc: BatchService) -> None:
    worker = svc.start_worker("manage-slow", AUK_INSTANT_STEP_DELAY="0.25")
    lines = ([{"instruction": f"a{i}", "gen_seconds": 0.2, "custom_id": f"a{i}", "num_inference_steps": 16}
              for i in range(8)]
             + [{"instruction": f"b{i}", "gen_seconds": 0.2, "custom_id": f"b{i}", "num_inference_steps": 12}
                for i in range(4)])  # fmt: skip
    with svc.client() as http:
        batch = submit(http, lines)
        jobs = svc.wait("a group running", lambda: [
            j for j in http.get("/v1/jobs", params={"batch_id": batch["id"], "limit": 50}).json()["data"]
            if j["status"] == "running" and (j["progress"] or {}).get("step", 0) >= 1] or None)  # fmt: skip
        running = {j["id"] for j in jobs}
        assert len(running) in (4, 8)  # one group of one schedule holds the worker
        asked = time.monotonic()
        canceled = http.post(f"/v1/batches/{batch['id']}/cancel").json()
        assert canceled["canceled_now"] == 12 and canceled["status"] == "done", canceled
        # The worker lets go within a step or so, not after the rest of the group's 12-16 steps of 0.25 s.
        svc.wait("the worker idle", lambda: worker.heartbeat(svc.redis).get("state") == "ready", timeout=10)
        assert time.monotonic() - asked < 2.0
        records = http.get("/v1/jobs", params={"batch_id": batch["id"], "limit": 50}).json()["data"]
    assert {r["status"] for r in records} == {"canceled"}
    for record in records:
        progress = record["progress"] or {}
        if record["id"] in running:
            assert record["attempts"] == 1 and progress["step"] < progress["total"], record
        assert record["result"] is None
    # Nothing was uploaded, and the group that was still queued was skipped when the worker met it.
    svc.wait("the queue drained", lambda: svc.redis.llen("auk.base.bulk") == 0, timeout=10)
    assert not [k for k in svc.s3.keys(BUCKET, f"{svc.prefix}/jobs/") if k.endswith(".wav")
                and any(r["id"] in k for r in records)]  # fmt: skip
    assert "canceled" in worker.log_tail(20_000)
    manifest = jsonl(canceled["manifest"]["url"])
    assert len(manifest) == 12 and {m["status"] for m in manifest} == {"canceled"}
    assert {e["custom_id"] for e in jsonl(canceled["error_file"]["url"])} == {line["custom_id"] for line in lines}
    with svc.client(KEY_A) as http:
        assert http.get(f"/v1/batches/{batch['id']}").json()["canceled_at"] == canceled["canceled_at"]
