"""The atomic fetch: a message leaves its queue and enters its worker's unacknowledged set in one Redis script.

Why. kombu's Redis transport takes a message with ``BRPOP`` and only then, in a second round trip, records it as
unacknowledged (``QoS.append``: the ``unacked`` hash and the ``unacked_index`` zset). Between the two, the only copy of
the message is in the worker's socket buffer: a worker SIGKILLed there (an OOM kill, a lost node) loses the message,
and its job stays ``queued`` for ever. Dramatiq's Redis broker does not have that window: its fetch script moves
messages from the queue into a per-worker acks set in one step, and a dead worker's acks go back to the queue. The
channel here does the same on kombu's interfaces:

- **Fetch** (``FETCH``, one ``EVAL``): pop the first message of the worker's queue keys in polling order (kombu's
  key list, so priority and queue order are unchanged) and, in the same script, write it to ``unacked`` and
  ``unacked_index`` exactly as ``QoS.append`` would (so kombu's acknowledgement, rejection and visibility-timeout
  sweep work unchanged), and note it in the holder's own hash ``unacked.<holder>`` (tag -> fetch time, payload
  length, source list) with the holder in the set ``unacked_holders``. A kill at any moment after the script leaves
  the message in those keys; a kill before leaves it in its queue.
- **Wait** without polling: an empty fetch is followed by a ``BRPOP`` on the queues' wake lists (``<queue>.wake``),
  which carry tokens, never messages. Every publish (``_put``, in the same ``MULTI`` as its ``LPUSH``) and every
  restore pushes a token, so an idle worker wakes within a round trip of a message arriving; the token it pops is
  only a hint, and the fetch that follows decides. Losing a token (a worker killed while blocked) costs at most the
  wait's timeout (``brpop_timeout``, 1 s) for another idle worker. A wake list is trimmed to ``WAKE_MAX`` tokens
  and emptied by a fetch that finds its queues empty, so stale tokens cost a few empty fetches at most.
- **Acknowledge / reject / restore** go through kombu's ``QoS`` and also drop the tag from the holder's hash.
- **A dead holder's messages** go back to the front of their queue (``RESTORE_DEAD``, run by the reaper every 2 s,
  ``recovery.py``): a holder is dead when its worker's heartbeat expired, names another instance or says failed
  (``holder_state``, the test the job records use). The message is restored only if ``unacked`` still holds this
  fetch of it (same tag, same fetch time), so an acknowledgement, kombu's own restore, or a later fetch of the same
  message by another holder wins. Restoring a message whose worker was alive after all (frozen past its heartbeat)
  sends the job twice; the record's holder fencing keeps it to one render.

Cost: a fetch is a few ``RPOP`` and one JSON decode of the message, whatever the queue length; the reaper's pass
reads one small hash per holder that has fetched something (about one per live worker). Keys are kombu's own
(unprefixed); the holder checks read ``auk:worker:*`` heartbeat keys the script is not handed (one Redis or a
Sentinel-managed master, not Redis Cluster).

``AUK_FAULT_KILL_AFTER_FETCH=N`` (``fault_kill_after_fetch``, off by default) is a test knob for the fault suite:
the worker SIGKILLs itself right after its N-th fetch returns a message, before kombu sees the message.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from queue import Empty

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from auk_worker.service.records.scripts import HELPERS as LUA_HELPERS

log = logging.getLogger(__name__)

HOLDERS_KEY = "unacked_holders"  # set: holders that may have fetched messages (kombu's keys are not namespaced)
WAKE_SUFFIX = ".wake"  # <queue>.wake: list of wake tokens
WAKE_MAX = 64  # tokens kept per wake list: enough to wake every idle worker of a variant at once
OPTIONS = ("fetch_holder", "fault_kill_after_fetch")  # transport options the channel reads (broker.py adds them)


def holder_key(holder: str) -> str:
    """The hash of the messages ``holder`` fetched and has not acknowledged: tag -> "<fetch time> <length> <list>"."""
    return f"unacked.{holder}"


def wake_key(queue: str) -> str:
    return queue + WAKE_SUFFIX


# KEYS: the queue lists in polling order (n of them), their wake lists, then unacked, unacked_index, the holder's
# hash, the holders set. ARGV: n, now, holder ('' for none). Returns {source list, payload} or false (the wake
# lists emptied).
FETCH = """
local n = tonumber(ARGV[1])
local base = #KEYS - 4
for i = 1, n do
  local item = redis.call('RPOP', KEYS[i])
  if item then
    local props = cjson.decode(item)['properties']
    local info = props['delivery_info'] or {}
    local tag = props['delivery_tag']
    redis.call('HSET', KEYS[base + 1], tag,
               '[' .. item .. ',' .. cjson.encode(info['exchange'] or '') .. ',' ..
               cjson.encode(info['routing_key'] or '') .. ']')
    redis.call('ZADD', KEYS[base + 2], ARGV[2], tag)
    if ARGV[3] ~= '' then
      redis.call('HSET', KEYS[base + 3], tag, ARGV[2] .. ' ' .. #item .. ' ' .. KEYS[i])
      redis.call('SADD', KEYS[base + 4], ARGV[3])
    end
    return {KEYS[i], item}
  end
end
for i = n + 1, base do redis.call('DEL', KEYS[i]) end
return false
"""

# KEYS: the holders set, unacked, unacked_index. ARGV: the records' namespace, wake suffix.
# Puts every message a dead holder fetched back at the front of its list; returns {holder, tag, list} for each.
RESTORE_DEAD = (
    LUA_HELPERS
    + """
local out = {}
for _, holder in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if holder_state(ARGV[1], holder, '', nil) == 'dead' then
    local fetched = 'unacked.' .. holder
    local entries = redis.call('HGETALL', fetched)
    for i = 1, #entries, 2 do
      local tag = entries[i]
      local at, len, source = string.match(entries[i + 1], '^(%S+) (%d+) (.+)$')
      local score = redis.call('ZSCORE', KEYS[3], tag)
      local value = redis.call('HGET', KEYS[2], tag)
      if value and score and tonumber(score) == tonumber(at) then
        redis.call('RPUSH', source, string.sub(value, 2, 1 + tonumber(len)))
        local queue = string.match(source, '^(.-)\\6\\22') or source
        redis.call('LPUSH', queue .. ARGV[2], '1')
        redis.call('HDEL', KEYS[2], tag)
        redis.call('ZREM', KEYS[3], tag)
        out[#out + 1] = {holder, tag, source}
      end
    end
    redis.call('DEL', fetched)
    redis.call('SREM', KEYS[1], holder)
  end
end
return out
"""
)


class FetchingQoS:
    """QoS mixin: the fetch script already recorded the delivery in Redis; acknowledgement, rejection and restore
    also drop it from the holder's hash."""

    def append(self, message, delivery_tag) -> None:
        virtual.QoS.append(self, message, delivery_tag)

    def _remove_from_indices(self, delivery_tag, pipe=None):
        pipe = super()._remove_from_indices(delivery_tag, pipe)
        return pipe.hdel(holder_key(self.channel.fetch_holder), delivery_tag)


class FetchingChannel:
    """Redis channel mixin: fetch with ``FETCH`` (atomic), wait on wake lists, publish with a wake token."""

    # Transport option: the worker's "<worker id>/<instance id>". A consumer that names none (not a worker) keeps
    # its fetches in kombu's unacked hash only, restored after the visibility timeout.
    fetch_holder = ""
    fault_kill_after_fetch = 0  # transport option, tests only: SIGKILL this process right after its N-th fetch
    _wait_next = False  # the next poll waits on the wake lists (the last fetch found nothing)
    _fetches = 0

    # -- consuming --------------------------------------------------------------------------------------------------
    def _queue_keys(self, queues) -> list[str]:
        return [self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]

    def _fetch_command(self, queues) -> list:
        keys = self._queue_keys(queues)
        keys += [wake_key(queue) for queue in queues]
        keys += [self.unacked_key, self.unacked_index_key, holder_key(self.fetch_holder), HOLDERS_KEY]
        n = len(self.priority_steps) * len(queues)
        return ["EVAL", FETCH, len(keys), *keys, n, repr(time.time()), self.fetch_holder]

    def _brpop_start(self, timeout=None):
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        if self._wait_next:
            timeout = self.brpop_timeout if timeout is None else timeout
            command = ["BRPOP", *[wake_key(queue) for queue in queues], timeout or 0]
        else:
            command = self._fetch_command(queues)
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        self.client.connection.send_command(*command)

    def _brpop_read(self, **options):
        waited, self._wait_next = self._wait_next, False
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BRPOP" if waited else "EVAL", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # the next iteration reconnects
                raise
            if waited:  # a wake token, or the wait's timeout: fetch next
                raise Empty()
            if not reply:
                self._wait_next = True
                raise Empty()
            source, item = bytes_to_str(reply[0]), bytes_to_str(reply[1])
            self._after_fetch(item)
            queue = source.rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            self.connection._deliver(loads(item), queue)
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _get(self, queue):
        with self.conn_or_acquire() as client:
            reply = client.execute_command(*self._fetch_command([queue]))
        if not reply:
            raise Empty()
        item = bytes_to_str(reply[1])
        self._after_fetch(item)
        return loads(item)

    def _after_fetch(self, item: str) -> None:
        self._fetches += 1
        if self.fault_kill_after_fetch and self._fetches >= int(self.fault_kill_after_fetch):
            payload = json.loads(item)
            headers = payload.get("headers") or {}
            log.warning("fault injection (AUK_FAULT_KILL_AFTER_FETCH): killed after fetch %d: message %s, task %s "
                        "args %s", self._fetches, payload["properties"]["delivery_tag"], headers.get("id"),
                        headers.get("argsrepr"))  # fmt: skip
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    # -- publishing -------------------------------------------------------------------------------------------------
    def _put(self, queue, message, **kwargs):
        batch = kwargs.get("_publish_batch")
        if batch is not None:
            super()._put(queue, message, **kwargs)
            batch.add("lpush", wake_key(queue), "1")
            batch.add("ltrim", wake_key(queue), 0, WAKE_MAX - 1)
            return
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        with self.conn_or_acquire() as client:
            with client.pipeline() as pipe:  # MULTI: the message and its wake token together
                pipe.lpush(key, dumps(message))
                if self._expires and queue in self._expires:
                    for pri in self.priority_steps:
                        pipe.pexpire(self._q_for_pri(queue, pri), self._expires[queue])
                pipe.lpush(wake_key(queue), "1").ltrim(wake_key(queue), 0, WAKE_MAX - 1)
                pipe.execute()

    def _do_restore_message(self, payload, exchange, routing_key, pipe, leftmost=False):
        super()._do_restore_message(payload, exchange, routing_key, pipe, leftmost)
        for queue in self._lookup(exchange, routing_key):
            pipe.lpush(wake_key(queue), "1")


def restore_dead_holders(client, namespace: str) -> list[tuple[str, str, str]]:
    """Put the messages dead holders fetched back at the front of their lists; (holder, tag, list) for each."""
    script = client.register_script(RESTORE_DEAD)
    channel = kombu_redis.Channel
    rows = script(keys=[HOLDERS_KEY, channel.unacked_key, channel.unacked_index_key], args=[namespace, WAKE_SUFFIX])
    return [(bytes_to_str(h), bytes_to_str(t), bytes_to_str(s)) for h, t, s in rows]
