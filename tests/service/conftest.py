"""Fixtures for the service tests: one real redis-server and one SeaweedFS S3 server per session, on free loopback
ports in a temporary directory; worker processes started and stopped per test.

Each test gets an empty Redis database and its own key prefix in the bucket, so tests never see each other's data.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from auk_worker.service.records.store import JobStore
from auk_worker.service.connect.settings import Settings
from auk_worker.service.connect.storage import Storage
from tests.service.harness import RedisServer, S3Server, WorkerProcess, connection_env

BUCKET = "auk-test"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.service)


@pytest.fixture(scope="session")
def service_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("service")


@pytest.fixture(scope="session")
def redis_server(service_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer(service_dir / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(service_dir: Path) -> Iterator[S3Server]:
    server = S3Server(service_dir / "s3").start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def store(redis_client: redis.Redis) -> JobStore:
    return JobStore(redis_client)


@pytest.fixture
def service_env(
    request: pytest.FixtureRequest, redis_server: RedisServer, s3_server: S3Server, redis_client: redis.Redis
) -> dict[str, str]:
    """The ``AUK_*`` environment of one test: its own key prefix, fast retries, a short visibility timeout."""
    prefix = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:60]
    return connection_env(
        redis_server, s3_server, S3_BUCKET=BUCKET, S3_PREFIX=prefix, VARIANT="base", PIPELINE="instant",
        VISIBILITY_TIMEOUT="3", RETRY_BACKOFF="0.5", RETRY_MAX="6", MAX_KILLS="3",
    )


@pytest.fixture
def settings(service_env: dict[str, str]) -> Settings:
    return Settings.from_env(service_env)


@pytest.fixture
def storage(settings: Settings) -> Storage:
    storage = Storage(settings)
    storage.ensure_buckets()
    return storage


@pytest.fixture
def start_worker(service_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker processes: ``start_worker("w1", AUK_INSTANT_STEP_DELAY="0.1")``; all stopped at teardown."""
    started: list[WorkerProcess] = []

    def start(hostname: str, extra_args: list[str] | None = None, **env: str) -> WorkerProcess:
        worker = WorkerProcess({**service_env, **env}, hostname, tmp_path, extra_args).start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.terminate(timeout=20)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from auk_worker.tiny.checkpoint import make_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny") / "auk-tiny-base"
    return Path(make_tiny_checkpoint(out, "base"))

