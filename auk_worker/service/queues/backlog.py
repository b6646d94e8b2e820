"""The backlog of each variant and priority: every render task waiting for a worker, wherever it waits.

A task waits in one of three places before a worker takes it:

- the Celery queue, a Redis list named after it (``auk.{variant}.{priority}``, and ``auk.{variant}.recovery``
  for the jobs the reaper sent again);
- for bulk work, the per-key lists of the fair share (``fairshare.py``: ``auk:bulk:{queue}:owner:{owner}``,
  the owners named by ``auk:bulk:{queue}:ring``), which hold all but ``AUK_BULK_QUEUE_DEPTH`` of a batch;
- for bulk work, ``auk:bulk:inflight``: released by a feeder and not yet confirmed in the Celery queue.

The Celery bulk list alone never grows past the depth, so an autoscaler reading it sees at most the depth
whatever the batch. ``read_backlog`` counts all three in one Lua script (one consistent snapshot, one round trip)
and adds the tasks workers render now (``demand`` = waiting + rendering: the workers the work keeps busy, so an
interactive pool whose queue is empty because its workers keep up is not scaled in under them). The API's
``GET /backlog`` (KEDA's ``metrics-api`` trigger) and the ``auk_queue_backlog`` gauge of ``/metrics`` (a
Prometheus trigger) report it. A task is a render group of up to ``max_num_seqs`` jobs on the bulk
pool, one job elsewhere; a task already taken by a worker is not counted. Staged tasks of a canceled batch count
until the feeder releases them (a worker then skips them at once).

The script's cost is one ``LLEN`` per staged key and per queue: a few hundred operations with hundreds of keys
staging, polled every 15 s.
"""

from __future__ import annotations

import redis

from auk_worker.service.queues.celery_app import RECOVERY  # queue names: celery_app.queue_name, as the script builds them
from auk_worker.service.records.workers import read_heartbeats

PRIORITIES = ("interactive", "bulk", RECOVERY)

# KEYS: none (the names are built from ARGV; one Redis, as every script of the service assumes).
# ARGV: namespace, then (variant) names. Returns, per variant, {interactive, bulk, recovery} counts in that order.
_BACKLOG = """
local ns = ARGV[1]
local inflight = {}
for _, item in ipairs(redis.call('HKEYS', ns .. ':bulk:inflight')) do
  local ok, task = pcall(cjson.decode, item)
  if ok and task['queue'] then inflight[task['queue']] = (inflight[task['queue']] or 0) + 1 end
end
local out = {}
for i = 2, #ARGV do
  local variant = ARGV[i]
  local bulk = 'auk.' .. variant .. '.bulk'
  local staged = 0
  local seen = {}
  for _, owner in ipairs(redis.call('LRANGE', ns .. ':bulk:' .. bulk .. ':ring', 0, -1)) do
    if not seen[owner] then
      seen[owner] = true
      staged = staged + redis.call('LLEN', ns .. ':bulk:' .. bulk .. ':owner:' .. owner)
    end
  end
  out[#out + 1] = redis.call('LLEN', 'auk.' .. variant .. '.interactive')
  out[#out + 1] = redis.call('LLEN', bulk) + staged + (inflight[bulk] or 0)
  out[#out + 1] = redis.call('LLEN', 'auk.' .. variant .. '.recovery')
end
return out
"""


class Backlog:
    """Reads the backlog of every variant from Redis (a client with ``decode_responses``)."""

    def __init__(self, client: redis.Redis, variants: tuple[str, ...], namespace: str = "auk") -> None:
        self.client = client
        self.variants = variants
        self.namespace = namespace
        self._script = client.register_script(_BACKLOG)

    def read(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{variant: {priority: {"waiting", "rendering", "demand"}}}`` for the priorities ``interactive``, ``bulk``
        and ``recovery``: tasks waiting for a worker, tasks a worker renders now (a busy worker's heartbeat, its
        job's record naming the queue), and their sum, the workers this work would keep busy."""
        counts = [int(n) for n in self._script(keys=[], args=[self.namespace, *self.variants])]
        out = {variant: {priority: {"waiting": counts[3 * i + j], "rendering": 0, "demand": counts[3 * i + j]}
                         for j, priority in enumerate(PRIORITIES)}
               for i, variant in enumerate(self.variants)}  # fmt: skip
        for variant, priority in self._rendering():
            if variant in out and priority in out[variant]:
                out[variant][priority]["rendering"] += 1
                out[variant][priority]["demand"] += 1
        return out

    def _rendering(self) -> list[tuple[str, str]]:
        """(variant, priority) of each busy worker's task, read from its first job's record's queue."""
        busy = [beat["job_id"].split(",")[0] for beat in read_heartbeats(self.client, self.namespace)
                if beat.get("state") == "busy" and beat.get("job_id")]  # fmt: skip
        if not busy:
            return []
        pipe = self.client.pipeline(transaction=False)
        for job_id in busy:
            pipe.hget(f"{self.namespace}:job:{job_id}", "queue")
        queues = [queue for queue in pipe.execute() if queue and queue.count(".") == 2]
        return [tuple(queue.split(".")[1:]) for queue in queues]
