"""The service's small family of named errors.

Three kinds, each with a stable ``code`` that ends up in a failed job's record:

- ``InputError``: the caller's fault (bad audio, bad parameters, an unknown id, a body too large...). Never
  retried. Its subclasses say which fault when the API must answer it with its own status (``api/errors.py`` holds
  the one mapping from these classes to HTTP statuses).
- ``InfraError``: storage, Redis or another dependency is unreachable. Retried with backoff; its subclass
  ``StorageUnavailable`` says the retries ran out of time.
- ``ModelError``: the model could not render (checkpoint problems, non-finite output, out of memory).

Only the process boundary (the CLI, the Celery task, the API's exception handler) catches broadly and
turns an exception into a record or an exit status.
"""

from __future__ import annotations

from typing import Any


class AuKError(Exception):
    """Base class; ``code`` is a short machine-readable name, the message a sentence a person can act on."""

    code = "error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InputError(AuKError, ValueError):
    """The request or its audio is invalid; retrying cannot help. ``details`` (JSON) lists the parts at fault, e.g.
    a batch's bad lines."""

    code = "invalid_request"  # the error table's code for a broken rule (README, "Errors")

    def __init__(self, message: str, *, code: str | None = None, details: Any = None) -> None:
        super().__init__(message, code=code)
        self.details = details


class AudioError(InputError):
    """The audio clip is empty, not audio, non-finite, too short or too long."""

    code = "invalid_audio"


class MalformedBody(InputError):
    """The request body cannot be read at all (not UTF-8, not the expected encoding)."""

    code = "malformed_body"


class Unauthorized(InputError):
    """No API key, or one that is not valid."""

    code = "unauthorized"


class NotFound(InputError):
    """No such job, batch or upload for this caller (another key's look the same)."""

    code = "not_found"


class Conflict(InputError):
    """The resource's state forbids the change (cancelling a finished job)."""

    code = "conflict"


class TooLarge(InputError):
    """A request body over its limit."""

    code = "too_large"


class UnsupportedMediaType(InputError):
    """A body in a content type the endpoint does not read."""

    code = "unsupported_media_type"


class RequestTimeout(InputError):
    """The client stopped sending its request body for longer than the service waits."""

    code = "body_timeout"


class TooManyRequests(InputError):
    """A per-key quota is spent (request rate, requests in flight, queued jobs); ``retry_after`` says how many
    seconds to wait before trying again."""

    code = "rate_limited"

    def __init__(self, message: str, *, retry_after: float, code: str | None = None, details: Any = None) -> None:
        super().__init__(message, code=code, details=details)
        self.retry_after = max(1, int(-(-retry_after // 1)))  # whole seconds, rounded up


class CheckpointError(AuKError):
    """A checkpoint directory, config or weight file does not match the release layout."""

    code = "bad_checkpoint"


class ConfigError(AuKError, ValueError):
    """A deploy config or settings field has a bad value; the message names the field."""

    code = "bad_config"


class ModelError(AuKError):
    """The model failed while rendering (non-finite output, out of memory)."""

    code = "model_error"


class OutOfMemory(ModelError):
    code = "out_of_memory"


class InfraError(AuKError):
    """A dependency (storage, Redis) failed; the operation may succeed if retried."""

    code = "infrastructure"


class NoWorker(InfraError):
    """No live worker serves what a job needs (its variant); ``details`` names what the live workers serve."""

    code = "no_worker_for_variant"

    def __init__(self, message: str, *, code: str | None = None, details: Any = None) -> None:
        super().__init__(message, code=code)
        self.details = details


class StorageUnavailable(InfraError):
    """Storage stayed unreachable until the job's deadline (``AUK_STORAGE_RETRY_DEADLINE``): the job fails."""

    code = "storage_unavailable"


class Canceled(AuKError):
    """The job was canceled while it ran."""

    code = "canceled"
