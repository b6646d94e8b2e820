"""S3-compatible storage for uploads, rendered WAVs and batch manifests.

A thin wrapper over one boto3 client (signature v4, path-style addresses, short timeouts, few retries, so
that an unreachable store fails fast and the Celery task's own backoff decides when to try again). Every
botocore or connection error leaves this module as ``InfraError`` with the cause; a missing object is
``InputError`` (the caller named a key that does not exist).

Key layout under the settings' prefix: ``jobs/<job id>.<format extension>`` (``.wav``, ``.flac``, ``.mp3``,
``.opus``, ``.pcm``; ``jobs/<job id>.attempt-<n>.<extension>`` for a job's attempt n > 1, ``attempts.py``: the record
names the key that counts), ``uploads/<upload id>``, ``voices/<voice id>``, ``clips/<owner>/<sha256>`` (a speech
request's inline reference clip), ``jobs/batch-<batch id>.manifest.jsonl`` (the manifest sits next to the audio).

``StorageWait`` is how a worker lives through an outage: a storage call that fails with ``InfraError`` is tried
again, in the worker and with what it already holds (a rendered WAV stays in memory; nothing is rendered again),
after a capped exponential backoff with jitter, until storage has refused for ``AUK_STORAGE_RETRY_DEADLINE``
seconds without a success in between; then ``StorageUnavailable`` fails the job.

Callers' ``audio.key`` names an object in the operator's input location only (``AUK_S3_INPUT_BUCKET`` +
``AUK_S3_INPUT_PREFIX``, the key relative to the prefix), which settings keep apart from everything above: a key's
uploads and results are never another key's input. Without an input location, ``audio.key`` is refused.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from auk_worker.errors import InfraError, InputError, StorageUnavailable
from auk_worker.service import presign
from auk_worker.service.settings import Settings

log = logging.getLogger(__name__)

_MISSING_CODES = {"NoSuchKey", "404", "NotFound", "NoSuchBucket"}
T = TypeVar("T")


def _send_body_at_once(request: Any, **_: Any) -> None:
    """botocore asks for ``Expect: 100-continue`` on every upload and then waits a round trip for the server's go
    before sending the body. Every body here is already in memory (a WAV of at most a few MB), so it goes with
    the headers: 0.2 ms less per upload on loopback (48 kB, SeaweedFS)."""
    if "Expect" in request.headers:
        del request.headers["Expect"]


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


def error_code(exc: ClientError) -> str:
    """The S3 error code of a botocore ClientError ("404", "NoSuchKey", ...), empty when it has none."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def input_object(settings: Settings, key: str) -> tuple[str, str]:
    """``(bucket, object key)`` that a request's ``audio.key`` names: the key under the input prefix, in the input
    bucket. ``InputError`` (``audio_key_disabled``) when the operator has named no input location."""
    if settings.s3_input_bucket is None:
        raise InputError("audio.key is not enabled on this service (no input location is configured): upload the "
                         "clip with POST /v1/uploads and send audio.upload_id", code="audio_key_disabled")  # fmt: skip
    return settings.s3_input_bucket, f"{settings.s3_input_prefix}{key}"


class Storage:
    """One bucket for results and uploads; the input location, when configured, for callers' ``audio.key``."""

    def __init__(self, settings: Settings, client: Any | None = None) -> None:
        settings.require_storage()
        self.bucket = settings.s3_bucket
        self.input_bucket = settings.s3_input_bucket  # None: no input location, ``audio.key`` is refused
        self.prefix = settings.s3_prefix
        self.endpoint = settings.s3_endpoint
        self.region = settings.s3_region
        self._access_key = settings.s3_access_key
        self._secret_key = settings.s3_secret_key
        self.client = client or boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint,
            region_name=settings.s3_region,
            aws_access_key_id=settings.s3_access_key,
            aws_secret_access_key=settings.s3_secret_key,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                connect_timeout=2,
                read_timeout=30,
                retries={"max_attempts": 2, "mode": "standard"},
                # No extra CRC checksums on every upload and download (SigV4 already signs the payload hash):
                # they cost about 0.8 ms per WAV on loopback and not every S3-compatible server checks them.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        self.client.meta.events.register("before-sign.s3.PutObject", _send_body_at_once)
        # Presigned URLs name the host they were signed for: the public endpoint (AUK_S3_PUBLIC_ENDPOINT) when the
        # service reaches the store under a name its callers cannot resolve (compose's http://seaweedfs:8333).
        self.presign_endpoint = settings.s3_public_endpoint or settings.s3_endpoint

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except ClientError as exc:
            raise InfraError(f"storage {what} failed: {error_code(exc)}: {exc}") from exc
        except BotoCoreError as exc:
            raise InfraError(f"storage {what} failed: {exc}") from exc

    def ensure_buckets(self) -> None:
        """Create the result bucket (and the input bucket) if they do not exist yet."""
        for bucket in dict.fromkeys(b for b in (self.bucket, self.input_bucket) if b):
            try:
                self.client.head_bucket(Bucket=bucket)
                continue
            except ClientError as exc:
                if error_code(exc) not in _MISSING_CODES:
                    raise InfraError(f"storage head_bucket {bucket} failed: {exc}") from exc
            except BotoCoreError as exc:
                raise InfraError(f"storage head_bucket {bucket} failed: {exc}") from exc
            try:
                self.client.create_bucket(Bucket=bucket)
                log.info("bucket %s: created", bucket)
            except ClientError as exc:
                if error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise InfraError(f"storage create_bucket {bucket} failed: {exc}") from exc
            except BotoCoreError as exc:
                raise InfraError(f"storage create_bucket {bucket} failed: {exc}") from exc

    def put_bytes(self, key: str, data: bytes, content_type: str, metadata: dict[str, str] | None = None) -> None:
        self._call(
            f"put {key}",
            self.client.put_object,
            Bucket=self.bucket,
            Key=key,
            Body=data,
            ContentType=content_type,
            Metadata=metadata or {},
        )

    def put_wav(self, key: str, data: bytes, metadata: dict[str, str]) -> None:
        self.put_bytes(key, data, "audio/wav", metadata)

    def get_bytes(self, bucket: str, key: str) -> bytes:
        """Read one object; a missing object is the caller's error (``InputError``), anything else infra."""
        try:
            response = self.client.get_object(Bucket=bucket, Key=key)
            return response["Body"].read()
        except ClientError as exc:
            if error_code(exc) in _MISSING_CODES:
                raise InputError(f"no object {key!r} in bucket {bucket!r}", code="audio_not_found") from exc
            raise InfraError(f"storage get {bucket}/{key} failed: {error_code(exc)}: {exc}") from exc
        except BotoCoreError as exc:
            raise InfraError(f"storage get {bucket}/{key} failed: {exc}") from exc

    def head(self, key: str) -> dict[str, Any] | None:
        """The object's HEAD response (with ``Metadata``), or None when it does not exist."""
        try:
            return self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if error_code(exc) in _MISSING_CODES:
                return None
            raise InfraError(f"storage head {key} failed: {error_code(exc)}: {exc}") from exc
        except BotoCoreError as exc:
            raise InfraError(f"storage head {key} failed: {exc}") from exc

    def open(self, key: str, byte_range: str | None = None) -> dict[str, Any] | None:
        """A GET of ``key`` in the result bucket whose ``Body`` streams (``byte_range``: an HTTP ``Range`` value), or
        None when the object does not exist. A range past the end raises the ``ClientError`` (``InvalidRange``)."""
        extra = {"Range": byte_range} if byte_range else {}
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key, **extra)
        except ClientError as exc:
            if error_code(exc) in _MISSING_CODES:
                return None
            if error_code(exc) == "InvalidRange":
                raise
            raise InfraError(f"storage get {key} failed: {error_code(exc)}: {exc}") from exc
        except BotoCoreError as exc:
            raise InfraError(f"storage get {key} failed: {exc}") from exc

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", self.client.delete_object, Bucket=self.bucket, Key=key)

    def list_keys(self, prefix: str) -> list[str]:
        """Every key in the result bucket under ``prefix`` (used by tests and the manifest check)."""
        keys: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                keys.extend(item["Key"] for item in page.get("Contents", []))
        except (ClientError, BotoCoreError) as exc:
            raise InfraError(f"storage list {prefix} failed: {exc}") from exc
        return keys

    def presign_get(self, key: str, expires: int, bucket: str | None = None) -> str:
        """A GET URL for ``key`` valid ``expires`` seconds, for the public endpoint when one is set, signed locally
        (``presign.py``: botocore's signature, without its millisecond a URL)."""
        return presign.presign_get(self.presign_endpoint, self.region, self._access_key, self._secret_key,
                                   bucket or self.bucket, key, expires)  # fmt: skip

    def ping(self) -> bool:
        """True when the store answers and the result bucket is reachable."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (ClientError, BotoCoreError) as exc:
            log.warning("storage ping failed: %s", exc)
            return False
        return True


class StorageWait:
    """Retry storage calls through an outage, up to a deadline counted from the first refusal.

    One instance serves one task (a job, or a group's jobs, whose uploads run on threads): a success anywhere
    ends the outage it saw, so a group's jobs fail together once storage has been down for the deadline, rather
    than one deadline after another.
    """

    def __init__(self, deadline_s: float, backoff_s: float, backoff_max_s: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        self.deadline_s = deadline_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.sleep = sleep
        self._down_since: float | None = None  # the first refusal since the last success
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> StorageWait:
        return cls(settings.storage_retry_deadline_s, settings.storage_retry_backoff_s,
                   settings.storage_retry_backoff_max_s)  # fmt: skip

    def call(self, what: str, fn: Callable[[], T], between: Callable[[], None] | None = None) -> T:
        """``fn()``, tried again while it raises ``InfraError``; ``between()`` runs before each new try (it may
        raise to stop waiting, e.g. when the job was canceled). Raises ``StorageUnavailable`` at the deadline."""
        tries = 0
        while True:
            try:
                result = fn()
            except StorageUnavailable:
                raise
            except InfraError as exc:
                tries += 1
                self._wait_or_give_up(what, tries, exc)
                if between is not None:
                    between()
                continue
            with self._lock:
                self._down_since = None
            if tries:
                log.info("storage: %s succeeded after %d refused tries", what, tries)
            return result

    def _wait_or_give_up(self, what: str, tries: int, exc: InfraError) -> None:
        now = self.clock()
        with self._lock:
            if self._down_since is None:
                self._down_since = now
            waited = now - self._down_since
        if waited >= self.deadline_s:
            raise StorageUnavailable(
                f"storage was unreachable for {waited:.1f} s ({tries} tries to {what}), past "
                f"AUK_STORAGE_RETRY_DEADLINE ({self.deadline_s:g} s); last error: {exc.message}"
            ) from exc
        # Capped exponential backoff with jitter (half to all of the step), never past the deadline: many workers
        # meeting one outage do not retry in step, and the last try falls on the deadline.
        step = min(self.backoff_max_s, self.backoff_s * 2 ** min(tries - 1, 32))
        delay = min(step * random.uniform(0.5, 1.0), self.deadline_s - waited)
        log.warning("waiting for storage to %s: try %d refused (%s); next try in %.1f s, %.0f s to the deadline",
                    what, tries, exc.message, delay, self.deadline_s - waited)  # fmt: skip
        self.sleep(delay)
