"""What one job costs the shared parts: Redis operations, memory and bytes, S3 requests and bytes, API bytes.

``python -m bench.footprint [--jobs N]`` starts a private redis-server, SeaweedFS behind a counting HTTP proxy, the
API and one worker with ``AUK_PIPELINE=instant`` (silence of the right length, no model), then runs N single jobs
(``POST /v1/jobs``, one ``GET`` each once it finished) and one batch of N lines, and reports per job, for each:

- Redis: commands (``INFO commandstats`` delta, with the top ones), bytes in and out, memory still held;
- S3: requests by method and bytes each way, as seen on the wire by the proxy (every process's boto3 calls);
- API: bytes each way on the client's side.

docs/deployment.md's scaling section sizes Redis, S3 and the network from these figures (kept in bench/RESULTS.md).
The worker's Celery messages are part of the Redis figures. It writes ``bench/results/footprint-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import httpx

from auk_dev.local import ApiProcess, RedisServer, S3Server, WorkerProcess, connection_env, free_port
from bench.common import commit

API_KEY = "bench-footprint-key-0000000000"
GEN_SECONDS = 6.0


class CountingProxy:
    """An HTTP/1.1 reverse proxy on loopback that forwards bytes unchanged (Host included, so S3 signatures made
    for the proxy's address still verify) and counts requests by method and bytes each way."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.requests: Counter[str] = Counter()
        self.bytes_up = 0  # client to server
        self.bytes_down = 0
        self._loop = asyncio.new_event_loop()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> CountingProxy:
        ready = threading.Event()

        async def serve() -> None:
            server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
            ready.set()
            async with server:
                await server.serve_forever()

        threading.Thread(target=self._loop.run_until_complete, args=(serve(),), daemon=True).start()
        ready.wait(10)
        return self

    def snapshot(self) -> dict:
        return {"requests": dict(self.requests), "bytes_up": self.bytes_up, "bytes_down": self.bytes_down}

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            while True:
                sent = await _message(client_r, server_w, request=True)
                if sent is None:
                    break
                method = sent[0].split(b" ", 1)[0]
                self.requests[method.decode()] += 1
                self.bytes_up += sent[1]
                answer = await _message(server_r, client_w, request=False, method=method)
                if answer is None:
                    break
                self.bytes_down += answer[1]
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            for writer in (client_w, server_w):
                writer.close()


async def _message(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, request: bool, method: bytes = b""
) -> tuple[bytes, int] | None:
    """Copy one HTTP message from reader to writer; returns its first line and the bytes copied."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    writer.write(head)
    lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:] if line)}
    total = len(head)
    status = b"" if request else lines[0].split(b" ")[1]
    bodiless = not request and (method == b"HEAD" or status in (b"204", b"304") or status.startswith(b"1"))
    if bodiless:
        pass  # a HEAD answer's Content-Length describes a body that is not sent
    elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            writer.write(size_line + chunk)
            total += len(size_line) + len(chunk)
            if size == 0:
                break
    elif b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
        writer.write(body)
        total += len(body)
    await writer.drain()
    return lines[0], total


def _redis_stats(client) -> dict:
    commands = {name.removeprefix("cmdstat_"): v["calls"] for name, v in client.info("commandstats").items()}
    stats = client.info("stats")
    return {"commands": commands, "net_in": stats["total_net_input_bytes"], "net_out": stats["total_net_output_bytes"],
            "memory": client.info("memory")["used_memory"], "keys": client.dbsize()}  # fmt: skip


def _delta(before: dict, after: dict, proxy_before: dict, proxy_after: dict, api_bytes: tuple[int, int], n: int):
    commands = Counter(after["redis"]["commands"]) - Counter(before["redis"]["commands"])
    requests = Counter(proxy_after["requests"]) - Counter(proxy_before["requests"])
    return {
        "jobs": n,
        "redis_commands_per_job": round(sum(commands.values()) / n, 1),
        "redis_top_commands_per_job": {k: round(v / n, 2) for k, v in commands.most_common(8)},
        "redis_bytes_in_per_job": round((after["redis"]["net_in"] - before["redis"]["net_in"]) / n),
        "redis_bytes_out_per_job": round((after["redis"]["net_out"] - before["redis"]["net_out"]) / n),
        "redis_memory_per_job": round((after["redis"]["memory"] - before["redis"]["memory"]) / n),
        "redis_keys_per_job": round((after["redis"]["keys"] - before["redis"]["keys"]) / n, 2),
        "s3_requests_per_job": {k: round(v / n, 2) for k, v in sorted(requests.items())},
        "s3_bytes_up_per_job": round((proxy_after["bytes_up"] - proxy_before["bytes_up"]) / n),
        "s3_bytes_down_per_job": round((proxy_after["bytes_down"] - proxy_before["bytes_down"]) / n),
        "api_bytes_up_per_job": round(api_bytes[0] / n),
        "api_bytes_down_per_job": round(api_bytes[1] / n),
    }


class _Metered(httpx.Client):
    """An httpx client that adds up request and response sizes (head and body)."""

    sent = 0
    received = 0

    def send(self, request: httpx.Request, **kwargs) -> httpx.Response:  # type: ignore[override]
        response = super().send(request, **kwargs)
        head = sum(len(k) + len(v) + 4 for k, v in request.headers.raw) + len(request.url.raw_path) + 16
        self.sent += head + len(request.content)
        self.received += sum(len(k) + len(v) + 4 for k, v in response.headers.raw) + 17 + len(response.content)
        return response


def _wait(http: httpx.Client, path: str, done, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = http.get(path).json()
        if done(body):
            return body
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not finish in {timeout:.0f} s")


def run(jobs: int, workdir: Path) -> dict:
    redis_server = RedisServer(workdir / "redis").start()
    s3 = S3Server(workdir / "s3").start()
    proxy = CountingProxy(s3.ports["s3"]).start()
    env = connection_env(redis_server, s3, PIPELINE="instant", VARIANT="base", API_KEYS=API_KEY)
    env["AUK_S3_ENDPOINT"] = proxy.endpoint
    api = ApiProcess(env, free_port(), workdir / "api.log").start()
    worker = WorkerProcess(env, "footprint0", workdir).start()
    client = redis_server.client()
    worker.wait_state(client, "ready", timeout=120)
    http = _Metered(base_url=api.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    body = {"instruction": "A calm voice reads the weather.", "gen_seconds": GEN_SECONDS, "priority": "bulk"}
    results = {}
    try:
        for phase in ("jobs", "batch"):
            time.sleep(1.0)  # let the worker's idle traffic settle into the baseline
            before, proxy_before = {"redis": _redis_stats(client)}, proxy.snapshot()
            http.sent = http.received = 0
            if phase == "jobs":
                ids = [http.post("/v1/jobs", json=body).json()["id"] for _ in range(jobs)]
                for job_id in ids:
                    _wait(http, f"/v1/jobs/{job_id}", lambda b: b["status"] in ("succeeded", "failed"))
            else:
                lines = "\n".join(json.dumps({**body, "custom_id": f"line-{i}"}) for i in range(jobs))
                batch = http.post("/v1/batches", content=lines, headers={"Content-Type": "application/x-ndjson"})
                _wait(http, f"/v1/batches/{batch.json()['id']}", lambda b: b.get("manifest") is not None)
            after, proxy_after = {"redis": _redis_stats(client)}, proxy.snapshot()
            results[phase] = _delta(before, after, proxy_before, proxy_after, (http.sent, http.received), jobs)
    finally:
        http.close()
        worker.terminate(timeout=20)
        api.stop()
        s3.stop()
        redis_server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.footprint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs per phase (default 200)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="auk-footprint-") as tmp:
        results = run(args.jobs, Path(tmp))
    record = {"benchmark": "footprint", "commit": commit(), "date": datetime.now(timezone.utc).isoformat(),
              "gen_seconds": GEN_SECONDS, **results}  # fmt: skip
    print(json.dumps(record, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"footprint-{datetime.now(timezone.utc):%Y-%m-%d}.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
