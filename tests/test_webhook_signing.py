"""Standard Webhooks signing and verification, without Redis: the reference library's published test vector, the
secret format, and every reason ``verify`` refuses a request."""

from __future__ import annotations

import base64
import json
from datetime import datetime, timezone

import pytest

from auk_worker.errors import InputError
from auk_worker.service.delivery.webhooks.signing import (
    EVENT_TYPES,
    WebhookVerificationError,
    event_body,
    new_secret,
    sign,
    signed_headers,
    verify,
)
from auk_worker.service.delivery.webhooks.store import RetryPolicy

# The vector of the reference Python library's tests (standard-webhooks/standard-webhooks,
# libraries/python/tests/test_webhooks.py: test_sign_function).
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TIMESTAMP = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_signature_matches_the_reference_vector() -> None:
    assert sign(VECTOR_SECRET, VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY) == VECTOR_SIGNATURE
    assert sign(VECTOR_SECRET.removeprefix("whsec_"), VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY) == VECTOR_SIGNATURE
    headers = {"Webhook-Id": VECTOR_ID, "Webhook-Timestamp": str(VECTOR_TIMESTAMP),
               "Webhook-Signature": VECTOR_SIGNATURE}  # header names are case-insensitive
    verify(VECTOR_SECRET, headers, VECTOR_BODY, now=VECTOR_TIMESTAMP + 10)
    verify(VECTOR_SECRET, headers, VECTOR_BODY.decode(), now=VECTOR_TIMESTAMP - 10)


def test_new_secrets_are_whsec_base64_of_24_to_64_random_bytes() -> None:
    secret = new_secret()
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 32
    assert new_secret() != secret
    assert len(base64.b64decode(new_secret(64)[6:])) == 64
    for bad in (23, 65):
        with pytest.raises(ValueError, match="24 to 64"):
            new_secret(bad)
    with pytest.raises(ValueError, match="base64"):
        sign("whsec_not base64!", "msg_1", 1, b"")


def refusal(headers: dict[str, str], body: bytes, secret: str, now: float) -> str:
    with pytest.raises(WebhookVerificationError) as info:
        verify(secret, headers, body, now=now)
    assert isinstance(info.value, InputError) and info.value.code == "invalid_webhook_signature"
    return info.value.message


def test_verify_refuses_tampering_replays_and_missing_headers() -> None:
    secret, now = new_secret(), 1_700_000_000
    body = event_body("job.succeeded", {"id": "j1"})
    headers = signed_headers([secret], "msg_abc", now, body)
    verify(secret, headers, body, now=now)
    assert "no webhook-signature matches" in refusal(headers, body.replace(b"j1", b"j2"), secret, now)
    assert "no webhook-signature matches" in refusal(headers, body + b" ", secret, now)
    assert "no webhook-signature matches" in refusal(headers, body, new_secret(), now)
    assert "no webhook-signature matches" in refusal({**headers, "webhook-id": "msg_abd"}, body, secret, now)
    assert "301 s too old" in refusal(headers, body, secret, now + 301)
    assert "301 s too new" in refusal(headers, body, secret, now - 301)
    verify(secret, headers, body, now=now + 1000, tolerance_s=1000)
    assert "not integer seconds" in refusal({**headers, "webhook-timestamp": "soon"}, body, secret, now)
    for name in ("webhook-id", "webhook-timestamp", "webhook-signature"):
        assert "missing" in refusal({k: v for k, v in headers.items() if k != name}, body, secret, now)
    # a timestamp changed by the sender's clock but signed with the old one
    assert "no webhook-signature matches" in refusal({**headers, "webhook-timestamp": str(now + 1)}, body, secret, now)


def test_any_of_several_signatures_verifies() -> None:
    old, new, now = new_secret(), new_secret(), 1_700_000_000
    headers = signed_headers([new, old], "msg_rot", now, b"{}")
    assert len(headers["webhook-signature"].split(" ")) == 2
    verify(old, headers, b"{}", now=now)
    verify(new, headers, b"{}", now=now)
    odd = {**headers, "webhook-signature": "v1a,AAAA v2,xyz " + headers["webhook-signature"]}
    verify(new, odd, b"{}", now=now)


def test_event_body_is_compact_json_with_type_timestamp_and_data() -> None:
    at = datetime(2025, 1, 31, 22, 4, 5, 123000, tzinfo=timezone.utc)
    body = event_body("batch.completed", {"id": "b1", "counts": {"succeeded": 2}}, at)
    assert body == (b'{"type":"batch.completed","timestamp":"2025-01-31T22:04:05.123Z",'
                    b'"data":{"id":"b1","counts":{"succeeded":2}}}')
    assert json.loads(event_body("job.failed", {"note": "naïve"}))["data"]["note"] == "naïve"
    assert set(EVENT_TYPES) == {"job.succeeded", "job.failed", "job.canceled", "batch.completed"}
    with pytest.raises(ValueError, match="unknown webhook event type"):
        event_body("job.started", {})


def test_retry_delays_grow_exponentially_up_to_the_cap_with_full_jitter() -> None:
    policy = RetryPolicy(base_s=10, cap_s=100)
    assert [policy.delay(n, 1.0) for n in range(1, 7)] == [10, 20, 40, 80, 100, 100]
    assert policy.delay(3, 0.0) == 0 and policy.delay(3, 0.25) == 10
    defaults = RetryPolicy()
    bounds = [defaults.delay(n, 1.0) for n in range(1, defaults.max_attempts)]
    assert bounds[0] == 30 and bounds[-4:] == [6 * 3600] * 4 and sum(bounds) < defaults.max_age_s
