"""The request guard over real HTTP: raw sockets against ``python -m api`` (uvicorn), the session's Redis and
SeaweedFS.

Each test sends what a hostile or broken client sends (a huge chunked body without a key, a chunked body past the
route's limit, a body that trickles or stops) and asserts when the answer came, how much of the body the API had to
take, and that its memory and writes did not grow by it. Then the per-key quotas: request rate, requests in flight
and queued jobs, each a 429 with ``Retry-After`` that leaves the other keys alone.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.harness import ApiProcess, free_port

KEY_A, KEY_B = "key-guard-alpha-0123456789", "key-guard-bravo-0123456789"
MiB = 1 << 20


@pytest.fixture
def start_api(service_env: dict[str, str], tmp_path: Path) -> Iterator:
    started: list[ApiProcess] = []

    def start(**extra: str) -> ApiProcess:
        env = {**service_env, "AUK_API_KEYS": f"{KEY_A},{KEY_B}", "AUK_API_BODY_TIMEOUT": "1", **extra}
        api = ApiProcess(env, free_port(), tmp_path / f"api-{len(started)}.log").start()
        started.append(api)
        return api

    yield start
    for api in started:
        api.stop()


def proc_stat(pid: int) -> tuple[int, int]:
    """(resident memory, bytes written through write() so far) of a process: spooling a body to disk shows in the
    second, buffering it in the first."""
    rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))  # fmt: skip
    wchar = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/io").read_text().splitlines()
                 if line.startswith("wchar:"))  # fmt: skip
    return rss, wchar


class RawRequest:
    """One request over a raw socket: headers, then a body sent piece by piece while a thread reads the answer."""

    def __init__(self, port: int, head: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(head.encode())
        self.sent = 0
        self.answer = b""
        self.answered_at: float | None = None
        self.started = time.monotonic()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                self.answer += chunk
                if self.answered_at is None and b"\r\n\r\n" in self.answer:
                    self.answered_at = time.monotonic()
        except OSError:
            pass
        if self.answered_at is None and self.answer:
            self.answered_at = time.monotonic()

    def send(self, data: bytes, chunked: bool) -> bool:
        """Send one piece; False once the API has answered or closed (the client stops there)."""
        if self.answered_at is not None:
            return False
        try:
            self.sock.sendall(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        except OSError:
            return False
        self.sent += len(data)
        return True

    def close(self) -> None:
        """Hang up (the reading thread's ``recv`` returns at once)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def result(self, timeout: float = 30) -> tuple[int, dict, float]:
        """(status, JSON body, seconds from the start to the answer)."""
        self._reader.join(timeout)
        self.close()
        assert self.answered_at is not None, "no answer"
        head, _, rest = self.answer.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
        body = rest[:length]  # the first answer only
        return status, json.loads(body) if body.startswith(b"{") else {}, self.answered_at - self.started


def _head(method: str, path: str, key: str | None, content_type: str, length: int | None = None) -> str:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return "\r\n".join(lines) + "\r\n\r\n"


BOUNDARY = "guard-boundary"
FILE_PART = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.wav"\r\n'
             "Content-Type: audio/wav\r\n\r\n").encode()  # fmt: skip


def _stream(api: ApiProcess, head: str, total: int, first: bytes = b"") -> tuple[int, dict, float, int]:
    """Send ``first`` and then zeros, chunked, until ``total`` bytes or the API's answer."""
    request = RawRequest(api.port, head)
    if first:
        request.send(first, chunked=True)
    block = b"\0" * (64 * 1024)
    while request.sent < total and request.send(block, chunked=True):
        pass
    status, body, seconds = request.result()
    return status, body, seconds, request.sent


def test_an_unauthenticated_chunked_upload_is_refused_before_its_body(start_api) -> None:
    api = start_api()
    rss, written = proc_stat(api.proc.pid)
    head = _head("POST", "/v1/uploads", None, f"multipart/form-data; boundary={BOUNDARY}")
    status, body, seconds, sent = _stream(api, head, 64 * MiB, FILE_PART)
    assert status == 401 and body["error"]["code"] == "unauthorized", body
    assert seconds < 2, seconds
    assert sent < 32 * MiB, f"the API took {sent / MiB:.0f} MiB of an unauthenticated body"
    rss_after, written_after = proc_stat(api.proc.pid)
    assert rss_after - rss < 16 * MiB and written_after - written < 1 * MiB, (rss_after - rss, written_after - written)
    assert httpx.get(f"{api.url}/healthz").status_code == 200


def test_a_chunked_json_body_past_the_limit_is_cut_early(start_api) -> None:
    api = start_api()
    rss, _ = proc_stat(api.proc.pid)
    status, body, seconds, sent = _stream(api, _head("POST", "/v1/jobs", KEY_A, "application/json"), 300 * MiB)
    assert status == 413 and body["error"]["code"] == "too_large" and "1048576 bytes" in body["error"]["message"]
    assert sent < 32 * MiB and seconds < 5, (sent, seconds)
    assert proc_stat(api.proc.pid)[0] - rss < 16 * MiB
    # A chunked upload past AUK_MAX_UPLOAD_BYTES is cut the same way, whatever its headers do not say.
    small = start_api(AUK_MAX_UPLOAD_BYTES=str(MiB))
    head = _head("POST", "/v1/uploads", KEY_A, f"multipart/form-data; boundary={BOUNDARY}")
    status, body, seconds, sent = _stream(small, head, 64 * MiB, FILE_PART)
    assert status == 413 and f"{MiB} bytes" in body["error"]["message"] and sent < 32 * MiB, (status, body, sent)
    # A body that lies about its length is read only up to the limit too.
    lying = RawRequest(api.port, _head("POST", "/v1/jobs", KEY_A, "application/json", length=1000))
    lying.send(b"{" * (4 * MiB), chunked=False)
    assert lying.result()[0] in (400, 413)


def test_a_stalled_or_trickling_body_is_cut(start_api) -> None:
    api = start_api()  # AUK_API_BODY_TIMEOUT=1; AUK_API_BODY_MIN_RATE at its default, 1024 bytes per second
    stalled = RawRequest(api.port, _head("POST", "/v1/jobs", KEY_A, "application/json", length=200))
    stalled.send(b'{"instruction": ', chunked=False)
    status, body, seconds = stalled.result(timeout=10)
    assert status == 408 and body["error"]["code"] == "body_timeout" and 0.9 < seconds < 3, (status, body, seconds)

    # A byte every 0.3 s never pauses a whole second, but averages far below the minimum rate.
    trickle = RawRequest(api.port, _head("POST", "/v1/jobs", KEY_A, "application/json"))
    while trickle.send(b" ", chunked=True) and time.monotonic() - trickle.started < 10:
        time.sleep(0.3)
    status, body, seconds = trickle.result(timeout=10)
    assert status == 408 and "too slowly" in body["error"]["message"] and seconds < 4, (status, body, seconds)

    # A body that arrives at a normal pace is not cut.
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
        ok = http.post("/v1/jobs", json={"instruction": "fine", "gen_seconds": 1})
        assert ok.status_code == 202, ok.text


def _closed_after(sock: socket.socket, trickle: bytes, limit_s: float) -> float | None:
    """Send ``trickle`` a byte every 0.3 s; the seconds until the API closed the connection (None: still open)."""
    started = time.monotonic()
    sock.settimeout(0.3)
    for byte in trickle:
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(1024) == b"":
                return time.monotonic() - started
        except socket.timeout:
            pass
        except OSError:
            return time.monotonic() - started
        if time.monotonic() - started > limit_s:
            return None
    return None


def test_a_silent_or_trickling_request_head_is_cut(start_api) -> None:
    api = start_api()  # AUK_API_BODY_TIMEOUT=1 bounds the head too
    silent = socket.create_connection(("127.0.0.1", api.port))
    silent.settimeout(5)
    started = time.monotonic()
    assert silent.recv(1024) == b"" and time.monotonic() - started < 3  # closed, nothing sent to it
    head = b"GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 100
    seconds = _closed_after(socket.create_connection(("127.0.0.1", api.port)), head, limit_s=6)
    assert seconds is not None and seconds < 3, seconds
    # A keep-alive connection: the first request is answered, a trickled second head is cut.
    conn = socket.create_connection(("127.0.0.1", api.port))
    conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert conn.recv(4096).startswith(b"HTTP/1.1 200")
    seconds = _closed_after(conn, head, limit_s=6)
    assert seconds is not None and seconds < 3, seconds


def test_request_rate_is_limited_per_key(start_api) -> None:
    api = start_api(AUK_QUOTA_RATE="1", AUK_QUOTA_BURST="5")
    alpha = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY_A}"})
    bravo = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY_B}"})
    with alpha, bravo:
        assert [alpha.get("/v1/jobs").status_code for _ in range(5)] == [200] * 5
        limited = alpha.get("/v1/jobs")
        assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limited", limited.text
        assert 1 <= int(limited.headers["Retry-After"]) <= 2
        assert bravo.get("/v1/jobs").status_code == 200  # another key's bucket is its own
        # Unauthenticated requests take nothing from any bucket.
        assert httpx.get(f"{api.url}/v1/jobs").status_code == 401
        time.sleep(int(limited.headers["Retry-After"]))
        assert alpha.get("/v1/jobs").status_code == 200


def test_requests_in_flight_take_turns_per_key(start_api) -> None:
    api = start_api(AUK_QUOTA_IN_FLIGHT="2", AUK_QUOTA_IN_FLIGHT_QUEUE="1", AUK_API_BODY_TIMEOUT="20")
    held = [RawRequest(api.port, _head("POST", "/v1/jobs", KEY_A, "application/json", length=100)) for _ in range(2)]
    for request in held:
        request.send(b"{", chunked=False)
    time.sleep(0.5)
    alpha = {"Authorization": f"Bearer {KEY_A}"}
    waited: list[httpx.Response] = []
    third = threading.Thread(target=lambda: waited.append(httpx.get(f"{api.url}/v1/jobs", headers=alpha, timeout=30)))
    third.start()
    time.sleep(0.5)
    assert not waited  # the key's third request waits for a turn
    with httpx.Client(base_url=api.url, timeout=10) as http:
        fourth = http.get("/v1/jobs", headers=alpha)  # past the turns and the queue: refused
        assert fourth.status_code == 429 and fourth.json()["error"]["code"] == "too_many_concurrent_requests"
        assert fourth.headers["Retry-After"] == "1"
        started = time.monotonic()
        assert http.get("/v1/jobs", headers={"Authorization": f"Bearer {KEY_B}"}).status_code == 200
        assert time.monotonic() - started < 1  # another key's request starts at once
        held[0].close()
        third.join(timeout=10)
        assert waited and waited[0].status_code == 200
        held[1].close()
        time.sleep(0.3)
        assert http.get("/v1/jobs", headers=alpha).status_code == 200


def test_slow_bodies_waiting_for_a_turn_are_cut_on_their_own_clock(start_api) -> None:
    """Twelve stalled bodies of one valid key, two turns and room for all to wait: each body's allowance runs from
    its arrival, so every one is answered (408) about one body timeout after it arrived, not one timeout per turn
    taken before it (the last of them would wait six); and the key's next request is served."""
    api = start_api(AUK_QUOTA_IN_FLIGHT="2", AUK_QUOTA_IN_FLIGHT_QUEUE="20")  # AUK_API_BODY_TIMEOUT=1
    stalled = [RawRequest(api.port, _head("POST", "/v1/jobs", KEY_A, "application/json", length=200))
               for _ in range(12)]  # fmt: skip
    for request in stalled:
        request.send(b'{"instruction": ', chunked=False)
    answers = [request.result(timeout=10) for request in stalled]
    assert all(status == 408 for status, _, _ in answers), answers
    assert max(seconds for _, _, seconds in answers) < 2.5, answers
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=10) as http:
        ok = http.post("/v1/jobs", json={"instruction": "fine", "gen_seconds": 1})
        assert ok.status_code == 202, ok.text


def test_queued_jobs_are_limited_per_key(start_api, redis_client) -> None:
    api = start_api(AUK_QUOTA_QUEUED_JOBS="3")  # no worker runs: every job stays queued
    alpha = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY_A}"})
    bravo = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY_B}"})
    job = {"instruction": "wait", "gen_seconds": 1}
    with alpha, bravo:
        ids = [alpha.post("/v1/jobs", json=job).json()["id"] for _ in range(3)]
        refused = alpha.post("/v1/jobs", json=job)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_queued_jobs"
        assert int(refused.headers["Retry-After"]) >= 1 and "at most 3" in refused.json()["error"]["message"]
        lines = "\n".join(json.dumps({**job, "custom_id": f"c{i}"}) for i in range(2))
        batch = alpha.post("/v1/batches", content=lines, headers={"Content-Type": "application/x-ndjson"})
        assert batch.status_code == 429 and batch.json()["error"]["code"] == "too_many_queued_jobs"
        assert len(redis_client.keys("auk:job:*")) == 3  # nothing written by the refused requests
        assert bravo.post("/v1/jobs", json=job).status_code == 202
        assert alpha.post(f"/v1/jobs/{ids[0]}/cancel").status_code == 200
        assert alpha.post("/v1/jobs", json=job).status_code == 202  # a finished job frees its place
