"""The stored objects' keys, and where a caller's input may be read from.

Key layout under the settings' prefix (``AUK_S3_PREFIX``), in the results bucket: ``jobs/<job id>.<format
extension>`` (``.wav``, ``.flac``, ``.mp3``, ``.opus``, ``.pcm``; ``jobs/<job id>.attempt-<n>.<extension>`` for a
job's attempt n > 1, ``attempts.py``: the record names the key that counts), ``uploads/<upload id>``, ``voices/<voice id>``,
``clips/<owner>/<sha256>`` (a speech request's inline reference clip), ``jobs/batch-<batch id>.manifest.jsonl`` and
``jobs/batch-<batch id>.errors.jsonl`` (a batch's results sit next to its audio).

Callers' ``audio.key`` names an object in the operator's input location only (``AUK_S3_INPUT_BUCKET`` +
``AUK_S3_INPUT_PREFIX``, the key relative to the prefix), which settings keep apart from everything above: a key's
uploads and results are never another key's input. Without an input location, ``audio.key`` is refused.
"""

from __future__ import annotations

from auk_worker.errors import InputError
from auk_worker.service.connect.settings import Settings


def _norm_prefix(prefix: str) -> str:
    stripped = prefix.strip("/")
    return f"{stripped}/" if stripped else ""


def result_key(prefix: str, job_id: str, extension: str = "wav") -> str:
    return f"{_norm_prefix(prefix)}jobs/{job_id}.{extension}"


def voice_key(prefix: str, voice_id: str) -> str:
    return f"{_norm_prefix(prefix)}voices/{voice_id}"


def clip_key(prefix: str, owner: str, sha256: str) -> str:
    """Content-addressed per owner: the same clip sent again overwrites the same object."""
    return f"{_norm_prefix(prefix)}clips/{owner}/{sha256}"


def upload_key(prefix: str, upload_id: str) -> str:
    return f"{_norm_prefix(prefix)}uploads/{upload_id}"


def manifest_key(prefix: str, batch_id: str) -> str:
    return f"{_norm_prefix(prefix)}jobs/batch-{batch_id}.manifest.jsonl"


def error_file_key(prefix: str, batch_id: str) -> str:
    """The error file's key: beside the manifest (``jobs/batch-<id>.errors.jsonl``)."""
    return manifest_key(prefix, batch_id).replace(".manifest.jsonl", ".errors.jsonl")


def input_object(settings: Settings, key: str) -> tuple[str, str]:
    """``(bucket, object key)`` that a request's ``audio.key`` names: the key under the input prefix, in the input
    bucket. ``InputError`` (``audio_key_disabled``) when the operator has named no input location."""
    if settings.s3_input_bucket is None:
        raise InputError("audio.key is not enabled on this service (no input location is configured): upload the "
                         "clip with POST /v1/uploads and send audio.upload_id", code="audio_key_disabled")  # fmt: skip
    return settings.s3_input_bucket, f"{settings.s3_input_prefix}{key}"
