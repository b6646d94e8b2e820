"""AUK_REDIS_URL's two forms as the settings, the client factory and the Celery broker read them (no server needed;
tests/service/test_sentinel.py runs them against real sentinels)."""

from __future__ import annotations

import pytest
from redis.sentinel import SentinelConnectionPool

from auk_worker.errors import ConfigError
from auk_worker.service.queues.celery_app import make_celery
from auk_worker.service.connect.redis import broker_transport_options, broker_url, redis_client
from auk_worker.service.connect.redis_url import SentinelAddress, parse_sentinel_url
from auk_worker.service.connect.settings import Settings

URL = "sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26380;sentinel://sentinel-3:26381/2"


def test_parse_every_sentinel_and_the_database_at_the_end() -> None:
    assert parse_sentinel_url(URL) == SentinelAddress(
        (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("sentinel-3", 26381)), db=2
    )
    assert parse_sentinel_url("sentinel://h:1").db == 0
    secret = parse_sentinel_url("sentinel://:p%40ss@h1:1;sentinel://h2:2/0")
    assert secret.password == "p@ss" and secret.username is None


@pytest.mark.parametrize("bad", [
    "sentinel://h1:26379;redis://h2:6379/0",  # every part must be a sentinel
    "sentinel://h1;sentinel://h2:1/0",  # a port is required
    "sentinel://h1:1/0;sentinel://h2:2/1",  # two databases
    "sentinel://h1:1/zero",
])  # fmt: skip
def test_bad_sentinel_urls_are_refused_at_start(bad: str) -> None:
    with pytest.raises(ConfigError, match="AUK_REDIS_URL"):
        Settings.from_env({"AUK_REDIS_URL": bad})


def test_settings_defaults_one_server_and_sentinel() -> None:
    one = Settings.from_env({})
    assert one.redis_url == "redis://127.0.0.1:6379/0" and one.redis_wait_replicas == 0
    ha = Settings.from_env({"AUK_REDIS_URL": URL, "AUK_REDIS_SENTINEL_MASTER": "auk"})
    assert ha.redis_sentinel_master == "auk" and ha.redis_wait_replicas == 1 and ha.redis_wait_timeout_s == 1.0
    assert Settings.from_env({"AUK_REDIS_URL": URL}).redis_sentinel_master == "mymaster"
    assert Settings.from_env({"AUK_REDIS_URL": URL, "AUK_REDIS_WAIT_REPLICAS": "0"}).redis_wait_replicas == 0
    with pytest.raises(ConfigError):
        Settings.from_env({"AUK_REDIS_URL": "http://h:1"})


def test_factory_gives_a_sentinel_managed_client_and_the_broker_the_same_sentinels() -> None:
    settings = Settings.from_env({"AUK_REDIS_URL": "sentinel://:pw@10.0.0.1:26379;sentinel://10.0.0.2:26380/2",
                                  "AUK_REDIS_SENTINEL_MASTER": "auk"})  # fmt: skip
    client = redis_client(settings)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "auk"
    assert pool.connection_kwargs["db"] == 2 and pool.connection_kwargs["password"] == "pw"
    assert pool.connection_class.__name__ == "_MasterConnection"  # re-asks the sentinels on every reconnect
    # kombu reads the database from the first part; every part carries it (and the master's password).
    assert broker_url(settings) == "sentinel://:pw@10.0.0.1:26379/2;sentinel://:pw@10.0.0.2:26380/2"
    assert broker_transport_options(settings) == {"master_name": "auk"}
    conf = make_celery(settings).conf
    assert conf.broker_transport_options["master_name"] == "auk"
    assert conf.broker_url.startswith("sentinel://")
    assert conf.broker_pool_limit is None  # every send asks the sentinels: no pooled connection to a demoted master
    plain = Settings.from_env({"AUK_REDIS_URL": "redis://h:6380/1"})
    assert broker_url(plain) == "redis://h:6380/1" and broker_transport_options(plain) == {}
    assert redis_client(plain).connection_pool.connection_kwargs["port"] == 6380
    assert make_celery(plain).conf.broker_pool_limit == 10
