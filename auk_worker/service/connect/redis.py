"""Every redis-py client of the service (API, worker, heartbeats, job store, quotas, speech replies; sync or
asyncio) and the Celery broker's address, built from ``AUK_REDIS_URL`` in this one place.

``AUK_REDIS_URL`` names one server (``redis://``, ``rediss://``, ``unix://``) or Redis Sentinel: every sentinel,
``;``-separated, the database number at the end, ``sentinel://h1:26379;sentinel://h2:26379;sentinel://h3:26379/0``;
the master is the one the sentinels know as ``AUK_REDIS_SENTINEL_MASTER`` (default ``mymaster``). A password in
the first part (``sentinel://:secret@h1:26379;...``) is the master's; the sentinels themselves take none.

With Sentinel, the clients are redis-py's own (``Sentinel.master_for``): every new connection asks the sentinels
for the current master, and a connection to a master that was demoted fails (``READONLY`` and a blocked command's
``UNBLOCKED`` become connection errors) so the command is tried again, on the new master, for up to about
``FAILOVER_RETRY_S`` seconds, the length of a failover. Celery's broker is kombu's own Sentinel transport over the
same sentinels.

Redis replicates asynchronously: a write the master acknowledged can be lost when the master dies before its
replicas have it, and a master that is failed over while it still runs takes writes until the sentinels demote it,
then drops them. ``ReplicationBarrier`` guards the writes that matter against both, see its docstring.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from auk_worker.errors import InfraError
from auk_worker.service.connect.redis_url import SENTINEL_SCHEME, is_sentinel, parse_sentinel_url

if TYPE_CHECKING:
    from auk_worker.service.connect.settings import Settings

log = logging.getLogger(__name__)

FAILOVER_RETRY_S = 15.0  # a command's retries on connection errors span a failover (detection + election)
_FAILOVER_RETRIES = 20  # jittered waits of up to 0.05 * 2^n s, capped at 1 s: about FAILOVER_RETRY_S at most


class _MasterConnection(SentinelManagedConnection):
    """redis-py's Sentinel connection, asking the sentinels on every reconnect. A pipeline reconnects through
    ``connect_check_health`` (redis-py 8), which the parent leaves on the address it had: after the master died,
    that retries the dead address until the retries run out instead of following the failover."""

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock is None and self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)


def redis_client(
    settings: Settings,
    *,
    socket_timeout: float = 5.0,
    socket_connect_timeout: float = 5.0,
    health_check_interval: int = 0,
    decode_responses: bool = True,
) -> redis.Redis:
    """A client for the service's Redis, one server or the Sentinel-managed master (strings decoded unless
    ``decode_responses`` is false: the replies carry audio bytes). With Sentinel, a command's connection errors are
    retried across a failover, on the master the sentinels name by then."""
    options: dict[str, Any] = {"decode_responses": decode_responses, "socket_timeout": socket_timeout,
                               "socket_connect_timeout": socket_connect_timeout,
                               "health_check_interval": health_check_interval}  # fmt: skip
    if not is_sentinel(settings.redis_url):
        return redis.Redis.from_url(settings.redis_url, **options)
    address = parse_sentinel_url(settings.redis_url)
    sentinel = Sentinel(list(address.sentinels), socket_timeout=socket_connect_timeout,
                        socket_connect_timeout=socket_connect_timeout)  # fmt: skip
    retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), _FAILOVER_RETRIES)
    return sentinel.master_for(settings.redis_sentinel_master, db=address.db, password=address.password,
                               username=address.username, retry=retry, connection_class=_MasterConnection,
                               **options)  # fmt: skip


def async_redis_client(
    settings: Settings,
    *,
    socket_timeout: float = 5.0,
    socket_connect_timeout: float = 5.0,
    decode_responses: bool = True,
) -> aioredis.Redis:
    """``redis_client`` for an asyncio caller (the API's rate limit and its speech replies, which must not hold a
    thread): the same server, or the same Sentinel-managed master through redis-py's asyncio Sentinel."""
    options: dict[str, Any] = {"decode_responses": decode_responses, "socket_timeout": socket_timeout,
                               "socket_connect_timeout": socket_connect_timeout}  # fmt: skip
    if not is_sentinel(settings.redis_url):
        return aioredis.Redis.from_url(settings.redis_url, **options)
    address = parse_sentinel_url(settings.redis_url)
    sentinel = AsyncSentinel(list(address.sentinels), socket_timeout=socket_connect_timeout,
                             socket_connect_timeout=socket_connect_timeout)  # fmt: skip
    return sentinel.master_for(settings.redis_sentinel_master, db=address.db, password=address.password,
                               username=address.username, **options)  # fmt: skip


def broker_url(settings: Settings) -> str:
    """The Celery broker URL: ``AUK_REDIS_URL`` itself, or for Sentinel every part with the database number (kombu
    reads it from the first part, where the URL form puts it on the last)."""
    if not is_sentinel(settings.redis_url):
        return settings.redis_url
    address = parse_sentinel_url(settings.redis_url)
    auth = ""
    if address.password is not None:
        auth = f"{quote(address.username or '', safe='')}:{quote(address.password, safe='')}@"
    return ";".join(f"{SENTINEL_SCHEME}://{auth}{host}:{port}/{address.db}" for host, port in address.sentinels)


def broker_pool_limit(settings: Settings) -> int | None:
    """Celery's ``broker_pool_limit``: with Sentinel none (every send connects through the sentinels), so that no
    pooled connection keeps publishing to a master that was failed over until the sentinels demote it."""
    return None if is_sentinel(settings.redis_url) else 10


def broker_transport_options(settings: Settings) -> dict[str, Any]:
    """What kombu's Sentinel transport needs beyond the URL (nothing for one server)."""
    return {"master_name": settings.redis_sentinel_master} if is_sentinel(settings.redis_url) else {}


class RedisFailedOver(InfraError):
    """Writes went to a master that the sentinels no longer name: they are lost when it rejoins as a replica."""

    code = "redis_failover"


class ReplicationBarrier:
    """Before a write is acknowledged onward, check that it is on the current master and, where the master has
    replicas, on them too.

    Called after the writes that someone relies on: the API's job and batch records and their task messages (before
    the 202), and a worker's record transitions (before the broker message is acknowledged). One marker write,
    ``WAIT`` and ``ROLE`` in one round trip: the marker follows, in the replication stream, every write acknowledged
    before it, whichever connection made them, so once a replica has it, it has them all, and Sentinel promotes the
    replica that has the most.

    When fewer replicas than ``AUK_REDIS_WAIT_REPLICAS`` confirm within ``AUK_REDIS_WAIT_TIMEOUT``, the barrier
    reads its marker back, on connections of its own, from the master the sentinels name now and from any replica of
    the last barrier that now says it is a master (promoted a moment before the sentinels announce it):

    - the marker is there: the writes are on the current master, which has lost its replicas (a replica down, or
      the master just promoted). They stand, and a warning says that a failover in the next moments can lose them.
    - the marker is not there: this process still talks to a master that was failed over. ``SENTINEL FAILOVER``
      (and a master cut off by the network) leaves the old master taking writes until the sentinels turn it into a
      replica, about ten seconds later, when it drops them. The client's connections are closed (the next ones ask
      the sentinels) and ``RedisFailedOver`` is raised: the API answers 503 and the caller retries (with the same
      ``Idempotency-Key``); a worker leaves the job to the new master's delivery, or writes its end again there.

    It asks ``WAIT`` for at most as many replicas as the master had connected at the previous barrier (``ROLE``
    rides along), so a master without replicas costs a read-back, not a timeout, per write.
    """

    WARN_EVERY_S = 10.0  # a shortfall that lasts is logged this often, not once per write

    def __init__(self, client: redis.Redis, replicas: int, timeout_s: float) -> None:
        self.client = client
        self.replicas = replicas
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self.marker_prefix = f"auk:replication:barrier:{uuid.uuid4().hex}"  # one per process; a key per thread
        self._connected = replicas  # replicas the master listed at the previous barrier
        self._replicas: list[tuple[str, int]] = []  # their addresses, from the last ROLE that listed any
        self._warned_at = -float("inf")

    @classmethod
    def from_settings(cls, client: redis.Redis, settings: Settings) -> ReplicationBarrier:
        return cls(client, settings.redis_wait_replicas, settings.redis_wait_timeout_s)

    def wait(self, what: str) -> int | None:
        """Return how many replicas confirmed (None when nothing was asked); raise ``RedisFailedOver`` when the
        writes went to a master that has been replaced."""
        if self.replicas == 0:
            return None
        want = min(self.replicas, self._connected)
        marker, key = uuid.uuid4().hex, self.marker_key()
        pipe = self.client.pipeline(transaction=False)
        pipe.set(key, marker, px=60_000)
        pipe.execute_command("WAIT", want, self.timeout_ms)
        pipe.execute_command("ROLE")
        _, confirmed, role = pipe.execute()
        if role and role[0] == "master":
            self._connected = len(role[2])
            if role[2]:
                self._replicas = [(host, int(port)) for host, port, *_ in role[2]]
        if confirmed >= self.replicas:
            return int(confirmed)
        if not self._on_current_master(key, marker):
            log.error("%s: written to a Redis master that was failed over; reconnecting through the sentinels", what)
            self._reconnect()
            raise RedisFailedOver(f"Redis failed over while {what} was written; it may be lost, try again (with the "
                                  "same Idempotency-Key)")  # fmt: skip
        now = time.monotonic()
        if now - self._warned_at >= self.WARN_EVERY_S:
            self._warned_at = now
            log.warning("%s: %d of %d replica(s) confirmed (%d connected): it is on the master only until they catch "
                        "up", what, confirmed, self.replicas, self._connected)  # fmt: skip
        return int(confirmed)

    def marker_key(self) -> str:
        """This thread's marker key. A group records its jobs' ends from several threads at once: with one key per
        process, another thread's marker overwrote this one's between its write and its read-back, and the barrier
        took the current master for a stale one."""
        return f"{self.marker_prefix}:{threading.get_ident()}"

    def _reconnect(self) -> None:
        """The next commands go to the master the sentinels name. Only idle connections are closed here: closing
        the pool's connections in use (``disconnect()``) broke the commands other threads had in flight (redis-py
        raised ``AttributeError: 'NoneType' object has no attribute 'readline'``); the Sentinel pool drops those
        when they are released, since they no longer point at its master (``owns_connection``)."""
        pool = self.client.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            pool.get_master_address()  # refreshes the pool's master; closes its idle connections if it changed
        pool.disconnect(inuse_connections=False)

    def _on_current_master(self, key: str, marker: str) -> bool:
        """Whether ``marker`` is on the master the sentinels name now and on any former replica that has become a
        master (promoted, before the sentinels announce it). Always true without Sentinel."""
        pool = self.client.connection_pool
        if not isinstance(pool, SentinelConnectionPool):
            return True
        masters = {pool.sentinel_manager.discover_master(pool.service_name), *self._promoted_replicas(pool)}
        return all(self._read(pool, address, key) == marker for address in masters)

    def _promoted_replicas(self, pool: SentinelConnectionPool) -> list[tuple[str, int]]:
        promoted = []
        for address in self._replicas:
            try:
                with self._direct(pool, address) as replica:
                    if replica.execute_command("ROLE")[0] == "master":
                        promoted.append(address)
            except redis.RedisError:  # gone: not a master anyone writes to
                continue
        return promoted

    def _read(self, pool: SentinelConnectionPool, address: tuple[str, int], key: str) -> str | None:
        with self._direct(pool, address) as current:
            return current.get(key)

    @staticmethod
    def _direct(pool: SentinelConnectionPool, address: tuple[str, int]) -> redis.Redis:
        kwargs = pool.connection_kwargs
        return redis.Redis(host=address[0], port=address[1], db=kwargs.get("db", 0), password=kwargs.get("password"),
                           username=kwargs.get("username"), socket_timeout=kwargs.get("socket_timeout"),
                           socket_connect_timeout=kwargs.get("socket_connect_timeout"),
                           decode_responses=True)  # fmt: skip
