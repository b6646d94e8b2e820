"""No storage path takes unsigned reads or writes: every port and local socket the SeaweedFS of ``S3Server`` (the
demo's and the tests' storage, configured as docker-compose's) listens on is tried without credentials, as an
attacker on the host would, while signed S3 keeps working."""

from __future__ import annotations

import glob
import os
import re
import socket
import subprocess
from pathlib import Path

import httpx
import numpy as np

from auk_dev.local import GRPC_OFFSET, S3Server
from auk_worker.formats import encode

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + an empty SETTINGS


def wav_bytes(seconds: float) -> bytes:
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, int(24_000 * seconds)).astype(np.float32)
    return encode(noise, "wav_float", 24_000)


def speaks_plain_grpc(connect: socket.socket) -> bool:
    """Whether the server answers a plaintext HTTP/2 preface with its SETTINGS frame, as a gRPC server without TLS
    does (a TLS-only server resets the connection or answers with a TLS alert)."""
    with connect as sock:
        sock.settimeout(3)
        try:
            sock.sendall(H2_PREFACE)
            reply = sock.recv(64)
        except OSError:
            return False
    return len(reply) >= 9 and reply[3] == 0x04


def tcp(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=3)


def unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(3)
    sock.connect(path)
    return sock


def listening(path: str) -> socket.socket | None:
    """A connection to the socket at ``path``; None when nothing listens there: a file another SeaweedFS left
    behind when it was killed (its port number may be this server's), which serves nothing."""
    try:
        return unix(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return None


def weed(args: list[str], cwd: Path, stdin: str = "", timeout: float = 15) -> str:
    """The weed CLI as an outsider runs it: no security.toml in its directory or home (so no client certificate)."""
    env = {**os.environ, "HOME": str(cwd)}
    try:
        proc = subprocess.run([S3Server.weed_binary(), *args], input=stdin, capture_output=True, text=True,
                              cwd=cwd, env=env, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as exc:  # a client that cannot connect keeps retrying
        return f"timed out: {exc.stdout or ''}{exc.stderr or ''}"
    return f"exit {proc.returncode}: {proc.stdout}{proc.stderr}"


def test_no_port_or_socket_serves_or_takes_objects_unsigned(s3_server, storage, settings, tmp_path) -> None:
    bucket, prefix = storage.bucket, settings.s3_prefix
    small, big = f"{prefix}jobs/small.wav", f"{prefix}jobs/big.wav"  # inline in the filer; on a volume server
    storage.put_wav(small, wav_bytes(0.5), {"job-id": "small"})
    storage.put_wav(big, wav_bytes(12.0), {"job-id": "big"})  # 1.1 MB: past -filer.saveToFilerLimit
    before = sorted(storage.list_keys(prefix))
    p = s3_server.ports
    http = httpx.Client(timeout=5)
    refused: list[str] = []

    def expect_refused(what: str, response: httpx.Response) -> None:
        if response.status_code < 400 or b"RIFF" in response.content or "secret" in response.text:
            refused.append(f"{what}: {response.status_code} {response.text[:120]!r}")

    # The S3 gateway: signatures enforced.
    s3 = f"http://127.0.0.1:{p['s3']}"
    expect_refused("S3 GET", http.get(f"{s3}/{bucket}/{small}"))
    expect_refused("S3 list", http.get(f"{s3}/{bucket}?list-type=2"))
    expect_refused("S3 PUT", http.put(f"{s3}/{bucket}/{prefix}unsigned-s3.txt", content=b"unsigned"))
    # The filer's HTTP port and its local socket: objects, listings, writes.
    filer_paths = [f"http://127.0.0.1:{p['filer']}"]
    filer_paths += [f"unix:{path}" for path in glob.glob(f"/tmp/seaweedfs-filer-{p['filer']}.sock")]
    for base in filer_paths:
        client = http
        if base.startswith("unix:"):
            client, base = httpx.Client(transport=httpx.HTTPTransport(uds=base[5:]), timeout=5), "http://filer"
        expect_refused(f"filer GET via {base}", client.get(f"{base}/buckets/{bucket}/{small}"))
        expect_refused(f"filer list via {base}", client.get(f"{base}/buckets/{bucket}/{prefix}jobs/",
                                                            headers={"Accept": "application/json"}))  # fmt: skip
        expect_refused(f"filer POST via {base}", client.post(f"{base}/buckets/{bucket}/{prefix}unsigned-filer.txt",
                                                             files={"file": ("u.txt", b"unsigned")}))  # fmt: skip
    # The master's HTTP port: it would hand out write tokens and take uploads itself.
    master = f"http://127.0.0.1:{p['master']}"
    expect_refused("master assign", http.get(f"{master}/dir/assign"))
    expect_refused("master submit", http.post(f"{master}/submit", files={"file": ("u.txt", b"unsigned")}))
    # The volume server's HTTP port: the chunks themselves, found through the filer by a client with the
    # certificate (a signed gRPC client), then asked for without a token.
    meta = weed(["shell", f"-master=127.0.0.1:{p['master']}", f"-filer=127.0.0.1:{p['filer']}"], s3_server.workdir,
                f"fs.meta.cat /buckets/{bucket}/{big}\nexit\n", timeout=60)  # fmt: skip
    fids = re.findall(r'"file_?[iI]d":\s*"([0-9a-f]+,[0-9a-f]+)"', meta)
    assert fids, f"no chunk of {big} found through the signed gRPC client: {meta[-2000:]}"
    volume = f"http://127.0.0.1:{p['volume']}"
    expect_refused("volume GET", http.get(f"{volume}/{fids[0]}"))
    expect_refused("volume POST", http.post(f"{volume}/{fids[0]}", files={"file": ("u.txt", b"unsigned")}))
    # gRPC on every TCP port and local socket: mutual TLS, so a client without the CA's certificate gets nothing.
    grpc_ports = {name: port + GRPC_OFFSET for name, port in p.items()}
    for name, port in grpc_ports.items():
        if speaks_plain_grpc(tcp(port)):
            refused.append(f"{name} gRPC port {port} speaks plaintext gRPC")
    for path in glob.glob("/tmp/seaweedfs-*.sock"):
        if any(path.endswith(f"-{port}.sock") for port in [*p.values(), *grpc_ports.values()]):
            if path.endswith(f"-{p['s3']}.sock"):
                expect_refused("S3 GET via its socket", httpx.Client(transport=httpx.HTTPTransport(uds=path)).get(
                    f"http://s3/{bucket}/{small}"))  # fmt: skip
            elif "grpc" in path and (sock := listening(path)) is not None and speaks_plain_grpc(sock):
                refused.append(f"{path} speaks plaintext gRPC")
    # The weed CLI as an outsider: an upload through the master, a listing through the filer.
    (tmp_path / "u.txt").write_text("unsigned")
    upload = weed(["upload", f"-master=127.0.0.1:{p['master']}", str(tmp_path / "u.txt")], tmp_path)
    if '"fid"' in upload:
        refused.append(f"weed upload without a certificate: {upload[:200]}")
    listing = weed(["shell", f"-master=127.0.0.1:{p['master']}", f"-filer=127.0.0.1:{p['filer']}"], tmp_path,
                   f"fs.ls /buckets/{bucket}/{prefix}jobs\nexit\n", timeout=8)  # fmt: skip
    if "small.wav" in listing:
        refused.append(f"weed shell listing without a certificate: {listing[:200]}")

    assert refused == [], "unsigned access:\n" + "\n".join(refused)
    # Signed S3 still reads, lists and writes; nothing unsigned landed.
    assert storage.get_bytes(bucket, big)[:4] == b"RIFF" and storage.get_bytes(bucket, small)[:4] == b"RIFF"
    assert sorted(storage.list_keys(prefix)) == before == sorted([small, big])
