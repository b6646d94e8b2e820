"""The API's JSON answers as typed models, for the OpenAPI document (``api/openapi.py``) and generated clients.

Routes keep building their answers from the stores' own ``public()`` shapes; these models describe those shapes,
field for field, and routes declare them with ``responses=`` (``documented``), so that nothing is re-serialized on
the way out. Objects that may grow a field without breaking a client (a job's ``request`` and ``result``, a
worker's heartbeat) allow more properties than they name. ``tests/service/test_openapi.py`` holds the live API to
these shapes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from auk_worker.service.records.jobs import JobStatus

_OPEN = ConfigDict(extra="allow")


# ------------------------------------------------------------------------------------------------------ errors


class ErrorDetail(BaseModel):
    """What went wrong: a stable ``code`` to branch on, a sentence for people, and sometimes ``details`` (the bad
    fields of a 422, the bad lines of a batch, the variants a 503 ``no_worker_for_variant`` names)."""

    code: str = Field(examples=["invalid_request"])
    message: str = Field(examples=["gen_seconds: Input should be greater than 0"])
    details: Any = None


class ErrorBody(BaseModel):
    """Every error the API answers, whatever its status."""

    error: ErrorDetail


# --------------------------------------------------------------------------------------------------------- jobs


class Progress(BaseModel):
    """Step k of N: Euler steps for one pass; for a long job (a text or recording longer than one pass) its
    finished segments out of all of them."""

    model_config = _OPEN
    step: int
    total: int


class Segment(BaseModel):
    """One segment of a long job: its text (None for a recording's window) and where it lies in the file."""

    model_config = _OPEN
    index: int
    text: str | None = None
    start: float = Field(description="seconds from the start of the file")
    end: float = Field(description="seconds from the start of the file")


class TimestampsFile(BaseModel):
    """A long job's timestamps (JSON, SRT or WebVTT) stored beside its audio."""

    model_config = _OPEN
    key: str
    format: Literal["json", "srt", "vtt"]
    content_type: str | None = None
    url: str | None = Field(default=None, description="presigned GET, valid AUK_PRESIGN_SECONDS")


class JobResult(BaseModel):
    """A finished job's audio: where it is stored, a presigned ``url`` to fetch it, and how it was rendered."""

    model_config = _OPEN
    bucket: str
    key: str
    url: str | None = Field(default=None, description="presigned GET, valid AUK_PRESIGN_SECONDS")
    duration_s: float | None = None
    sample_rate: int | None = None
    samples: int | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    format: str | None = None
    content_type: str | None = None
    variant: str | None = None
    timings: dict[str, float] | None = None
    # A long job's (a text or recording longer than one pass, rendered as segments and joined):
    segments: list[Segment] | None = None
    passes: int | None = Field(default=None, description="render_batch calls (GPU groups) of the last attempt")
    segments_rendered: int | None = Field(default=None, description="segments the last attempt rendered; the "
                                          "others were stored by an earlier one")  # fmt: skip
    timestamps: TimestampsFile | None = None


class JobError(BaseModel):
    model_config = _OPEN
    code: str
    message: str


class WebhookState(BaseModel):
    """A webhook's delivery: ``waiting`` until the record ends, then ``pending``, ``delivered`` or ``failed``."""

    url: str
    state: Literal["waiting", "pending", "delivered", "failed"]
    attempts: int
    last_status: int | None
    last_error: str | None
    delivered_at: str | None
    next_attempt_at: str | None


class JobOut(BaseModel):
    """A job as its owner sees it."""

    model_config = _OPEN
    id: str
    status: JobStatus
    progress: Progress | None
    created_at: str = Field(description="ISO-8601 UTC, e.g. 2025-01-31T22:04:05.123Z")
    started_at: str | None
    finished_at: str | None
    attempts: int = Field(description="times a worker started it")
    request: dict[str, Any] = Field(description="the validated request, its resolved clip and target_seconds")
    result: JobResult | None
    error: JobError | None
    batch_id: str | None
    custom_id: str | None
    webhook: WebhookState | None


class JobPage(BaseModel):
    data: list[JobOut]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page; null on the last")


# ------------------------------------------------------------------------------------------------------ batches


class BatchCreated(BaseModel):
    id: str
    total: int = Field(description="job lines enqueued")


class FileLink(BaseModel):
    model_config = _OPEN
    key: str
    url: str
    lines: int | None = Field(default=None, description="the error file's line count")


class BatchOut(BaseModel):
    """A batch: counts by job status; once ``done``, its JSONL manifest and (if any line failed) error file."""

    model_config = _OPEN
    id: str
    total: int
    counts: dict[str, int] = Field(description="jobs by status: queued, running, succeeded, failed, canceled")
    status: Literal["running", "finishing", "done"]
    created_at: str
    finished_at: str | None
    canceled_at: str | None
    manifest: FileLink | None
    error_file: FileLink | None
    webhook: WebhookState | None


class BatchCanceled(BatchOut):
    canceled_now: int = Field(description="jobs this request canceled")


class BatchPage(BaseModel):
    data: list[BatchOut]
    next_cursor: str | None


class BatchLink(BaseModel):
    path: str
    url: str
    expires_at: int = Field(description="seconds since the epoch")


# ------------------------------------------------------------------------------------------- uploads and voices


class UploadOut(BaseModel):
    upload_id: str
    duration_s: float
    sample_rate: int
    channels: int


class VoiceOut(BaseModel):
    """A caller's voice: a clip (its clip fields set) or a description and a seed (``source: description``)."""

    voice_id: str
    object: Literal["voice"]
    name: str
    source: Literal["clip", "description"]
    description: str | None = None
    seed: int | None = None
    duration_s: float | None
    sample_rate: int | None
    channels: int | None
    sha256: str | None
    created_at: str


class BuiltinVoice(BaseModel):
    """A built-in voice (``config/voices.yaml``): give its name as ``voice``."""

    voice_id: str
    object: Literal["voice"]
    name: str
    source: Literal["builtin"]
    description: str
    seed: int


class VoiceList(BaseModel):
    object: Literal["list"]
    data: list[VoiceOut]
    builtin: list[BuiltinVoice]


class VoiceDeleted(BaseModel):
    voice_id: str
    object: Literal["voice"]
    deleted: bool


# ----------------------------------------------------------------------------------------------------- webhooks


class WebhookSecret(BaseModel):
    secret: str = Field(examples=["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])


class RotatedSecret(WebhookSecret):
    previous_valid_for_s: int = Field(description="the previous secret goes on signing this long")


# ------------------------------------------------------------------------------------------------------- health


class Alive(BaseModel):
    status: Literal["ok"]


class WorkerView(BaseModel):
    model_config = _OPEN
    id: str
    state: str
    variant: str
    age_s: float | None = Field(description="seconds since its last heartbeat")


class QueueBacklog(BaseModel):
    model_config = _OPEN
    waiting: int = Field(description="tasks waiting for a worker (bulk: the Celery queue and the fair share's lists)")
    rendering: int = Field(description="tasks a worker renders now")
    demand: int = Field(description="waiting + rendering: the workers this work keeps busy")


class VariantBacklog(BaseModel):
    model_config = _OPEN
    interactive: QueueBacklog
    bulk: QueueBacklog
    recovery: QueueBacklog = Field(description="jobs sent again after their worker died, polled first")


class BacklogView(BaseModel):
    """Render tasks waiting for a worker, per variant (``GET /backlog``, what KEDA scales the pools on)."""

    model_config = _OPEN
    base: VariantBacklog
    flash: VariantBacklog


class QueueView(BaseModel):
    """The queue audit (``auk_worker/service/ops/audit.py``): counts and an age, never a job id."""

    model_config = _OPEN
    queued_without_message: int = Field(description="oldest queued jobs whose message is nowhere (should be 0)")
    oldest_queued_age_s: float | None = Field(description="seconds the oldest queued job has waited; null: none")
    checked: int = Field(description="oldest queued jobs the audit looked at")


class Readiness(BaseModel):
    """Whether Redis and storage answer (200 ``ready``, else 503 ``unavailable``) and which workers are serving."""

    model_config = _OPEN
    status: Literal["ready", "unavailable"]
    redis: bool
    storage: bool
    workers_ready: int
    workers: list[WorkerView]
    queue: QueueView | None = Field(None, description="the queue audit; null while Redis does not answer")
