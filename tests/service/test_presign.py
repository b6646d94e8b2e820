"""Locally signed presigned URLs: the same URL botocore signs at the same instant, and SeaweedFS (which enforces
signatures and expiry) serves them, refuses them tampered with and refuses them expired."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from unittest import mock

import boto3
import httpx
import pytest
from botocore.config import Config

from auk_worker.service.connect import presign
from tests.service.conftest import BUCKET

KEYS = ["jobs/plain.wav", "jobs/with space+plus&amp=eq.wav", "jobs/ünïcode/ok~tilde_(1).wav"]


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:8333", "https://s3.example.com", "http://minio:80"])
@pytest.mark.parametrize("key", KEYS)
def test_the_url_is_botocores(endpoint: str, key: str) -> None:
    at = datetime(2026, 12, 4, 22, 30, 5, tzinfo=timezone.utc)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="AKID",
                          aws_secret_access_key="secret/key+1",
                          config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))  # fmt: skip
    with mock.patch("botocore.auth.get_current_datetime", return_value=at.replace(tzinfo=None)):
        expected = client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=900)
    assert presign.presign_get(endpoint, "us-east-1", "AKID", "secret/key+1", BUCKET, key, 900, now=at) == expected


def test_seaweedfs_serves_checks_and_expires_them(storage) -> None:
    for key in KEYS:
        storage.put_bytes(key, key.encode(), "application/octet-stream")
        url = storage.presign_get(key, 60)
        fetched = httpx.get(url)
        assert fetched.status_code == 200 and fetched.content == key.encode(), (key, fetched.text[:300])
        tampered = url.replace("X-Amz-Expires=60", "X-Amz-Expires=61")
        assert httpx.get(tampered).status_code == 403
    short = storage.presign_get(KEYS[0], 1)
    time.sleep(2.1)
    assert httpx.get(short).status_code == 403
