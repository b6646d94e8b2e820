"""The local process managers' own logic (the processes themselves are exercised by every service test)."""

from __future__ import annotations

from auk_worker.service import local


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
