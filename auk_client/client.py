"""``Client``: the AuK render service's API from Python, one method per operation, typed results.

    from auk_client import Client

    with Client("http://127.0.0.1:8000", api_key="...") as auk:
        voice = auk.create_voice("ref.wav", name="narrator")
        speech = auk.speech('Say the following with the same voice: "Hello."', voice=voice.voice_id,
                            duration_seconds=2.0, response_format="flac")
        speech.save("hello.flac")

        job = auk.wait_job(auk.create_job("Say ...", voice=voice.voice_id, gen_seconds=3).id)
        audio = auk.download(job)

Every non-2xx answer raises ``ApiError`` with the service's status, error code and message (and ``details``, e.g.
a batch's bad lines); an unreachable API raises ``ApiError`` with status 0. HTTP only (httpx); the presigned
result URLs are fetched without the API key.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

from auk_client.types import Batch, Job, Speech, Upload, Voice, parse_server_timing

DEFAULT_TIMEOUT_S = 60.0
PAGE = 200


class ApiError(Exception):
    """The API refused a request (``status``, ``code``, ``message``, ``details``), or could not be reached
    (``status`` 0)."""

    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(f"HTTP {status} {code}: {message}" if status else message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details

    @classmethod
    def from_response(cls, response: httpx.Response) -> ApiError:
        try:
            error = response.json()["error"]
            return cls(response.status_code, str(error.get("code")), str(error.get("message")), error.get("details"))
        except (ValueError, KeyError, TypeError):
            return cls(response.status_code, "http_error", response.text[:500])


def _body(**fields: Any) -> dict[str, Any]:
    """The JSON body without the fields left as None (the service's defaults apply)."""
    return {name: value for name, value in fields.items() if value is not None}


class Client:
    """A client of one AuK render service under one API key. Thread-safe as httpx's client is; close it (or use
    it as a context manager) to release its connections."""

    def __init__(self, base_url: str, api_key: str, timeout: float = DEFAULT_TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None) -> None:  # fmt: skip
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, transport=transport,
                                 headers={"Authorization": f"Bearer {api_key}"})  # fmt: skip

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # ---------------------------------------------------------------------------------------------- plumbing

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, "unreachable", f"cannot reach the API at {self.http.base_url}: {exc}") from None
        if response.is_error:
            raise ApiError.from_response(response)
        return response

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Any API call, answered with its parsed JSON (the escape hatch for what has no method yet)."""
        return self._send(method, path, **kwargs).json()

    # ---------------------------------------------------------------------------------------------- uploads

    def upload(self, file: str | Path | bytes, filename: str = "clip") -> Upload:
        """Upload a clip (a path or the file's bytes); jobs then name it as ``audio={"upload_id": ...}``."""
        data, name = _read(file, filename)
        return Upload.from_json(self.request("POST", "/v1/uploads", files={"file": (name, data)}))

    # ---------------------------------------------------------------------------------------------- jobs

    def create_job(self, instruction: str, *, gen_seconds: float | None = None, voice: str | None = None,
                   upload_id: str | None = None, audio_key: str | None = None, variant: str | None = None,
                   num_inference_steps: int | None = None, guidance_scale: float | None = None,
                   sway: float | None = None, seed: int | None = None, response_format: str | None = None,
                   custom_id: str | None = None, priority: str | None = None,
                   idempotency_key: str | None = None) -> Job:  # fmt: skip
        """Enqueue one render. The clip is at most one of ``voice`` (a voice_id), ``upload_id`` or ``audio_key``
        (an object in the service's input bucket). A repeated ``idempotency_key`` returns the job it made."""
        audio = _body(upload_id=upload_id, key=audio_key) or None
        body = _body(instruction=instruction, gen_seconds=gen_seconds, voice=voice, audio=audio, variant=variant,
                     num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, sway=sway, seed=seed,
                     response_format=response_format, custom_id=custom_id, priority=priority)  # fmt: skip
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return Job.from_json(self.request("POST", "/v1/jobs", json=body, headers=headers))

    def submit_job(self, body: dict[str, Any], idempotency_key: str | None = None) -> Job:
        """Enqueue one render from a ready request body (the fields of ``POST /v1/jobs``)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return Job.from_json(self.request("POST", "/v1/jobs", json=body, headers=headers))

    def get_job(self, job_id: str) -> Job:
        return Job.from_json(self.request("GET", f"/v1/jobs/{job_id}"))

    def find_job(self, job_id: str) -> Job | None:
        """The job, or None when this key has no such job (a 404)."""
        try:
            return self.get_job(job_id)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list_jobs(self, *, status: str | None = None, batch_id: str | None = None,
                  page_size: int = PAGE) -> Iterator[Job]:  # fmt: skip
        """The key's jobs, newest first (a batch's in submission order), fetched a page at a time."""
        cursor: str | None = None
        while True:
            params = _body(status=status, batch_id=batch_id, limit=page_size, cursor=cursor)
            page = self.request("GET", "/v1/jobs", params=params)
            yield from (Job.from_json(item) for item in page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def cancel_job(self, job_id: str) -> Job:
        return Job.from_json(self.request("POST", f"/v1/jobs/{job_id}/cancel"))

    def wait_job(self, job_id: str, *, interval: float = 0.5, timeout: float | None = None) -> Job:
        """Poll until the job is terminal; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get_job(job_id)
            if job.done:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.status} after {timeout} s")
            time.sleep(interval)

    def download(self, job: Job | str, dest: str | Path | None = None) -> bytes:
        """A succeeded job's audio bytes (through its presigned URL); written to ``dest`` as well when given."""
        job = self.get_job(job) if isinstance(job, str) else job
        if job.status != "succeeded" or job.result is None or not job.result.url:
            raise ApiError(409, "not_succeeded", f"job {job.id} is {job.status}; only a succeeded job has audio")
        data = self.fetch_url(job.result.url)
        if dest is not None:
            Path(dest).write_bytes(data)
        return data

    def fetch_url(self, url: str) -> bytes:
        """GET a presigned URL (its signature is its authority: no API key is sent)."""
        try:
            with httpx.Client(timeout=self.http.timeout, follow_redirects=True) as plain:
                response = plain.get(url)
        except httpx.HTTPError as exc:
            raise ApiError(0, "unreachable", f"download failed: {exc}") from None
        if response.is_error:
            raise ApiError(response.status_code, "download_failed", f"download failed: HTTP {response.status_code}")
        return response.content

    # ---------------------------------------------------------------------------------------------- batches

    def create_batch(self, lines: Iterable[dict[str, Any]] | str | Path | bytes,
                     idempotency_key: str | None = None) -> Batch:  # fmt: skip
        """Enqueue a batch: job request dicts (each with a ``custom_id``), or a JSONL file's path or bytes. A
        repeated ``idempotency_key`` with the same lines returns the batch it made (post again after a 503 or a
        dropped connection without enqueuing twice)."""
        if isinstance(lines, (str, Path)):
            data = Path(lines).read_bytes()
        elif isinstance(lines, bytes):
            data = lines
        else:
            data = "\n".join(json.dumps(line) for line in lines).encode()
        headers = {"Content-Type": "application/x-ndjson"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        body = self.request("POST", "/v1/batches", content=data, headers=headers)
        return self.get_batch(body["id"]) if "counts" not in body else Batch.from_json(body)

    def get_batch(self, batch_id: str) -> Batch:
        return Batch.from_json(self.request("GET", f"/v1/batches/{batch_id}"))

    def find_batch(self, batch_id: str) -> Batch | None:
        try:
            return self.get_batch(batch_id)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list_batches(self, page_size: int = 20) -> Iterator[Batch]:
        """The key's batches, newest first, fetched a page at a time."""
        cursor: str | None = None
        while True:
            page = self.request("GET", "/v1/batches", params=_body(limit=page_size, cursor=cursor))
            yield from (Batch.from_json(item) for item in page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def cancel_batch(self, batch_id: str) -> Batch:
        """Cancel the batch's queued and running jobs (finished ones keep their results)."""
        return Batch.from_json(self.request("POST", f"/v1/batches/{batch_id}/cancel"))

    def batch_link(self, batch_id: str, expires_in: int | None = None) -> str:
        """A signed link to the batch's listening page (``GET /batches/{id}``), valid ``expires_in`` seconds."""
        body = self.request("GET", f"/v1/batches/{batch_id}/link", params=_body(expires_in=expires_in))
        return str(self.http.base_url).rstrip("/") + body["path"]

    def batch_jobs(self, batch_id: str) -> list[Job]:
        return list(self.list_jobs(batch_id=batch_id))

    def wait_batch(self, batch_id: str, *, interval: float = 1.0, timeout: float | None = None) -> Batch:
        """Poll until the batch is ``done`` (its manifest stored); ``TimeoutError`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self.get_batch(batch_id)
            if batch.done:
                return batch
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} is still {batch.status} after {timeout} s")
            time.sleep(interval)

    # ---------------------------------------------------------------------------------------------- voices

    def create_voice(self, file: str | Path | bytes | None = None, *, upload_id: str | None = None,
                     name: str = "", filename: str = "voice") -> Voice:  # fmt: skip
        """A reusable voice from a clip (a path or bytes) or from an upload made earlier."""
        if (file is None) == (upload_id is None):
            raise ValueError("give a file or an upload_id")
        if upload_id is not None:
            body = self.request("POST", "/v1/voices", json=_body(upload_id=upload_id, name=name or None))
        else:
            data, fname = _read(file, filename)
            body = self.request("POST", "/v1/voices", files={"file": (fname, data)}, data={"name": name})
        return Voice.from_json(body)

    def list_voices(self) -> list[Voice]:
        return [Voice.from_json(item) for item in self.request("GET", "/v1/voices")["data"]]

    def get_voice(self, voice_id: str) -> Voice:
        return Voice.from_json(self.request("GET", f"/v1/voices/{voice_id}"))

    def delete_voice(self, voice_id: str) -> None:
        self.request("DELETE", f"/v1/voices/{voice_id}")

    # ---------------------------------------------------------------------------------------------- speech

    def speech(self, instructions: str = "", *, input: str = "", voice: str | None = None,
               ref_audio: str | bytes | None = None, duration_seconds: float | None = None,
               response_format: str = "wav", task_type: str | None = None, model: str | None = None,
               variant: str | None = None, seed: int | None = None, num_inference_steps: int | None = None,
               guidance_scale: float | None = None, timeout: float | None = None) -> Speech:  # fmt: skip
        """``POST /v1/audio/speech``: render and answer with the audio. ``instructions`` is the whole AuK
        instruction (or give ``input`` with ``task_type`` ``Base``/``CustomVoice``); the clip is a ``voice`` id or
        ``ref_audio`` (a clip's bytes, sent as base64, or a URL the service may fetch)."""
        if isinstance(ref_audio, bytes):
            import base64

            ref_audio = base64.b64encode(ref_audio).decode()
        body = _body(model=model, input=input, instructions=instructions or None, voice=voice, ref_audio=ref_audio,
                     duration_seconds=duration_seconds, response_format=response_format, task_type=task_type,
                     variant=variant, seed=seed, num_inference_steps=num_inference_steps,
                     guidance_scale=guidance_scale)  # fmt: skip
        response = self._send("POST", "/v1/audio/speech", json=body,
                              timeout=self.http.timeout if timeout is None else timeout)  # fmt: skip
        return Speech(audio=response.content, content_type=response.headers.get("content-type", ""),
                      job_id=response.headers.get("x-job-id", ""),
                      timings_ms=parse_server_timing(response.headers.get("server-timing", "")))  # fmt: skip


def _read(file: str | Path | bytes, filename: str) -> tuple[bytes, str]:
    if isinstance(file, bytes):
        return file, filename
    path = Path(file)
    return path.read_bytes(), path.name
