"""Upload records: who uploaded a clip, where its bytes are, and what decoding it found.

``auk:upload:{id}`` is a hash (owner, key, duration_s, sample_rate, samples, channels). The clip's sample count and
rate are kept exactly, not only its rounded duration, so that the API applies the length rule to the same whole
latent frames the worker will count (``rules.clip_frames``).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis


@dataclass(frozen=True)
class Upload:
    upload_id: str
    owner: str
    key: str  # the object key of the original bytes, in the result bucket
    duration_s: float
    sample_rate: int
    samples: int  # at ``sample_rate``, mono
    channels: int
    sha256: str = ""  # of the encoded bytes: the content key workers cache a clip's preparation under

    def public(self) -> dict:
        """The API's JSON shape of an upload."""
        return {"upload_id": self.upload_id, "duration_s": self.duration_s,
                "sample_rate": self.sample_rate, "channels": self.channels}  # fmt: skip


class UploadStore:
    """Upload records in Redis. The client must use ``decode_responses=True``."""

    def __init__(self, redis_client: redis.Redis, namespace: str = "auk", retain_s: int = 0) -> None:
        self.redis = redis_client
        self.ns = namespace
        self.retain_s = retain_s  # an upload's record lasts this long (0: forever), as its object does

    def key(self, upload_id: str) -> str:
        return f"{self.ns}:upload:{upload_id}"

    def add(self, upload: Upload) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.key(upload.upload_id), mapping={
            "owner": upload.owner, "key": upload.key, "duration_s": repr(upload.duration_s),
            "sample_rate": str(upload.sample_rate), "samples": str(upload.samples), "channels": str(upload.channels),
            "sha256": upload.sha256,
        })  # fmt: skip
        if self.retain_s:
            pipe.expire(self.key(upload.upload_id), self.retain_s)
        pipe.execute()

    def get(self, upload_id: str, owner: str) -> Upload | None:
        """The owner's upload, or None when it does not exist or belongs to another key."""
        fields = self.redis.hgetall(self.key(upload_id))
        if not fields or fields.get("owner") != owner:
            return None
        duration, rate = float(fields["duration_s"]), int(fields["sample_rate"])
        # A record written before ``samples`` was kept: its duration has 6 decimals, exact to the sample below 1 MHz.
        samples = int(fields["samples"]) if "samples" in fields else round(duration * rate)
        return Upload(upload_id=upload_id, owner=owner, key=fields["key"], duration_s=duration, sample_rate=rate,
                      samples=samples, channels=int(fields["channels"]), sha256=fields.get("sha256", ""))  # fmt: skip
