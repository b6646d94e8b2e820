"""The service's small family of named errors.

Three kinds, each with a stable ``code`` that ends up in a failed job's record:

- ``InputError``: the caller's fault (bad audio, bad parameters). Never retried.
- ``InfraError``: storage, Redis or another dependency is unreachable. Retried with backoff.
- ``ModelError``: the model could not render (checkpoint problems, non-finite output, out of memory).

Only the process boundary (the CLI, the Celery task, the API's exception handler) catches broadly and
turns an exception into a record or an exit status.
"""

from __future__ import annotations


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
    """The request or its audio is invalid; retrying cannot help."""

    code = "invalid_input"


class AudioError(InputError):
    """The audio clip is empty, not audio, non-finite, too short or too long."""

    code = "invalid_audio"


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


class Canceled(AuKError):
    """The job was canceled while it ran."""

    code = "canceled"
