"""Process managers for Redis Sentinel on one machine: a master, its replicas and the sentinels watching them, on
loopback ports, as a highly available deployment runs them (the Sentinel tests; see ``local.py`` for the rest).

- ``SentinelServer``: Debian's ``redis-server`` in sentinel mode (``redis-server sentinel.conf --sentinel``).
- ``RedisSentinelSet``: a master, replicas (``RedisServer(replica_of=...)``) and an odd number of sentinels; its
  ``url`` is AUK_REDIS_URL's Sentinel form, ``failover()`` a coordinated ``SENTINEL FAILOVER``, and
  ``wait_new_master`` follows a failover the sentinels start themselves (the master killed).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from auk_dev.local import RedisServer, free_port, redis_binary, stop_process, wait_until


class SentinelServer:
    """``redis-server --sentinel`` on a free loopback port, watching ``master`` as ``name``; fast detection
    (``down_after_ms``) for tests."""

    def __init__(self, workdir: Path, master: RedisServer, name: str = "mymaster", quorum: int = 2,
                 down_after_ms: int = 1000, failover_timeout_ms: int = 5000) -> None:  # fmt: skip
        self.workdir = Path(workdir)
        self.master, self.name, self.quorum = master, name, quorum
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.workdir / "sentinel.log"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def start(self, timeout: float = 15.0) -> SentinelServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        conf = self.workdir / "sentinel.conf"  # sentinel rewrites it with what it learns
        conf.write_text("\n".join([
            f"port {self.port}", "bind 127.0.0.1", f"dir {self.workdir}", f"logfile {self.log}",
            f"sentinel monitor {self.name} 127.0.0.1 {self.master.port} {self.quorum}",
            f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}",
            f"sentinel failover-timeout {self.name} {self.failover_timeout_ms}", "",
        ]))  # fmt: skip
        self.proc = subprocess.Popen([redis_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        client = self.client()
        try:
            wait_until("redis sentinel", client.ping, timeout, self.proc, self.log)
        finally:
            client.close()
        return self

    def stop(self) -> None:
        stop_process(self.proc)


class RedisSentinelSet:
    """A master, ``replicas`` replicas and ``sentinels`` sentinels on loopback: Redis as a highly available
    deployment runs it. ``url`` is AUK_REDIS_URL's Sentinel form; ``failover()`` is ``SENTINEL FAILOVER``."""

    def __init__(self, workdir: Path, replicas: int = 1, sentinels: int = 3, name: str = "mymaster") -> None:
        self.workdir = Path(workdir)
        self.name = name
        self.servers = [RedisServer(self.workdir / "redis-0")]
        self.servers += [RedisServer(self.workdir / f"redis-{i + 1}", replica_of=self.servers[0])
                         for i in range(replicas)]  # fmt: skip
        self.sentinels = [SentinelServer(self.workdir / f"sentinel-{i}", self.servers[0], name,
                                         quorum=sentinels // 2 + 1) for i in range(sentinels)]  # fmt: skip

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels) + "/0"

    def start(self, timeout: float = 30.0) -> RedisSentinelSet:
        for server in self.servers:
            server.start()
        for sentinel in self.sentinels:
            sentinel.start()
        wait_until("sentinels to see every replica and each other", self._topology_known, timeout)
        return self

    def _topology_known(self) -> bool:
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                master = client.execute_command("SENTINEL", "MASTER", self.name)
                info = dict(zip(master[::2], master[1::2])) if isinstance(master, list) else master
                if int(info["num-slaves"]) < len(self.servers) - 1:
                    return False
                if int(info["num-other-sentinels"]) < len(self.sentinels) - 1:
                    return False
        for replica in self.servers[1:]:  # and each replica in sync with the master
            with replica.client() as client:
                if client.info("replication").get("master_link_status") != "up":
                    return False
        return True

    def master(self) -> RedisServer:
        """The server the sentinels name as master now."""
        with self.sentinels[0].client() as client:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
        return next(server for server in self.servers if server.port == int(port))

    def failover(self, timeout: float = 30.0) -> RedisServer:
        """``SENTINEL FAILOVER``: a replica is promoted and the old master demoted; returns the new master once
        the sentinels name it and it accepts writes."""
        old = self.master()
        with self.sentinels[0].client() as client:
            client.execute_command("SENTINEL", "FAILOVER", self.name)
        return self.wait_new_master(old, timeout)

    def wait_new_master(self, old: RedisServer, timeout: float = 30.0) -> RedisServer:
        def promoted() -> bool:
            new = self.master()
            with new.client() as client:
                return new is not old and client.execute_command("ROLE")[0] == "master"

        wait_until(f"a master other than :{old.port}", promoted, timeout)
        return self.master()

    def stop(self) -> None:
        for process in (*self.sentinels, *reversed(self.servers)):
            process.stop()
