"""``python -m auk_worker.service.ops.probe``: a worker container's health probe, read from its heartbeat in Redis.

A solo Celery worker renders in its main thread and cannot answer a ping while busy, so the probe asks Redis
instead: it reads this worker's heartbeat hash ``auk:worker:<AUK_WORKER_ID>``, which ``worker/heartbeat.py``
rewrites every 2 s from a thread that keeps running through a long job, and exits 0 or 1, printing one line that says why. Without
``AUK_WORKER_ID`` it reads the one heartbeat whose ``host`` is this host name (a container's own worker). The
kubelet (an exec probe) or a compose healthcheck records that line. It imports redis and the settings module,
never torch, so a probe costs a fraction of a second.

Two questions, one per flag:

- default (readiness, start-up): is this worker serving? Its state is ``ready`` or ``busy`` and its ``ts`` is
  younger than ``--max-age`` seconds. ``starting`` (pipeline loading), ``failed``, a stale or missing heartbeat,
  or Redis out of reach: not serving.
- ``--live`` (liveness): is this process still working? Any state but ``failed`` with a fresh ``ts`` passes, so
  a worker busy on a long job is never restarted for it. When Redis cannot be reached the probe passes and says
  so: restarting every worker does not bring Redis back, and the readiness probe already reports it.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from auk_worker.errors import ConfigError
from auk_worker.service.records.workers import SERVING_STATES, heartbeat_key, read_heartbeats
from auk_worker.service.connect.redis import redis_client
from auk_worker.service.connect.settings import Settings

DEFAULT_MAX_AGE_S = 15.0
REDIS_TIMEOUT_S = 3.0  # well inside a probe's timeoutSeconds


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str


def judge(beat: Mapping[str, str], now: float, max_age_s: float, live: bool) -> Verdict:
    """The verdict on one heartbeat hash (empty when the key is missing or expired)."""
    if not beat:
        return Verdict(False, "no heartbeat (the worker has not started, or stopped writing for longer than its TTL)")
    state = beat.get("state", "")
    if state == "failed":
        return Verdict(False, f"worker failed: {beat.get('error') or 'no error recorded'}")
    try:
        age = now - float(beat.get("ts", ""))
    except ValueError:
        return Verdict(False, f"heartbeat has no valid ts (state {state!r})")
    if age > max_age_s:
        return Verdict(False, f"heartbeat is stale: state {state!r}, written {age:.1f} s ago (limit {max_age_s:g} s)")
    if live or state in SERVING_STATES:
        job = f", job {beat['job_id']}" if beat.get("job_id") else ""
        return Verdict(True, f"{state}{job}, heartbeat {age:.1f} s old")
    return Verdict(False, f"not serving yet: state {state!r}, heartbeat {age:.1f} s old")


def own_worker_id(client: redis.Redis, host: str) -> str | None:
    """The one worker whose heartbeat names ``host`` as its host (a container's own worker when ``AUK_WORKER_ID``
    is left to its default); None when there is none, or several (say one host running a worker per GPU)."""
    ids = [beat["id"] for beat in read_heartbeats(client) if beat.get("host") == host]
    return ids[0] if len(ids) == 1 else None


def probe(worker_id: str | None, settings: Settings, max_age_s: float, live: bool) -> Verdict:
    """The verdict on ``worker_id``'s heartbeat; without an id, on the one worker of this host (``own_worker_id``)."""
    client = redis_client(settings, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S)
    try:
        if worker_id is None:
            worker_id = own_worker_id(client, socket.gethostname())
            if worker_id is None:
                return Verdict(False, f"no single worker heartbeat names host {socket.gethostname()!r}: set "
                                      "AUK_WORKER_ID or --worker-id")  # fmt: skip
        beat = client.hgetall(heartbeat_key(worker_id))
    except redis.RedisError as exc:
        if live:
            return Verdict(True, f"redis unreachable ({exc}); not a reason to restart this worker")
        return Verdict(False, f"redis unreachable: {exc}")
    finally:
        client.close()
    verdict = judge(beat, time.time(), max_age_s, live)
    return Verdict(verdict.ok, f"worker {worker_id}: {verdict.reason}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m auk_worker.service.ops.probe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", action="store_true", help="liveness: any state but failed, heartbeat fresh")
    parser.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S,
                        help=f"oldest acceptable heartbeat in seconds (default {DEFAULT_MAX_AGE_S:g})")  # fmt: skip
    parser.add_argument("--worker-id", help="the worker whose heartbeat is read (default: AUK_WORKER_ID, else the "
                        "one worker whose heartbeat names this host)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"configuration error: {exc}")
        return 1
    worker_id = args.worker_id or settings.worker_id
    verdict = probe(worker_id, settings, args.max_age, args.live)
    print(verdict.reason)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
