"""The workers' registry as its readers see it: the heartbeat hash ``auk:worker:{worker id}`` that each worker
writes (``service/worker/heartbeat.py``), the index ``auk:workers`` of their ids, and the views taken of them by the
API's readiness, the probe and the metrics. Reading needs no worker code, so the API imports this, not the worker.
"""

from __future__ import annotations

import time
from typing import Any

import redis

STATES = ("starting", "ready", "busy", "stalled", "failed")
SERVING_STATES = ("ready", "busy")  # a worker with its pipeline loaded that is taking (or rendering) jobs


def heartbeat_key(worker_id: str, namespace: str = "auk") -> str:
    return f"{namespace}:worker:{worker_id}"


def public_view(beat: dict[str, str], now: float | None = None) -> dict[str, Any]:
    """What an unauthenticated reader may see of a heartbeat: the worker's id, state, variant and the age of its
    heartbeat in seconds; never a job id."""
    try:
        age = round((time.time() if now is None else now) - float(beat.get("ts", "")), 1)
    except ValueError:
        age = None
    return {"id": beat.get("id", ""), "state": beat.get("state", ""), "variant": beat.get("variant", ""),
            "age_s": age}  # fmt: skip


def live_variants(beats: list[dict[str, Any]]) -> tuple[dict[str, list[str]], int]:
    """From ``read_heartbeats``: each variant the live workers serve or are loading (state other than ``failed``)
    with their ids, and how many live workers there are. A worker that does not know its variant yet (started
    without ``AUK_VARIANT``, still loading its checkpoint) is listed under ``"?"``."""
    variants: dict[str, list[str]] = {}
    live = [beat for beat in beats if beat.get("state") != "failed"]
    for beat in live:
        variants.setdefault(beat.get("variant") or "?", []).append(beat.get("id", ""))
    return variants, len(live)


def read_heartbeats(client: redis.Redis, namespace: str = "auk") -> list[dict[str, Any]]:
    """Every live worker's heartbeat (the API's readiness check); stale ids are pruned from the index."""
    index = f"{namespace}:workers"
    worker_ids = sorted(client.smembers(index))
    if not worker_ids:
        return []
    pipe = client.pipeline(transaction=False)
    for worker_id in worker_ids:
        pipe.hgetall(heartbeat_key(worker_id, namespace))
    beats = []
    for worker_id, beat in zip(worker_ids, pipe.execute()):
        if beat:
            beats.append({"id": worker_id, **beat})
        else:
            client.srem(index, worker_id)
    return beats
