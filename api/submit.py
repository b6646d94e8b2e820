"""The one submit path: every route that creates jobs (``POST /v1/jobs``, ``POST /v1/batches``,
``POST /v1/audio/speech``) goes through here; ``submit_job`` says what the speech endpoint hands in differently.

In order, and nothing written until all of it holds: the body has passed ``JobRequest`` (bounds from ``rules.py``);
the clip is resolved (an upload of this key, or an object in the operator's input location that decodes); the length rule is
applied in latent frames to the clip's exact sample count and rate (``rules.target_frames``, the worker's own
call). Then the record is written, and only then is the task sent by name: ``auk.render`` to
``auk.{variant}.{priority}``, or for a batch ``auk.render_group`` tasks of compatible jobs
(``auk_worker/service/queues/grouping.py``), staged per key and released to the variant's bulk queue round-robin across
keys (``auk_worker/service/queues/fairshare.py``).

Before any of that, some live worker must serve the job's variant (``api/variants.py``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
import time
from typing import Any, NoReturn

import kombu.exceptions
import redis
from botocore.exceptions import BotoCoreError, ClientError

from api.deps import Services
from api.variants import require_worker_for
from api.voicing import VoiceBook, compose
from auk_worker.service.records.voices import Voice
from auk_worker.voice_catalogue import NamedVoice
from auk_worker import rules
from auk_worker.audio import decode_audio
from auk_worker.errors import InfraError, InputError
from auk_worker.longform.plan import is_long, plan_request
from auk_worker.service.queues.celery_app import RENDER_TASK, queue_name
from auk_worker.service.queues.grouping import RENDER_GROUP_TASK, group_limits, in_line_order, plan_groups
from auk_worker.service.records.jobs import JobRecord
from auk_worker.service.records.transitions import IdempotencyKeyTaken
from api.quotas import check_queued_jobs
from auk_worker.service.records.requests import JobRequest
from auk_worker.service.connect.redis import RedisFailedOver
from auk_worker.service.connect.storage import error_code
from auk_worker.service.records.objects import input_object
from auk_worker.types import FRAME_RATE

log = logging.getLogger(__name__)

MAX_REPORTED_LINES = 100  # a 10 000-line file of bad lines answers with the first hundred
MAX_IDEMPOTENCY_KEY = 255  # characters of an Idempotency-Key header (jobs and batches)
# A job's send is tried again for this long while the broker refuses it: a Sentinel failover names a new master in a
# few seconds past the sentinels' down-after time. Past it the request answers 503 and the caller retries.
SEND_WINDOW_S = 15.0
SEND_FIRST_DELAY_S = 0.1
SEND_MAX_DELAY_S = 1.0
SEND_ERRORS = (kombu.exceptions.OperationalError, redis.RedisError, OSError)  # what a broker away raises

ClipSource = Callable[[JobRequest], "dict[str, Any] | None"]  # a request -> its resolved clip (ClipResolver.resolve)


class ClipResolver:
    """Turns a request's audio reference into the clip a worker will read, checking it exists and decodes.

    One resolver serves a whole batch, so a clip named on many lines is fetched and decoded once, and so is a
    key that is missing, too large or undecodable: its error is kept and raised again for every later line.
    """

    def __init__(self, svc: Services, owner: str) -> None:
        self.svc = svc
        self.owner = owner
        self.voices = VoiceBook(svc, owner)
        self._by_key: dict[str, dict[str, Any]] = {}
        self._failed: dict[str, InputError] = {}

    def resolve(self, request: JobRequest) -> dict[str, Any] | None:
        """``{"bucket", "key", "duration_s", "sample_rate", "samples"}`` for the clip, or None without audio.

        Raises ``InputError`` for an upload that is not the caller's, a missing key or a file that does not decode,
        ``InfraError`` when storage does not answer.
        """
        if request.voice is not None:  # a clip voice's clip; a described voice has none (``api/voicing.py``)
            return self.voices.clip(request.voice)
        audio = request.audio
        if audio is None:
            return None
        if audio.upload_id is not None:
            upload = self.svc.uploads.get(audio.upload_id, self.owner)
            if upload is None:
                message = f"audio.upload_id: no upload {audio.upload_id!r} for this API key"
                raise InputError(message, code="unknown_upload")
            return {"bucket": self.svc.storage.bucket, "key": upload.key, "duration_s": upload.duration_s,
                    "sample_rate": upload.sample_rate, "samples": upload.samples,
                    "sha256": upload.sha256 or None}  # fmt: skip
        key = audio.key
        if key in self._failed:
            raise self._failed[key].with_traceback(None)  # the same error, without a traceback grown per line
        if key not in self._by_key:
            try:
                self._by_key[key] = self._inspect(key)
            except InputError as exc:  # the caller's errors: storage faults are InfraError
                self._failed[key] = exc
                raise
        return dict(self._by_key[key])

    def _inspect(self, key: str) -> dict[str, Any]:
        """The clip ``audio.key`` names in the operator's input location (never the service's uploads or
        results: settings keep the two apart), its size checked before it is downloaded."""
        bucket, object_key = input_object(self.svc.settings, key)
        size = self._input_size(bucket, object_key, key)
        limit = self.svc.settings.max_upload_bytes
        if size > limit:
            raise InputError(f"audio.key {key!r} is {size} bytes; the limit is {limit}", code="too_large")
        data = self.svc.storage.get_bytes(bucket, object_key)
        clip = decode_audio(data, max_seconds=self.svc.settings.max_recording_s)
        return {"bucket": bucket, "key": object_key, "duration_s": round(clip.duration_s, 6),
                "sample_rate": clip.sample_rate, "samples": len(clip.samples),
                "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip

    def _input_size(self, bucket: str, object_key: str, key: str) -> int:
        """HEAD the input object: its size, before anything is downloaded; a missing key is the caller's error,
        named as the caller gave it."""
        try:
            head = self.svc.storage.client.head_object(Bucket=bucket, Key=object_key)
        except ClientError as exc:
            code = error_code(exc)
            if code in ("404", "NoSuchKey", "NotFound"):
                message = f"audio.key: no object {key!r} in the input location"
                raise InputError(message, code="audio_not_found") from None
            if code in ("400", "InvalidArgument", "KeyTooLongError"):  # the key itself, not the storage
                raise InputError(f"audio.key: the storage refuses the key {key!r} ({code})", code="invalid_key") from None
            raise InfraError(f"storage head {bucket}/{object_key} failed: {exc}") from exc
        except BotoCoreError as exc:
            raise InfraError(f"storage head {bucket}/{object_key} failed: {exc}") from exc
        return int(head.get("ContentLength", 0))


def record_request(request: JobRequest, clip: dict[str, Any] | None) -> dict[str, Any]:
    """The record's ``request``: the validated body, the resolved clip, the plan (``longform/plan.py``: the
    instruction the service wrote, the estimated length, a long job's segments or windows) and the target length in
    seconds, once the length rule holds for the clip's exact sample count and rate (the frames the worker will
    count). ``duration`` says how long the output will be and how that was decided."""
    frames = None if clip is None else rules.clip_frames(clip["samples"], clip["sample_rate"])
    plan = plan_request(request, clip)
    if plan is None or plan["kind"] == "single":
        rules.target_frames(request.gen_seconds if plan is None else plan["gen_seconds"], frames)
    if plan is not None:
        duration = plan["duration"]
    elif request.gen_seconds is not None:
        duration = {"seconds": request.gen_seconds, "source": "given", "segments": 1}
    else:
        duration = {"seconds": frames / FRAME_RATE, "source": "clip", "segments": 1}
    out = {**request.model_dump(mode="json"), "clip": clip, "target_seconds": duration["seconds"],
           "duration": duration}  # fmt: skip
    if plan is not None:
        out["plan"] = plan
    return out


def prepare(request: JobRequest, resolver: ClipResolver) -> dict[str, Any]:
    """``record_request`` with the request's clip resolved and its text composed into an instruction
    (``api/voicing.py``)."""
    clip = resolver.resolve(request)
    voice = resolver.voices.find(request.voice) if request.voice is not None else None
    return record_request(compose(request, clip, voice, default_voice=resolver.voices.catalogue.default), clip)


# ---------------------------------------------------------------------------------------------------- one job


def submit_job(svc: Services, owner: str, request: JobRequest, idempotency_key: str | None, *,
               clip_source: ClipSource | None = None, reply: bool | str = False,
               length_field: str = "gen_seconds", voice: NamedVoice | Voice | None = None) -> tuple[JobRecord, bool]:
    """Check, write and send one job: ``(record, True)``; or ``(the earlier job, False)`` when this key already made
    one for this same request (a different request under a used key is refused). Either way the record is on the
    current Redis master (and its replicas) before the caller hears of it.

    ``POST /v1/jobs`` and ``POST /v1/audio/speech`` both come here, through the same checks (webhook URL, a worker
    for the variant, the key's queued-jobs quota), the same record write and send, and the same replication
    barrier. The speech endpoint differs in what it hands in, and only there:

    - ``clip_source``: how the clip is found. By default an upload, a voice or an input key (``ClipResolver``); the
      speech endpoint's may also decode and store an inline ``ref_audio`` (``api/requests.py: resolve_clip``).
    - ``reply``: the worker pushes the encoded audio to ``auk:reply:{id}`` before it stores it, for the waiting
      speech request (``delivery/replies.py``); ``"stream"``: in pieces as they are encoded (``auk_worker/streaming.py``).
    - ``length_field``: the name the caller knows the length by (``duration_seconds``), for the errors; ``voice``:
      a ``VoiceDesign`` request's described voice, in place of one found by name.
    - ``idempotency_key``: None from the speech endpoint. OpenAI's speech request has no Idempotency-Key: its answer
      is the audio itself, so a retried request has no job id to find and renders again.
    """
    resolver = ClipResolver(svc, owner)
    record, created = _submit_job(svc, owner, request, idempotency_key, clip_source or resolver.resolve, reply,
                                  resolver.voices, length_field, voice)  # fmt: skip
    svc.barrier.wait(f"job {record.id}")
    return record, created


def _submit_job(svc: Services, owner: str, request: JobRequest, idempotency_key: str | None,
                clip_source: ClipSource, reply: bool | str, voices: VoiceBook,
                length_field: str, voice: NamedVoice | Voice | None) -> tuple[JobRecord, bool]:  # fmt: skip
    if idempotency_key is not None:
        existing = svc.store.by_idempotency_key(owner, idempotency_key)
        if existing is not None:
            return _same_request(existing, request, idempotency_key), False
    check_webhook_url(svc, request.webhook_url)
    require_worker_for(svc, {request.variant})
    check_queued_jobs(svc.store, owner, 1, svc.settings.quota_queued_jobs)
    clip = clip_source(request)
    if voice is None and request.voice is not None:
        voice = voices.find(request.voice)
    prepared = record_request(compose(request, clip, voice, default_voice=voices.catalogue.default,
                                      length_field=length_field), clip)
    if reply:
        prepared["reply"] = reply
    queue = queue_name(request.variant, request.priority)
    record = JobRecord.new(owner, prepared, queue=queue, custom_id=request.custom_id)
    record, created = svc.store.create(record, idempotency_key=idempotency_key)
    if not created:  # another request with the same key got there first
        return _same_request(record, request, idempotency_key), False
    send_render(svc, record)
    log.info("job %s: queued on %s for owner %s%s", record.id, record.queue, owner, " (reply)" if reply else "")
    return record, True


def _same_request(existing: JobRecord, request: JobRequest, idempotency_key: str | None) -> JobRecord:
    """The job an earlier request with this Idempotency-Key made, if this request is the same one, so that a caller
    never takes another job for its own."""
    sent = request.model_dump(mode="json", exclude_none=True)  # what the record made of a text is not compared
    if any(existing.request.get(field) != value for field, value in sent.items()):
        raise InputError(f"Idempotency-Key {idempotency_key!r} was used for job {existing.id} with a different "
                         "request; use a new key for a new job", code="idempotency_key_reused")  # fmt: skip
    return existing


def send_render(svc: Services, record: JobRecord) -> None:
    """Send the task for a written record.

    A broker that refuses the connection is most often a Redis master going away, with the sentinels about to name
    another: the send is tried again for ``SEND_WINDOW_S``. A send that got through only on a later try may have
    reached a new master that never had the record (written to the old one a moment before it died), so the record
    is looked for there: gone, the request answers 503 ``redis_failover`` and the caller's retry, under the same
    ``Idempotency-Key``, makes the job again (the message sent meanwhile meets no record and is dropped). When the
    window passes, the record fails instead of idling forever, and the request answers 503."""
    deadline = time.monotonic() + SEND_WINDOW_S
    delay, tries = SEND_FIRST_DELAY_S, 0
    while True:
        tries += 1
        try:
            svc.celery.send_task(RENDER_TASK, args=[record.id], queue=record.queue)
            break
        except SEND_ERRORS as exc:
            if time.monotonic() + delay > deadline:
                _fail_unsent(svc, record.id, exc)
            log.warning("job %s: send %d refused (%s); trying again in %.1f s", record.id, tries, exc, delay)
            time.sleep(delay)
            delay = min(2 * delay, SEND_MAX_DELAY_S)
        except Exception as exc:  # noqa: BLE001 - not the broker away: another try would fail the same way
            _fail_unsent(svc, record.id, exc)
    if tries > 1:
        _require_record_after_retry(svc, record.id)


def _fail_unsent(svc: Services, job_id: str, exc: Exception) -> NoReturn:
    message = f"the job could not be enqueued: {exc}"
    try:
        svc.store.fail(job_id, InfraError.code, message)
    except redis.RedisError as fail_exc:  # the record stays queued; the resender sends it (ops/resend.py)
        log.error("job %s: could not record its failure to enqueue: %s", job_id, fail_exc)
    raise InfraError(message) from exc


def _require_record_after_retry(svc: Services, job_id: str) -> None:
    """After a send that needed more than one try: the record must be on the master the send reached."""
    try:
        found = svc.store.get(job_id) is not None
    except redis.RedisError as exc:
        raise InfraError(f"job {job_id} was sent but its record could not be read back ({exc}); try again with "
                         "the same Idempotency-Key") from exc  # fmt: skip
    if not found:
        log.error("job %s: its record was lost with a failed-over Redis master", job_id)
        raise RedisFailedOver(f"Redis failed over while job {job_id} was written and it was lost; try again (with "
                              "the same Idempotency-Key)")  # fmt: skip


# ---------------------------------------------------------------------------------------------------- a batch


def check_webhook_url(svc: Services, url: str | None) -> None:
    """A webhook URL the guard refuses (loopback, private, link-local, metadata, unless ``AUK_WEBHOOK_ALLOW`` names
    it; or a host that does not resolve) is the caller's error, named with the field."""
    if url is None:
        return
    try:
        svc.webhook_guard.check(url)
    except InputError as exc:
        raise InputError(f"webhook_url: {exc.message}", code=exc.code) from None


def submit_batch(svc: Services, owner: str, lines: list[tuple[int, JobRequest]], bad: list[dict],
                 webhook_url: str | None = None, idempotency: tuple[str, str] | None = None) -> tuple[dict, bool]:
    """Check every line (``(line number, request)``, plus the lines the caller already found ``bad``), then write
    the batch and send its groups: ``({"id", "total"}, True)``. Any bad line: InputError ``invalid_batch`` listing
    them, nothing written. ``webhook_url`` is called with the batch's record once its manifest is stored.

    ``idempotency``: ``(Idempotency-Key, fingerprint of the request)``. A key that made a batch for the same
    request answers that batch, ``(..., False)``, and writes nothing; for another request it is refused."""
    if idempotency is not None:
        earlier = _earlier_batch(svc, owner, *idempotency)
        if earlier is not None:
            return earlier, False
    check_webhook_url(svc, webhook_url)
    require_worker_for(svc, {request.variant for _, request in lines})
    resolver = ClipResolver(svc, owner)
    bad = list(bad)
    good: list[tuple[JobRequest, dict[str, Any]]] = []
    for number, request in lines:
        try:
            good.append((request, prepare(request, resolver)))
        except InputError as exc:
            bad.append({"line": number, "message": exc.message})
    if bad:
        shown = sorted(bad, key=lambda item: item["line"])[:MAX_REPORTED_LINES]
        numbers = ", ".join(str(item["line"]) for item in shown)
        more = f" (first {len(shown)} of {len(bad)} shown)" if len(bad) > len(shown) else ""
        raise InputError(f"{len(bad)} bad line(s), nothing enqueued: line {numbers}{more}", code="invalid_batch",
                         details=shown)  # fmt: skip
    check_queued_jobs(svc.store, owner, len(good), svc.settings.quota_queued_jobs)
    records = [
        JobRecord.new(owner, prepared, queue=queue_name(request.variant, "bulk"), custom_id=request.custom_id)
        for request, prepared in good
    ]
    try:
        batch_id = svc.store.create_batch(owner, records, idempotency)
    except IdempotencyKeyTaken:  # an identical request a moment ahead of this one
        earlier = _earlier_batch(svc, owner, *idempotency)
        if earlier is None:
            raise InfraError("the batch's Idempotency-Key was taken and its batch is gone; try again") from None
        return earlier, False
    svc.batches.register(batch_id, owner, webhook_url)
    max_jobs, defaults = group_limits(svc.settings.deploy_config)
    short = [record for record in records if not is_long(record.request.get("plan"))]
    groups = plan_groups(short, max_jobs, defaults) if max_jobs > 1 else [[record] for record in short]
    groups += [[record] for record in records if is_long(record.request.get("plan"))]  # a long job: its own task
    groups = in_line_order(groups, records)
    stage_groups(svc, owner, groups)
    svc.barrier.wait(f"batch {batch_id}")
    log.info("batch %s: %d jobs staged as %d task(s) for owner %s", batch_id, len(records), len(groups), owner)
    return {"id": batch_id, "total": len(records)}, True


def batch_fingerprint(body: bytes, webhook_url: str | None) -> str:
    """What a retried ``POST /v1/batches`` must repeat to get the batch its key made: the body's bytes and the
    webhook."""
    digest = hashlib.sha256(body)
    digest.update(b"\0" + (webhook_url or "").encode())
    return digest.hexdigest()


def _earlier_batch(svc: Services, owner: str, key: str, fingerprint: str) -> dict | None:
    found = svc.store.batch_by_idempotency_key(owner, key)
    if found is None:
        return None
    batch_id, made_for = found
    if made_for != fingerprint:
        raise InputError(f"Idempotency-Key {key!r} was used for batch {batch_id} with a different request; use a "
                         "new key for a new batch", code="idempotency_key_reused")  # fmt: skip
    batch = svc.store.get_batch(batch_id)
    return {"id": batch_id, "total": batch["total"] if batch else 0}


def group_task(group: list[JobRecord]) -> tuple[str, list]:
    """The task for a group: ``auk.render`` for a lone job, ``auk.render_group`` otherwise."""
    if len(group) == 1:
        return RENDER_TASK, [group[0].id]
    return RENDER_GROUP_TASK, [[record.id for record in group]]


def stage_groups(svc: Services, owner: str, groups: list[list[JobRecord]]) -> None:
    """Stage a batch's tasks for the bulk feeder (``fairshare.py``: released round-robin across keys), then feed
    once so that an idle queue starts at once. Staging refused (Redis down): the batch's records fail."""
    try:
        svc.fair.stage(owner, groups[0][0].queue, [group_task(group) for group in groups])
    except redis.RedisError as exc:
        message = f"the batch could not be enqueued: {exc}"
        for group in groups:
            for record in group:
                try:
                    svc.store.fail(record.id, InfraError.code, message)
                except redis.RedisError:
                    break
        raise InfraError(message) from exc
    try:
        svc.fair.feed(svc.send)
    except Exception as exc:  # noqa: BLE001 - staged work is safe; a feeder thread sends it later
        log.warning("bulk feed after staging: %s", exc)
