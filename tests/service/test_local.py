"""The local process managers' own logic (the processes themselves are exercised by every service test)."""

from __future__ import annotations

import pytest

from auk_dev import local


def test_free_port_never_hands_out_a_port_already_taken_by_the_same_start(monkeypatch) -> None:
    """SeaweedFS listens on each port and on port + 10000: the four ports of one start must not meet there.
    The OS's picks are scripted: the second pick is the first's gRPC port, the third has the first as its own."""
    picks = iter([41721, 51721, 31721, 30500])

    class ScriptedSocket:  # bind(port 0) takes the next scripted pick; any named port binds
        def __enter__(self) -> ScriptedSocket:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(picks) if address[1] == 0 else address[1]

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(local.socket, "socket", ScriptedSocket)
    first = local.free_port(also_free_offset=local.GRPC_OFFSET)
    assert first == 41721
    taken = frozenset({first, first + local.GRPC_OFFSET})
    assert local.free_port(also_free_offset=local.GRPC_OFFSET, taken=taken) == 30500


def test_storage_start_refuses_a_disk_too_full_for_writes(monkeypatch, tmp_path) -> None:
    """SeaweedFS would start and list buckets on such a disk, then time out on every upload: refuse before."""
    real = local.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(local.shutil, "disk_usage", lambda path: real._replace(free=300 * 2**20))
    server = local.S3Server(tmp_path / "s3")
    with pytest.raises(RuntimeError, match=r"only 300 MiB free on the disk of .*s3/data: SeaweedFS refuses writes"):
        server.start()
    assert server.proc is None  # nothing was spawned
