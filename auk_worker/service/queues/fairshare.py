"""Fair share of the bulk queues: batches wait per key in Redis and are released to Celery round-robin across keys.

A batch's tasks (``auk.render_group`` or ``auk.render``, as ``api/submit.py`` plans them) are not sent to the bulk
queue at once. They are staged in a list per key (``auk:bulk:{queue}:owner:{owner}``), and the key joins the
queue's ring of keys with staged work (``auk:bulk:{queue}:ring``). A feeder keeps each bulk queue at most
``AUK_BULK_QUEUE_DEPTH`` tasks deep: it takes the first key off the ring, releases that key's next task to Celery,
and puts the key back at the ring's end while it has more. So a key's 10,000-line batch holds a batch that another
key sends later for at most the tasks already released (about the depth), not until the morning; with one key
staged the order is its own, first in, first out.

The feeder runs in every API process and every worker (a thread waking every ``FEED_INTERVAL_S``, and at once
after a batch is staged or a worker finishes a bulk task), so the bulk queues move while any process of the service
is up. Each wake asks in one script whether a staged queue has room or a release waits in flight (one command, the
usual idle answer being no); only then does it feed, one feeder at a time under a lock in Redis. A queue with
nothing staged leaves ``auk:bulk:queues`` until a batch is staged for it again. A released task is recorded in ``auk:bulk:inflight`` until Celery has it;
a feeder that dies between the two leaves it there, and the next feeder sends it again after
``INFLIGHT_STALE_S`` (at least once: a worker skips a job whose record is already finished).

Interactive jobs never pass through here.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import redis

from auk_worker.service.records import scripts

log = logging.getLogger(__name__)

FEED_INTERVAL_S = 0.5  # the feeder's wake-up without a nudge
LOCK_MS = 10_000  # one feeder at a time; a lock outlives a dead feeder this long
INFLIGHT_STALE_S = 60.0  # a released task not confirmed sent by then is sent again
STAGE_CHUNK = 1000  # tasks staged per script call (Lua's unpack has a limit)

Send = Callable[[str, list, str], None]  # (task name, args, queue): Celery's send_task


class FairShare:
    """Staging and releasing bulk tasks (see the module docstring). The client must use ``decode_responses``."""

    def __init__(self, client: redis.Redis, depth: int, namespace: str = "auk") -> None:
        self.redis = client
        self.depth = depth
        self.ns = namespace
        self._stage = client.register_script(scripts.FAIR_STAGE)
        self._release = client.register_script(scripts.FAIR_RELEASE)
        self._unlock = client.register_script(scripts.UNLOCK)
        self._plan = client.register_script(scripts.FAIR_PLAN)

    def _ring(self, queue: str) -> str:
        return f"{self.ns}:bulk:{queue}:ring"

    def _staged(self, queue: str, owner: str = "") -> str:
        return f"{self.ns}:bulk:{queue}:owner:{owner}"

    @property
    def _queues(self) -> str:
        return f"{self.ns}:bulk:queues"

    @property
    def _inflight(self) -> str:
        return f"{self.ns}:bulk:inflight"

    def stage(self, owner: str, queue: str, tasks: Sequence[tuple[str, list]]) -> None:
        """Queue ``(task name, args)`` pairs for ``owner`` behind its earlier ones, for release to ``queue``."""
        items = [json.dumps({"id": uuid.uuid4().hex, "task": name, "args": args, "queue": queue}) for name, args in tasks]
        for start in range(0, len(items), STAGE_CHUNK):
            self._stage(keys=[self._ring(queue), self._staged(queue, owner), self._queues],
                        args=[owner, queue, *items[start:start + STAGE_CHUNK]])  # fmt: skip

    def staged(self, owner: str, queue: str) -> int:
        """How many of ``owner``'s tasks wait for release to ``queue``."""
        return int(self.redis.llen(self._staged(queue, owner)))

    def feed(self, send: Send) -> int:
        """Top every bulk queue up to the depth, round-robin across keys; returns the tasks sent. Does nothing while
        another feeder holds the lock, and takes no lock when there is nothing to do (one command)."""
        inflight, *queues = self._plan(keys=[self._queues, self._inflight], args=[f"{self.ns}:bulk:", self.depth])
        if not queues and not int(inflight):
            return 0
        token = uuid.uuid4().hex
        if not self.redis.set(f"{self.ns}:bulk:feeder", token, nx=True, px=LOCK_MS):
            return 0
        sent = 0
        try:
            if int(inflight):
                self._resend_stale(send)
            for queue in sorted(queues):
                room = self.depth - int(self.redis.llen(queue))  # the Celery queue: a Redis list named after it
                if room <= 0:
                    continue
                items = self._release(keys=[self._ring(queue), self._inflight],
                                      args=[self._staged(queue), room, time.time()])  # fmt: skip
                for item in items:
                    self._send(item, send)
                    sent += 1
        finally:
            self._unlock(keys=[f"{self.ns}:bulk:feeder"], args=[token])
        return sent

    def _send(self, item: str, send: Send) -> None:
        task = json.loads(item)
        send(task["task"], task["args"], task["queue"])
        self.redis.hdel(self._inflight, item)

    def _resend_stale(self, send: Send) -> None:
        now = time.time()
        for item, released in self.redis.hgetall(self._inflight).items():
            if now - float(released) > INFLIGHT_STALE_S:
                log.warning("bulk task %s: released %.0f s ago and not confirmed sent; sending it again",
                            json.loads(item)["id"], now - float(released))  # fmt: skip
                self._send(item, send)


class Feeder:
    """A daemon thread that calls ``FairShare.feed`` every ``FEED_INTERVAL_S`` and whenever nudged."""

    def __init__(self, fair: FairShare, send: Send, name: str = "bulk-feeder") -> None:
        self.fair = fair
        self.send = send
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Feeder:
        self._thread.start()
        return self

    def nudge(self, *_: object, **__: object) -> None:
        """Feed now (a batch was staged, a worker finished a task); safe from any thread or signal handler."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(FEED_INTERVAL_S)
            self._wake.clear()
            try:
                self.fair.feed(self.send)
            except Exception as exc:  # noqa: BLE001 - the thread's boundary: Redis or the broker down; try again
                log.warning("bulk feeder: %s", exc)
