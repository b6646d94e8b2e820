"""Typed results of the AuK render service's API, as ``auk_client.Client`` returns them.

Each is a frozen dataclass read from the API's JSON by ``from_json``, which keeps the fields it knows and the whole
body in ``raw`` (so a field the service adds later is still reachable). Times are the API's ISO-8601 strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

TERMINAL = ("succeeded", "failed", "canceled")


def _known(cls: type, body: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)} - {"raw"}
    return {name: body[name] for name in names if name in body}


@dataclass(frozen=True)
class ErrorInfo:
    """Why a job failed or was canceled: a stable ``code`` and a sentence a person can act on."""

    code: str
    message: str


@dataclass(frozen=True)
class JobResult:
    """A succeeded job's audio: where it is stored, a presigned ``url`` to fetch it, and how it was rendered."""

    key: str
    url: str | None = None
    bucket: str | None = None
    format: str = "wav"
    content_type: str | None = None
    duration_s: float = 0.0
    sample_rate: int = 24_000
    samples: int = 0
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    variant: str | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> JobResult:
        return cls(**_known(cls, body))


@dataclass(frozen=True)
class Job:
    """One render job: ``queued -> running -> succeeded | failed | canceled``."""

    id: str
    status: str
    progress: dict[str, int] | None = None
    created_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    attempts: int = 0
    request: dict[str, Any] = field(default_factory=dict)
    result: JobResult | None = None
    error: ErrorInfo | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Job:
        known = _known(cls, body)
        known["result"] = JobResult.from_json(body["result"]) if body.get("result") else None
        known["error"] = ErrorInfo(body["error"]["code"], body["error"]["message"]) if body.get("error") else None
        return cls(**known, raw=body)


@dataclass(frozen=True)
class Manifest:
    """A stored batch file (the results manifest, or the error file of failed lines) and a presigned URL to it."""

    key: str
    url: str
    lines: int | None = None  # the error file's line count


@dataclass(frozen=True)
class Batch:
    """A batch: its counts by job status, and once ``done`` the manifest (JSONL: custom_id, status, key or error)."""

    id: str
    total: int
    counts: dict[str, int]
    status: str  # running, finishing, done
    created_at: str | None = None
    finished_at: str | None = None
    canceled_at: str | None = None
    manifest: Manifest | None = None
    error_file: Manifest | None = None  # JSONL of the failed lines, as OpenAI's Batch API gives one
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def done(self) -> bool:
        return self.status == "done"

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Batch:
        known = _known(cls, body)
        known.setdefault("counts", {})
        known.setdefault("status", "running")
        for name in ("manifest", "error_file"):
            known[name] = Manifest(**_known(Manifest, body[name])) if body.get(name) else None
        return cls(**known, raw=body)


@dataclass(frozen=True)
class Upload:
    """An uploaded clip, for jobs' ``audio={"upload_id": ...}`` or ``Client.create_voice(upload_id=...)``."""

    upload_id: str
    duration_s: float
    sample_rate: int
    channels: int

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Upload:
        return cls(**_known(cls, body))


@dataclass(frozen=True)
class Voice:
    """A reusable reference clip: pass ``voice_id`` as ``voice`` to jobs and to ``speech``."""

    voice_id: str
    name: str
    duration_s: float
    sample_rate: int
    channels: int
    sha256: str
    created_at: str | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Voice:
        return cls(**_known(cls, body))


@dataclass(frozen=True)
class Speech:
    """The answer of ``POST /v1/audio/speech``: the audio bytes, their type, the job behind them and the
    ``Server-Timing`` split in milliseconds (submit, queue, render, encode, transfer, total)."""

    audio: bytes
    content_type: str
    job_id: str
    timings_ms: dict[str, float] = field(default_factory=dict)

    def save(self, path: str) -> None:
        with open(path, "wb") as out:
            out.write(self.audio)


def parse_server_timing(header: str) -> dict[str, float]:
    """``render;dur=12.5, encode;dur=0.3`` -> ``{"render": 12.5, "encode": 0.3}``."""
    timings: dict[str, float] = {}
    for metric in filter(None, (part.strip() for part in header.split(","))):
        name, *params = (piece.strip() for piece in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key == "dur":
                try:
                    timings[name] = float(value)
                except ValueError:
                    pass
    return timings
