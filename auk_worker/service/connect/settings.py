"""Service settings: one typed, frozen object read from the environment and validated at start-up.

Every process of the service (API, worker, benchmark, tests) builds one ``Settings`` with
``Settings.from_env()``. A bad value is refused with the variable's name; secrets have no defaults.
Checks that only one side needs (storage credentials, API keys) are separate ``require_*`` calls so that
a worker does not need API keys and the API does not need a checkpoint.

Every ``AUK_*`` variable of the service is read here and nowhere else; ``docs/settings.md`` lists them (variable,
default, meaning) and ``tests/test_settings_doc.py`` keeps the two in step.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from auk_worker.errors import ConfigError
from auk_worker.service.connect.redis_url import is_sentinel, parse_sentinel_url

VARIANTS = ("base", "flash")
# AUK_PIPELINE: ``auk`` loads AUK_CHECKPOINT; ``instant`` is the model-free fake of the queue-overhead benchmark and
# the fault tests; ``random-release`` (benchmark only: bench/throughput.py) builds release-size random weights.
PIPELINES = ("auk", "instant", "random-release")
# AUK_VARIANT_CHECK: when the API refuses a job whose variant no live worker serves (api/submit.py).
VARIANT_CHECKS = ("live", "strict", "off")
# AUK_STORE_BEHIND: a worker stores one group while it renders the next (worker/board.py); auto: for group configs.
STORE_BEHIND = ("auto", "on", "off")
LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    """A positive, finite number (of seconds)."""
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


def _allow_list(env: Mapping[str, str], name: str) -> str:
    """Hosts and networks (comma or space separated) as ``urlguard.UrlPolicy.parse`` reads them, checked here."""
    from auk_worker.urlguard import UrlPolicy

    raw = _get(env, name) or ""
    try:
        UrlPolicy.parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return raw


def _float(env: Mapping[str, str], name: str, default: float, minimum: float) -> float:
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if not value >= minimum or value != value or value == float("inf"):
        raise ConfigError(f"{name} must be a finite number of at least {minimum:g}, got {raw!r}")
    return value


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(env: Mapping[str, str], name: str, default: int) -> int:
    """A period in whole seconds: ``3600``, ``45s``, ``15m``, ``12h`` or ``30d``; ``0`` means never."""
    raw = _get(env, name)
    if raw is None:
        return default
    number, unit = (raw[:-1], raw[-1].lower()) if raw[-1:].lower() in _UNITS else (raw, "s")
    if not (number.isascii() and number.isdigit()):
        raise ConfigError(f"{name} must be a whole number of seconds or e.g. 45s, 15m, 12h, 30d; got {raw!r}")
    return int(number) * _UNITS[unit]


def _url(env: Mapping[str, str], name: str, schemes: tuple[str, ...], default: str | None) -> str | None:
    raw = _get(env, name) or default
    if raw is None:
        return None
    parsed = urlparse(raw)
    if parsed.scheme not in schemes or not parsed.netloc:
        raise ConfigError(f"{name} must be a URL with scheme {' or '.join(schemes)}, got {raw!r}")
    return raw


def _redis_url(env: Mapping[str, str]) -> str:
    """AUK_REDIS_URL: one server (redis, rediss, unix) or Sentinel (``sentinel://h1:26379;sentinel://h2:26379/0``)."""
    raw = _get(env, "AUK_REDIS_URL") or "redis://127.0.0.1:6379/0"
    if is_sentinel(raw):
        parse_sentinel_url(raw)
        return raw
    return _url(env, "AUK_REDIS_URL", ("redis", "rediss", "unix"), raw)


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str | None,
            upper: bool = False) -> str | None:  # fmt: skip
    raw = _get(env, name) or default
    if raw is not None and upper:
        raw = raw.upper()
    if raw is not None and raw not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


# A worker id names its heartbeat key and is the part of a job's holder before the "/" (jobs.py splits there).
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def worker_id_or_none(raw: str | None, name: str = "AUK_WORKER_ID") -> str | None:
    """A worker id as given (None when unset), refused when it could not name a heartbeat or a job's holder."""
    if raw is None:
        return None
    if not _WORKER_ID.fullmatch(raw):
        raise ConfigError(f"{name} must be 1-128 letters, digits and . _ : @ - (starting with a letter or digit), "
                          f"got {raw!r}")  # fmt: skip
    return raw


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    raw = _get(env, name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and 0 < int(raw) < 65536):
        raise ConfigError(f"{name} must be a port number, got {raw!r}")
    return int(raw)


def _seconds_or_zero(env: Mapping[str, str], name: str, default: float) -> float:
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not 0 <= value < float("inf"):
        raise ConfigError(f"{name} must be a number of seconds of at least 0, got {raw!r}")
    return value


def _prefix(raw: str | None) -> str:
    """Normalise a key prefix: no leading slash, one trailing slash when non-empty."""
    if not raw:
        return ""
    stripped = raw.strip("/")
    return f"{stripped}/" if stripped else ""


@dataclass(frozen=True)
class Settings:
    """Everything the service reads from the environment (``AUK_*`` variables)."""

    redis_url: str = "redis://127.0.0.1:6379/0"  # AUK_REDIS_URL: one server, or sentinel://h1:p1;sentinel://h2:p2/db
    redis_sentinel_master: str = "mymaster"  # AUK_REDIS_SENTINEL_MASTER: the master's name at the sentinels
    # Acknowledged writes wait for this many replicas (at most AUK_REDIS_WAIT_TIMEOUT s; redis_client.py's
    # ReplicationBarrier): AUK_REDIS_WAIT_REPLICAS, default 1 with Sentinel and 0 (no wait) with one server.
    redis_wait_replicas: int = 0
    redis_wait_timeout_s: float = 1.0  # AUK_REDIS_WAIT_TIMEOUT
    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"
    s3_access_key: str | None = field(default=None, repr=False)
    s3_secret_key: str | None = field(default=None, repr=False)
    s3_bucket: str = "auk"
    s3_input_bucket: str | None = None  # AUK_S3_INPUT_BUCKET: where ``audio.key`` reads; None refuses ``audio.key``
    s3_input_prefix: str = ""  # AUK_S3_INPUT_PREFIX: ``audio.key`` is relative to it
    s3_prefix: str = ""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    visibility_timeout: int = 3600
    deploy_config: Path = Path("config/auk.yaml")
    voices_file: Path | None = None  # AUK_VOICES_FILE: the built-in voices; None: the shipped config/voices.yaml
    checkpoint: Path | None = None
    variant: str | None = None
    presign_seconds: int = 3600
    max_upload_bytes: int = 50 * 1024 * 1024
    max_recording_s: float = 3600.0  # AUK_MAX_RECORDING_SECONDS: the longest clip a job reads (long recordings)
    max_kills: int = 3
    # AUK_FAULT_KILL_AFTER_FETCH: a test knob of the fault suite, 0 (off) in every deployment: a worker SIGKILLs
    # itself right after its N-th broker fetch returns a message (fetch.py).
    fault_kill_after_fetch: int = 0
    pipeline: str = "auk"
    retry_max: int = 6  # AUK_RETRY_MAX: Celery retries of an InfraError before the job fails
    retry_backoff_s: float = 1.0  # AUK_RETRY_BACKOFF: first retry delay; doubles each retry
    # Webhooks (delivery/webhooks/, notify.py): hosts/CIDRs a webhook may reach although not public; the dispatcher
    # threads the API runs (0: none, run `python -m auk_worker.service.delivery.webhooks` instead); its timeout and
    # retry schedule.
    webhook_allow: str = ""  # AUK_WEBHOOK_ALLOW, e.g. "127.0.0.1,hooks.internal,10.1.0.0/16"
    webhook_threads: int = 2  # AUK_WEBHOOK_THREADS
    webhook_timeout_s: float = 10.0  # AUK_WEBHOOK_TIMEOUT
    webhook_retry_base_s: float = 30.0  # AUK_WEBHOOK_RETRY_BASE: the first retry's longest delay; doubles
    webhook_retry_cap_s: float = 6 * 3600.0  # AUK_WEBHOOK_RETRY_CAP: the longest delay between two attempts
    webhook_max_attempts: int = 15  # AUK_WEBHOOK_MAX_ATTEMPTS
    # The batch page's signed links (api/batch_page_links.py): the HMAC key (default: derived from AUK_API_KEYS, so
    # every API replica verifies every link) and how long a link lives unless the caller asks for less or more (at most
    # 7 d).
    link_secret: str | None = field(default=None, repr=False)  # AUK_LINK_SECRET
    link_seconds: int = 3600  # AUK_LINK_SECONDS
    worker_id: str | None = None  # AUK_WORKER_ID: None picks "<host name>-gpu<index>" or "-cpu" (worker/main.py)
    stall_timeout: int = 120  # AUK_STALL_TIMEOUT: seconds a worker may not consume, Redis answering, before it exits
    # AUK_STOP_GRACE: seconds a stopped worker (SIGTERM, Ctrl-C) lets its running job finish before it releases the
    # job back to the queue (an operator stop, not a crash: stopping.py). Keep the supervisor's wait before SIGKILL
    # (Kubernetes' terminationGracePeriodSeconds) above it by stopping.RELEASE_S and some.
    stop_grace_s: float = 30.0
    store_behind: str = "auto"  # AUK_STORE_BEHIND: auto, on or off (worker/board.py)
    cache_dir: Path | None = None  # AUK_CACHE_DIR: torch's and Triton's compile caches, shared across starts
    variant_check: str = "live"  # AUK_VARIANT_CHECK: live, strict or off (api/variants.py)
    # A job waits this long for storage (its clip, its upload) before it fails with ``storage_unavailable``; the
    # tries in between back off exponentially from AUK_STORAGE_RETRY_BACKOFF to AUK_STORAGE_RETRY_BACKOFF_MAX.
    storage_retry_deadline_s: float = 1800.0  # AUK_STORAGE_RETRY_DEADLINE
    storage_retry_backoff_s: float = 1.0  # AUK_STORAGE_RETRY_BACKOFF
    storage_retry_backoff_max_s: float = 30.0  # AUK_STORAGE_RETRY_BACKOFF_MAX
    voice_cache_bytes: int = 512 * 1024 * 1024  # AUK_VOICE_CACHE_BYTES: a worker's prepared-voice cache; 0 is off
    speech_timeout_s: int = 300  # AUK_SPEECH_TIMEOUT: how long POST /v1/audio/speech waits for its render
    fetch_allow: str = ""  # AUK_FETCH_ALLOW: hosts/CIDRs a speech request's ref_audio URL may be fetched from
    body_timeout_s: float = 15.0  # AUK_API_BODY_TIMEOUT: longest wait for the next piece of a request body
    body_min_rate: int = 1024  # AUK_API_BODY_MIN_RATE: bytes per second a body must average past its first timeout
    keep_alive_s: int = 5  # AUK_API_KEEP_ALIVE: an idle keep-alive connection is closed after this long
    quota_queued_jobs: int = 50_000  # AUK_QUOTA_QUEUED_JOBS: a key's queued and running jobs (0: no limit)
    quota_rate: float = 50.0  # AUK_QUOTA_RATE: a key's sustained requests per second (0: no limit)
    quota_burst: int = 200  # AUK_QUOTA_BURST: requests a key may make at once above the rate
    quota_in_flight: int = 4  # AUK_QUOTA_IN_FLIGHT: a key's requests in progress at once, per API process (0: off)
    quota_in_flight_queue: int = 64  # AUK_QUOTA_IN_FLIGHT_QUEUE: more of a key's requests that wait for a turn
    bulk_queue_depth: int = 8  # AUK_BULK_QUEUE_DEPTH: bulk tasks released to a variant's queue ahead of its workers
    # Retention (retention.py), each 0 for never: a finished job's record, idempotency key and index entries;
    # an upload's record and object; result WAVs and batch manifests. The sweeper runs every interval.
    retain_records_s: int = 30 * 86400  # AUK_RETAIN_RECORDS
    retain_uploads_s: int = 7 * 86400  # AUK_RETAIN_UPLOADS
    retain_results_s: int = 30 * 86400  # AUK_RETAIN_RESULTS
    retain_sweep_interval_s: int = 3600  # AUK_RETAIN_SWEEP_INTERVAL
    s3_public_endpoint: str | None = None  # AUK_S3_PUBLIC_ENDPOINT: the host presigned URLs name (else the endpoint)
    metrics_port: int | None = None  # AUK_METRICS_PORT: a worker's Prometheus port (unset: no metrics server)
    metrics_host: str = "127.0.0.1"  # AUK_METRICS_HOST: the address it listens on (0.0.0.0 for a scraper elsewhere)
    log_format: str | None = None  # AUK_LOG_FORMAT: json or text (unset: text on a terminal, json otherwise)
    log_level: str = "INFO"  # AUK_LOG_LEVEL: the API's log level (a worker takes --loglevel)
    api_host: str = "127.0.0.1"  # AUK_API_HOST: the address `python -m api` binds
    api_port: int = 8000  # AUK_API_PORT: the port `python -m api` binds
    instant_step_delay_s: float = 0.0  # AUK_INSTANT_STEP_DELAY: the instant pipeline's seconds per step (tests)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        bucket = _get(env, "AUK_S3_BUCKET") or "auk"
        checkpoint = _get(env, "AUK_CHECKPOINT")
        api_keys = tuple(k.strip() for k in (_get(env, "AUK_API_KEYS") or "").split(",") if k.strip())
        storage_backoff = _positive(env, "AUK_STORAGE_RETRY_BACKOFF", 1.0)
        storage_backoff_max = _positive(env, "AUK_STORAGE_RETRY_BACKOFF_MAX", 30.0)
        if storage_backoff > storage_backoff_max:
            raise ConfigError(f"AUK_STORAGE_RETRY_BACKOFF ({storage_backoff:g} s) must not exceed "
                              f"AUK_STORAGE_RETRY_BACKOFF_MAX ({storage_backoff_max:g} s)")  # fmt: skip
        redis_url = _redis_url(env)
        return cls(
            redis_url=redis_url,
            redis_sentinel_master=_get(env, "AUK_REDIS_SENTINEL_MASTER") or "mymaster",
            redis_wait_replicas=_int(env, "AUK_REDIS_WAIT_REPLICAS", 1 if is_sentinel(redis_url) else 0, minimum=0),
            redis_wait_timeout_s=_positive(env, "AUK_REDIS_WAIT_TIMEOUT", 1.0),
            s3_endpoint=_url(env, "AUK_S3_ENDPOINT", ("http", "https"), None),
            s3_region=_get(env, "AUK_S3_REGION") or "us-east-1",
            s3_access_key=_get(env, "AUK_S3_ACCESS_KEY"),
            s3_secret_key=_get(env, "AUK_S3_SECRET_KEY"),
            s3_bucket=bucket,
            s3_input_bucket=_get(env, "AUK_S3_INPUT_BUCKET"),
            s3_input_prefix=_prefix(_get(env, "AUK_S3_INPUT_PREFIX")),
            s3_prefix=_prefix(_get(env, "AUK_S3_PREFIX")),
            api_keys=api_keys,
            visibility_timeout=_int(env, "AUK_VISIBILITY_TIMEOUT", 3600, minimum=1),
            deploy_config=Path(_get(env, "AUK_DEPLOY_CONFIG") or "config/auk.yaml"),
            voices_file=Path(voices_file) if (voices_file := _get(env, "AUK_VOICES_FILE")) else None,
            checkpoint=Path(checkpoint) if checkpoint else None,
            variant=_choice(env, "AUK_VARIANT", VARIANTS, None),
            presign_seconds=_int(env, "AUK_PRESIGN_SECONDS", 3600, minimum=1),
            max_upload_bytes=_int(env, "AUK_MAX_UPLOAD_BYTES", 50 * 1024 * 1024, minimum=1),
            max_recording_s=_float(env, "AUK_MAX_RECORDING_SECONDS", 3600.0, minimum=30.0),
            max_kills=_int(env, "AUK_MAX_KILLS", 3, minimum=1),
            fault_kill_after_fetch=_int(env, "AUK_FAULT_KILL_AFTER_FETCH", 0, minimum=0),
            pipeline=_choice(env, "AUK_PIPELINE", PIPELINES, "auk"),
            retry_max=_int(env, "AUK_RETRY_MAX", 6, minimum=0),
            retry_backoff_s=_positive(env, "AUK_RETRY_BACKOFF", 1.0),
            webhook_allow=_allow_list(env, "AUK_WEBHOOK_ALLOW"),
            webhook_threads=_int(env, "AUK_WEBHOOK_THREADS", 2, minimum=0),
            webhook_timeout_s=_positive(env, "AUK_WEBHOOK_TIMEOUT", 10.0),
            webhook_retry_base_s=_positive(env, "AUK_WEBHOOK_RETRY_BASE", 30.0),
            webhook_retry_cap_s=_positive(env, "AUK_WEBHOOK_RETRY_CAP", 6 * 3600.0),
            webhook_max_attempts=_int(env, "AUK_WEBHOOK_MAX_ATTEMPTS", 15, minimum=1),
            link_secret=_get(env, "AUK_LINK_SECRET"),
            link_seconds=_int(env, "AUK_LINK_SECONDS", 3600, minimum=1),
            worker_id=worker_id_or_none(_get(env, "AUK_WORKER_ID")),
            stall_timeout=_int(env, "AUK_STALL_TIMEOUT", 120, minimum=10),
            stop_grace_s=_float(env, "AUK_STOP_GRACE", 30.0, minimum=0),
            store_behind=_choice(env, "AUK_STORE_BEHIND", STORE_BEHIND, "auto"),
            cache_dir=Path(cache_dir) if (cache_dir := _get(env, "AUK_CACHE_DIR")) else None,
            variant_check=_choice(env, "AUK_VARIANT_CHECK", VARIANT_CHECKS, "live"),
            storage_retry_deadline_s=_positive(env, "AUK_STORAGE_RETRY_DEADLINE", 1800.0),
            storage_retry_backoff_s=storage_backoff,
            storage_retry_backoff_max_s=storage_backoff_max,
            voice_cache_bytes=_int(env, "AUK_VOICE_CACHE_BYTES", 512 * 1024 * 1024, minimum=0),
            speech_timeout_s=_int(env, "AUK_SPEECH_TIMEOUT", 300, minimum=1),
            fetch_allow=_allow_list(env, "AUK_FETCH_ALLOW"),
            body_timeout_s=_float(env, "AUK_API_BODY_TIMEOUT", 15.0, minimum=0.1),
            body_min_rate=_int(env, "AUK_API_BODY_MIN_RATE", 1024, minimum=1),
            keep_alive_s=_int(env, "AUK_API_KEEP_ALIVE", 5, minimum=1),
            quota_queued_jobs=_int(env, "AUK_QUOTA_QUEUED_JOBS", 50_000, minimum=0),
            quota_rate=_float(env, "AUK_QUOTA_RATE", 50.0, minimum=0),
            quota_burst=_int(env, "AUK_QUOTA_BURST", 200, minimum=1),
            quota_in_flight=_int(env, "AUK_QUOTA_IN_FLIGHT", 4, minimum=0),
            quota_in_flight_queue=_int(env, "AUK_QUOTA_IN_FLIGHT_QUEUE", 64, minimum=0),
            bulk_queue_depth=_int(env, "AUK_BULK_QUEUE_DEPTH", 8, minimum=1),
            retain_records_s=_duration(env, "AUK_RETAIN_RECORDS", 30 * 86400),
            retain_uploads_s=_duration(env, "AUK_RETAIN_UPLOADS", 7 * 86400),
            retain_results_s=_duration(env, "AUK_RETAIN_RESULTS", 30 * 86400),
            retain_sweep_interval_s=max(1, _duration(env, "AUK_RETAIN_SWEEP_INTERVAL", 3600)),
            s3_public_endpoint=_url(env, "AUK_S3_PUBLIC_ENDPOINT", ("http", "https"), None),
            metrics_port=_int(env, "AUK_METRICS_PORT", 0, minimum=0) or None,
            metrics_host=_get(env, "AUK_METRICS_HOST") or "127.0.0.1",
            log_format=_choice(env, "AUK_LOG_FORMAT", LOG_FORMATS, None),
            log_level=_choice(env, "AUK_LOG_LEVEL", LOG_LEVELS, "INFO", upper=True),
            api_host=_get(env, "AUK_API_HOST") or "127.0.0.1",
            api_port=_port(env, "AUK_API_PORT", 8000),
            instant_step_delay_s=_seconds_or_zero(env, "AUK_INSTANT_STEP_DELAY", 0.0),
        ).checked()

    def checked(self) -> Settings:
        """Refuse an input location that overlaps what the service writes (uploads, results, manifests): there,
        one key's ``audio.key`` could name another key's upload or result."""
        if self.s3_input_bucket is None:
            if self.s3_input_prefix:
                raise ConfigError("AUK_S3_INPUT_PREFIX is set without AUK_S3_INPUT_BUCKET")
            return self
        if self.s3_input_bucket == self.s3_bucket:
            written = self.s3_prefix
            if self.s3_input_prefix.startswith(written) or written.startswith(self.s3_input_prefix):
                raise ConfigError(
                    f"the input location {self.s3_input_bucket}/{self.s3_input_prefix} overlaps where the service "
                    f"writes uploads and results ({self.s3_bucket}/{written}); give AUK_S3_INPUT_PREFIX a prefix "
                    "outside AUK_S3_PREFIX, or AUK_S3_INPUT_BUCKET another bucket"
                )
        return self

    def require_storage(self) -> None:
        """Refuse to go on without an S3 endpoint and credentials (there are no insecure defaults)."""
        for name, value in (
            ("AUK_S3_ENDPOINT", self.s3_endpoint),
            ("AUK_S3_ACCESS_KEY", self.s3_access_key),
            ("AUK_S3_SECRET_KEY", self.s3_secret_key),
        ):
            if not value:
                raise ConfigError(f"{name} is required")

    def require_api_keys(self) -> None:
        if not self.api_keys:
            raise ConfigError("AUK_API_KEYS is required: a comma-separated list of bearer keys")

    def require_worker(self) -> None:
        """A worker needs storage, a variant and (for the real pipeline) a checkpoint."""
        self.require_storage()
        if self.variant is None:
            raise ConfigError("AUK_VARIANT is required for a worker (base or flash)")
        if self.pipeline == "auk" and self.checkpoint is None:
            raise ConfigError("AUK_CHECKPOINT is required for a worker (the checkpoint directory)")
