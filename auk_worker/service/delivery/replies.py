"""The speech endpoint's hand-over: the worker pushes the encoded audio to the waiting API through Redis.

``POST /v1/audio/speech`` is a job like any other, but its caller waits on the HTTP connection. Rather than have
the API poll the record and then download the stored object (two more round trips after the render), the worker
pushes one message to ``auk:reply:{job id}`` (a Redis list, expiring after ``REPLY_TTL_S``) as soon as the audio is
encoded, and only then stores the object and records the success. The API waits on that list with ``BLPOP``.

The message is one binary value: a JSON header line, ``\\n``, then the audio bytes. The header says
``{"status": "succeeded", "content_type", "format", "timings": {...}, "pushed_at"}`` or ``{"status": "failed",
"code", "message"}``. A streamed answer (``stream_format``) is many messages on the same list, read in order: a
``{"status": "piece", "seq", ...}`` per encoded piece, then the ``succeeded`` one with ``"final": true`` carrying
the encoder's tail (``auk_worker/streaming.py``, ``AudioStream``). A message nobody takes (the caller hung up)
expires with its list.

Nothing is lost if the answer was sent and the worker then dies: the task is acknowledged late, so the record is
still ``running`` and the job is delivered again, rendered with its own seed and stored. A redelivery pushes a
second message that expires unread.

The clients here are binary (``decode_responses=False``), unlike the job store's, and the API's is asyncio; both
follow ``AUK_REDIS_URL`` through ``connect/redis.py``'s constructors (one server, or the master a Sentinel names).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from auk_worker.service.connect.redis import async_redis_client, redis_client
from auk_worker.service.connect.settings import Settings

REPLY_TTL_S = 60  # a reply nobody took is dropped after this long
SOCKET_TIMEOUT_S = 5.0
WAIT_SLICE_S = 1.0  # one BLPOP's wait; between two the caller can look at the record


@dataclass(frozen=True)
class Reply:
    """One message: its header and the audio bytes (empty for a failure)."""

    header: dict[str, Any]
    body: bytes

    @property
    def ok(self) -> bool:
        return self.header.get("status") in ("succeeded", "piece")

    @property
    def final(self) -> bool:
        """The job's last message: a whole answer, a stream's final marker, or a failure."""
        return self.header.get("status") != "piece"


def reply_key(job_id: str, namespace: str = "auk") -> str:
    return f"{namespace}:reply:{job_id}"


def pack(header: dict[str, Any], body: bytes = b"") -> bytes:
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + body


def unpack(message: bytes) -> Reply:
    head, _, body = message.partition(b"\n")
    return Reply(json.loads(head), body)


class ReplySender:
    """The worker's side: push a reply for a job whose record asks for one."""

    def __init__(self, client: redis.Redis, namespace: str = "auk") -> None:
        self.redis = client
        self.ns = namespace

    @classmethod
    def from_settings(cls, settings: Settings, namespace: str = "auk") -> ReplySender:
        client = redis_client(settings, socket_connect_timeout=2, socket_timeout=SOCKET_TIMEOUT_S,
                              decode_responses=False)  # the audio is bytes
        return cls(client, namespace)

    def send(self, job_id: str, header: dict[str, Any], body: bytes = b"") -> None:
        key = reply_key(job_id, self.ns)
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(key, pack({**header, "pushed_at": time.time()}, body))
        pipe.expire(key, REPLY_TTL_S)
        pipe.execute()

    def audio(self, job_id: str, body: bytes, *, fmt: str, content_type: str, timings: dict[str, float]) -> None:
        self.send(job_id, {"status": "succeeded", "format": fmt, "content_type": content_type,
                           "timings": timings}, body)  # fmt: skip

    def failure(self, job_id: str, code: str, message: str) -> None:
        self.send(job_id, {"status": "failed", "code": code, "message": message})


class ReplyWaiter:
    """The API's side: wait for a job's reply without holding a thread (``redis.asyncio``)."""

    def __init__(self, client: aioredis.Redis, namespace: str = "auk") -> None:
        self.redis = client
        self.ns = namespace

    @classmethod
    def from_settings(cls, settings: Settings, namespace: str = "auk") -> ReplyWaiter:
        client = async_redis_client(settings, socket_connect_timeout=2, socket_timeout=SOCKET_TIMEOUT_S + WAIT_SLICE_S,
                                    decode_responses=False)  # fmt: skip
        return cls(client, namespace)

    async def wait(self, job_id: str, timeout_s: float = WAIT_SLICE_S) -> Reply | None:
        """The job's reply, or None when none came within ``timeout_s`` (at most ``SOCKET_TIMEOUT_S``)."""
        popped = await self.redis.blpop([reply_key(job_id, self.ns)], timeout=min(timeout_s, SOCKET_TIMEOUT_S))
        return None if popped is None else unpack(popped[1])

    async def close(self) -> None:
        await self.redis.aclose()
