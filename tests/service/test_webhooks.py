"""Webhook deliveries against a real receiver: an HTTP server on loopback (real sockets) that verifies every request
with ``verify``, fails on purpose as told, and records each attempt; real Redis underneath.

Backoff is shrunk to tenths of a second so that the retries are seen in test time.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis

from auk_worker.service.delivery.webhooks.dispatch import WebhookDispatcher
from auk_worker.service.delivery.webhooks.signing import WebhookVerificationError, verify
from auk_worker.service.delivery.webhooks.store import RetryPolicy, WebhookSecrets, WebhookStore, delivery_id_for
from auk_worker.urlguard import UrlGuard, UrlPolicy
from tests.service.harness import REPO, VENV_BIN, wait_until

OWNER = "owner-a"


@dataclass
class Seen:
    at: float  # time.monotonic() when the request arrived
    headers: dict[str, str]
    body: bytes
    verified: str | None  # None when ``verify`` accepted it, else its refusal
    answered: int


class Receiver:
    """A webhook endpoint: ``answer(n)`` gives the status for a delivery's n-th request (1-based)."""

    def __init__(self, secret: Callable[[], str], answer: Callable[[int], int] = lambda n: 200,
                 hold_s: float = 0.0) -> None:
        self.secret = secret
        self.answer = answer
        self.hold_s = hold_s
        self.seen: list[Seen] = []
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                receiver.handle(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def handle(self, request: http.server.BaseHTTPRequestHandler) -> None:
        at = time.monotonic()
        body = request.rfile.read(int(request.headers.get("Content-Length", 0)))
        headers = {name.lower(): value for name, value in request.headers.items()}
        msg_id = headers.get("webhook-id", "")
        with self.lock:
            self.in_flight[msg_id] += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight[msg_id])
            attempt = sum(1 for s in self.seen if s.headers.get("webhook-id") == msg_id) + 1
        try:
            verify(self.secret(), headers, body)
            verified = None
        except WebhookVerificationError as exc:
            verified = exc.message
        time.sleep(self.hold_s)
        status = self.answer(attempt)
        with self.lock:
            self.seen.append(Seen(at, headers, body, verified, status))
            self.in_flight[msg_id] -= 1
        request.send_response(status)
        request.send_header("Content-Length", "4")
        request.end_headers()
        request.wfile.write(b"nope" if status >= 300 else b"ok!!")

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def secrets(redis_client: redis.Redis) -> WebhookSecrets:
    return WebhookSecrets(redis_client)


@pytest.fixture
def make_dispatcher(redis_client: redis.Redis, secrets: WebhookSecrets) -> Iterator[Callable[..., WebhookDispatcher]]:
    """Dispatchers on loopback (the guard allows 127.0.0.1 only); stopped at teardown."""
    made: list[WebhookDispatcher] = []

    def make(policy: RetryPolicy, guard: UrlGuard | None = None, **options: object) -> WebhookDispatcher:
        store = WebhookStore(redis_client, policy=policy)
        options = {"timeout_s": 2.0, "threads": 2, "idle_s": 0.02, **options}
        dispatcher = WebhookDispatcher(store, secrets, guard or UrlGuard(UrlPolicy.parse("127.0.0.1")), **options)
        made.append(dispatcher)
        return dispatcher

    yield make
    for dispatcher in made:
        dispatcher.close()


def wait_for_state(store: WebhookStore, delivery_id: str, state: str, timeout: float = 20.0) -> dict:
    wait_until(f"delivery {delivery_id} {state}", lambda: store.state(delivery_id)["state"] == state, timeout)
    return store.state(delivery_id)


def test_retries_with_growing_delays_then_delivered_and_signed(make_dispatcher, secrets) -> None:
    with Receiver(lambda: secrets.get(OWNER), answer=lambda n: 500 if n <= 3 else 204) as receiver:
        dispatcher = make_dispatcher(RetryPolicy(base_s=0.3, cap_s=5, max_attempts=6), jitter=lambda: 1.0)
        record = {"id": "job1", "status": "succeeded", "result": {"key": "jobs/job1.wav"}}
        delivery_id = dispatcher.store.enqueue(OWNER, receiver.url(), "job.succeeded", record)
        pending = dispatcher.store.state(delivery_id)  # read before the dispatcher starts: no attempt yet
        assert pending["state"] == "pending" and pending["attempts"] == 0 and pending["next_attempt_at"].endswith("Z")
        assert pending["last_status"] is None and pending["last_error"] is None and pending["delivered_at"] is None
        dispatcher.start()
        state = wait_for_state(dispatcher.store, delivery_id, "delivered")

    assert state["attempts"] == 4 and state["last_status"] == 204 and state["last_error"] is None
    assert state["delivered_at"].endswith("Z") and state["next_attempt_at"] is None
    assert [s.answered for s in receiver.seen] == [500, 500, 500, 204]
    assert all(s.verified is None for s in receiver.seen), [s.verified for s in receiver.seen]
    assert {s.headers["webhook-id"] for s in receiver.seen} == {delivery_id}
    assert all(s.headers["content-type"] == "application/json" for s in receiver.seen)
    gaps = [b.at - a.at for a, b in zip(receiver.seen, receiver.seen[1:])]
    # jitter pinned to 1: 0.3, 0.6, 1.2 s (each at least that, and each later one longer)
    assert all(gap >= expected * 0.95 for gap, expected in zip(gaps, [0.3, 0.6, 1.2])), gaps
    assert gaps[0] < gaps[1] < gaps[2], gaps
    event = receiver.seen[-1].body
    assert event.startswith(b'{"type":"job.succeeded","timestamp":"') and b'"data":{"id":"job1"' in event

    # the receiver's checks: a tampered body or a replay later than the tolerance is refused
    last = receiver.seen[-1]
    secret = secrets.get(OWNER)
    with pytest.raises(WebhookVerificationError, match="no webhook-signature matches"):
        verify(secret, last.headers, last.body.replace(b"job1", b"job2"))
    with pytest.raises(WebhookVerificationError, match="too old"):
        verify(secret, last.headers, last.body, now=int(last.headers["webhook-timestamp"]) + 301)


def test_a_receiver_that_always_fails_ends_failed_after_the_maximum(make_dispatcher, secrets) -> None:
    with Receiver(lambda: secrets.get(OWNER), answer=lambda n: 503) as receiver:
        dispatcher = make_dispatcher(RetryPolicy(base_s=0.05, cap_s=0.1, max_attempts=3)).start()
        delivery_id = dispatcher.store.enqueue(OWNER, receiver.url(), "job.failed", {"id": "job2"})
        state = wait_for_state(dispatcher.store, delivery_id, "failed")
        time.sleep(0.3)  # nothing more is sent after the final state
    assert state["attempts"] == 3 and state["last_status"] == 503
    assert state["last_error"] == "receiver answered 503: nope" and state["delivered_at"] is None
    assert len(receiver.seen) == 3 and all(s.verified is None for s in receiver.seen)
    assert dispatcher.store.redis.zcard(dispatcher.store.due_key) == 0


def test_gone_stops_at_once_and_unreachable_receivers_are_retried(make_dispatcher, secrets) -> None:
    with Receiver(lambda: secrets.get(OWNER), answer=lambda n: 410) as receiver:
        dispatcher = make_dispatcher(RetryPolicy(base_s=0.05, max_attempts=5)).start()
        gone = dispatcher.store.enqueue(OWNER, receiver.url(), "job.canceled", {"id": "job3"})
        assert wait_for_state(dispatcher.store, gone, "failed")["attempts"] == 1
        closed = receiver.url()
    refused = dispatcher.store.enqueue(OWNER, closed, "job.canceled", {"id": "job4"})  # its server is gone
    state = wait_for_state(dispatcher.store, refused, "failed")
    assert state["attempts"] == 5 and state["last_status"] is None and "ConnectError" in state["last_error"]


def test_retry_after_is_honoured(make_dispatcher, secrets) -> None:
    class Throttling(Receiver):
        def handle(self, request) -> None:  # the first answer is a 429 asking for 0.6 s
            if not self.seen:
                self.seen.append(Seen(time.monotonic(), {}, b"", None, 429))
                request.send_response(429)
                request.send_header("Retry-After", "0.6")
                request.send_header("Content-Length", "0")
                request.end_headers()
                return
            super().handle(request)

    with Throttling(lambda: secrets.get(OWNER)) as receiver:
        dispatcher = make_dispatcher(RetryPolicy(base_s=0.01, cap_s=5), jitter=lambda: 1.0).start()
        delivery_id = dispatcher.store.enqueue(OWNER, receiver.url(), "job.succeeded", {"id": "job5"})
        wait_for_state(dispatcher.store, delivery_id, "delivered")
    assert receiver.seen[1].at - receiver.seen[0].at >= 0.55


def test_two_dispatchers_never_send_one_attempt_twice(make_dispatcher, secrets) -> None:
    """Forty deliveries, each failing once, through two dispatchers of three threads: every delivery is received
    exactly twice (its two attempts), never two at once."""
    with Receiver(lambda: secrets.get(OWNER), answer=lambda n: 500 if n == 1 else 200, hold_s=0.02) as receiver:
        policy = RetryPolicy(base_s=0.05, cap_s=0.1)
        first = make_dispatcher(policy, threads=3)
        second = make_dispatcher(policy, threads=3)
        ids = [first.store.enqueue(OWNER, receiver.url(f"/hook/{n}"), "job.succeeded", {"id": f"job{n}"})
               for n in range(40)]
        first.start(), second.start()
        wait_until("all delivered", lambda: all(first.store.state(i)["state"] == "delivered" for i in ids), 60)
    counts = Counter(s.headers["webhook-id"] for s in receiver.seen)
    assert counts == Counter({i: 2 for i in ids})
    assert receiver.max_in_flight == 1
    assert all(first.store.state(i)["attempts"] == 2 for i in ids)


def test_a_crashed_dispatchers_lease_runs_out_and_its_late_outcome_is_ignored(make_dispatcher, secrets) -> None:
    with Receiver(lambda: secrets.get(OWNER)) as receiver:
        dispatcher = make_dispatcher(RetryPolicy(base_s=0.05))
        delivery_id = dispatcher.store.enqueue(OWNER, receiver.url(), "batch.completed", {"id": "b1"})
        crashed = dispatcher.store.claim(lease_s=0.5)  # claimed, then never finished
        assert crashed is not None and dispatcher.store.claim(lease_s=0.5) is None  # nobody else takes it meanwhile
        dispatcher.start()
        state = wait_for_state(dispatcher.store, delivery_id, "delivered")
        delivery, token = crashed
        assert not dispatcher.store.finish(delivery, token, "failed", error="late")
    assert state["attempts"] == 2 and len(receiver.seen) == 1
    assert dispatcher.store.state(delivery_id)["state"] == "delivered"


def test_the_guard_is_asked_again_at_send_time(make_dispatcher, secrets) -> None:
    """The receiver's name resolves to an allowed address for the first attempt and to a private one for the
    second: the second attempt is not sent, and the delivery fails with the guard's reason."""
    with Receiver(lambda: secrets.get(OWNER), answer=lambda n: 500) as receiver:
        answers = iter([["127.0.0.1"], ["10.0.0.7"]])
        guard = UrlGuard(UrlPolicy.parse("127.0.0.1"), resolver=lambda host, port: next(answers))
        dispatcher = make_dispatcher(RetryPolicy(base_s=0.05), guard=guard).start()
        port = receiver.httpd.server_address[1]
        delivery_id = dispatcher.store.enqueue(OWNER, f"http://hooks.test:{port}/hook", "job.succeeded", {"id": "j"})
        state = wait_for_state(dispatcher.store, delivery_id, "failed")
    assert len(receiver.seen) == 1 and receiver.seen[0].headers["host"] == f"hooks.test:{port}"
    assert state["attempts"] == 2 and "url_not_allowed" in state["last_error"] and "10.0.0.7" in state["last_error"]


def test_secrets_are_per_owner_and_rotate_with_a_grace_period(redis_client, make_dispatcher) -> None:
    secrets = WebhookSecrets(redis_client, grace_s=60)
    first = secrets.get(OWNER)
    assert secrets.get(OWNER) == first and secrets.get("owner-b") != first
    assert secrets.signing_secrets(OWNER) == [first]
    second = secrets.rotate(OWNER)
    assert secrets.get(OWNER) == second != first and secrets.signing_secrets(OWNER) == [second, first]

    with Receiver(lambda: first) as receiver:  # a receiver that still holds the old secret
        dispatcher = make_dispatcher(RetryPolicy(base_s=0.05))
        dispatcher.secrets = secrets
        dispatcher.start()
        delivery_id = dispatcher.store.enqueue(OWNER, receiver.url(), "job.succeeded", {"id": "j"})
        wait_for_state(dispatcher.store, delivery_id, "delivered")
    assert receiver.seen[0].verified is None
    verify(second, receiver.seen[0].headers, receiver.seen[0].body)  # and the new secret verifies it too

    redis_client.hset(secrets.key(OWNER), "previous_until", time.time() - 1)  # the grace period is over
    assert secrets.signing_secrets(OWNER) == [second]


def test_enqueue_with_a_delivery_id_is_idempotent(redis_client) -> None:
    store = WebhookStore(redis_client)
    delivery_id = delivery_id_for("job", "abc123")
    assert delivery_id == "msg_job_abc123"
    first = store.enqueue(OWNER, "https://example.com/a", "job.succeeded", {"n": 1}, delivery_id=delivery_id)
    assert first == delivery_id
    store.enqueue(OWNER, "https://example.com/b", "job.failed", {"n": 2}, delivery_id=delivery_id)
    delivery = store.get(delivery_id)
    assert delivery.url == "https://example.com/a" and delivery.event_type == "job.succeeded"
    assert redis_client.zcard(store.due_key) == 1
    with pytest.raises(ValueError, match="delivery id"):
        store.enqueue(OWNER, "https://example.com/", "job.succeeded", {}, delivery_id="msg.with.dots")
    assert store.state("msg_missing") is None


def test_standalone_dispatcher_process(redis_server, redis_client, secrets, tmp_path) -> None:
    """``python -m auk_worker.service.delivery.webhooks`` delivers what the API process enqueued, and stops on SIGTERM."""
    log_path = tmp_path / "webhooks.log"
    with Receiver(lambda: secrets.get(OWNER)) as receiver, open(log_path, "wb") as log_file:
        proc = subprocess.Popen([str(VENV_BIN / "python") if VENV_BIN.exists() else sys.executable, "-m",
                                 "auk_worker.service.delivery.webhooks", "--redis-url", redis_server.url, "--allow", "127.0.0.1",
                                 "--idle", "0.05"], cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            store = WebhookStore(redis_client)
            delivery_id = store.enqueue(OWNER, receiver.url(), "job.succeeded", {"id": "j"})
            wait_for_state(store, delivery_id, "delivered", timeout=30)
        finally:
            proc.terminate()
            returncode = proc.wait(timeout=20)
    assert returncode == 0, log_path.read_text()
    assert len(receiver.seen) == 1 and receiver.seen[0].verified is None
