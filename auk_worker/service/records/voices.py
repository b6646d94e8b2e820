"""Voice records: a reference clip, or a written description and a seed, kept under an id (and a name) that jobs and
speech requests name as ``voice``.

A voice owns its own copy of the clip (``voices/<voice id>`` in the result bucket), so deleting or expiring the
upload it was made from does not break it. Its ``sha256`` (of the clip's encoded bytes) is the content key that
workers cache its prepared pieces under (``auk_worker/voice_cache.py``).

A described voice (``description`` set) has no clip: it renders as instruct TTS with its description and seed, as
the built-in voices do (``auk_worker/voice_catalogue.py``).

Keys: ``auk:voice:{id}`` hash (owner, name, key, sha256, duration_s, sample_rate, samples, channels, created_at,
and for a described voice description and seed);
``auk:owner:{owner}:voices`` zset of the owner's voice ids scored by creation time (ms), newest first in listings.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import redis

from auk_worker.service.records.jobs import utc_now

VOICE_PREFIX = "voice_"


def new_voice_id() -> str:
    return VOICE_PREFIX + uuid.uuid4().hex


@dataclass(frozen=True)
class Voice:
    voice_id: str
    owner: str
    name: str
    key: str  # the object key of the clip's bytes, in the result bucket
    sha256: str
    duration_s: float
    sample_rate: int
    samples: int
    channels: int
    created_at: str
    description: str = ""  # set for a described voice, which has no clip
    seed: int | None = None

    def public(self) -> dict:
        """The API's JSON shape of a voice (a described voice has no clip fields)."""
        if self.description:
            return {"voice_id": self.voice_id, "object": "voice", "name": self.name, "source": "description",
                    "description": self.description, "seed": self.seed, "duration_s": None, "sample_rate": None,
                    "channels": None, "sha256": None, "created_at": self.created_at}  # fmt: skip
        return {"voice_id": self.voice_id, "object": "voice", "name": self.name, "source": "clip",
                "duration_s": self.duration_s, "sample_rate": self.sample_rate, "channels": self.channels,
                "sha256": self.sha256, "created_at": self.created_at}  # fmt: skip

    def clip(self, bucket: str) -> dict:
        """The clip as a job record's ``request.clip`` holds it."""
        return {"bucket": bucket, "key": self.key, "duration_s": self.duration_s, "sample_rate": self.sample_rate,
                "samples": self.samples, "sha256": self.sha256, "voice_id": self.voice_id}  # fmt: skip


class VoiceStore:
    """Voice records in Redis. The client must use ``decode_responses=True``."""

    def __init__(self, redis_client: redis.Redis, namespace: str = "auk") -> None:
        self.redis = redis_client
        self.ns = namespace

    def key(self, voice_id: str) -> str:
        return f"{self.ns}:voice:{voice_id}"

    def owner_key(self, owner: str) -> str:
        return f"{self.ns}:owner:{owner}:voices"

    def add(self, voice: Voice) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.key(voice.voice_id), mapping={
            "owner": voice.owner, "name": voice.name, "key": voice.key, "sha256": voice.sha256,
            "duration_s": repr(voice.duration_s), "sample_rate": str(voice.sample_rate), "samples": str(voice.samples),
            "channels": str(voice.channels), "created_at": voice.created_at, "description": voice.description,
            "seed": "" if voice.seed is None else str(voice.seed),
        })  # fmt: skip
        pipe.zadd(self.owner_key(voice.owner), {voice.voice_id: int(time.time() * 1000)})
        pipe.execute()

    def get(self, voice_id: str, owner: str) -> Voice | None:
        """The owner's voice, or None when it does not exist or belongs to another key."""
        return self._read(voice_id, self.redis.hgetall(self.key(voice_id)), owner)

    def list(self, owner: str, limit: int = 100) -> list[Voice]:
        ids = self.redis.zrevrange(self.owner_key(owner), 0, limit - 1)
        pipe = self.redis.pipeline(transaction=False)
        for voice_id in ids:
            pipe.hgetall(self.key(voice_id))
        voices = (self._read(voice_id, raw, owner) for voice_id, raw in zip(ids, pipe.execute()))
        return [voice for voice in voices if voice is not None]

    def delete(self, voice_id: str, owner: str) -> Voice | None:
        """Remove the owner's voice record; returns what it was (None: no such voice for this owner)."""
        voice = self.get(voice_id, owner)
        if voice is None:
            return None
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.key(voice_id))
        pipe.zrem(self.owner_key(owner), voice_id)
        pipe.execute()
        return voice

    @staticmethod
    def _read(voice_id: str, raw: dict[str, str], owner: str) -> Voice | None:
        if not raw or raw.get("owner") != owner:
            return None
        return Voice(voice_id=voice_id, owner=owner, name=raw.get("name", ""), key=raw["key"], sha256=raw["sha256"],
                     duration_s=float(raw["duration_s"]), sample_rate=int(raw["sample_rate"]),
                     samples=int(raw["samples"]), channels=int(raw["channels"]),
                     created_at=raw.get("created_at") or utc_now(), description=raw.get("description", ""),
                     seed=int(raw["seed"]) if raw.get("seed") else None)  # fmt: skip
