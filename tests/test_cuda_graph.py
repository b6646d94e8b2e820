"""``capture_graph`` off the GPU: torch.cuda's stream and graph objects are replaced by recorders, so the order
of the warm-up and the capture (and what runs where) is checked on any machine. The GPU tests replay for real."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from auk_worker.pipeline.cuda_graph import capture_graph


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []

    class Stream:
        def __init__(self, device: object) -> None:
            self.name = "side"

        def wait_stream(self, other: object) -> None:
            log.append(f"{self.name} waits")

    class Current(Stream):
        def __init__(self) -> None:
            self.name = "main"

    @contextmanager
    def on(stream: Stream):
        log.append(f"enter {stream.name}")
        yield
        log.append(f"leave {stream.name}")

    @contextmanager
    def graph(g: object, pool: object = None):
        log.append(f"capture into pool {pool}")
        yield
        log.append("captured")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Current())
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return log


def test_warm_up_runs_on_a_side_stream_before_one_captured_call(events: list[str]) -> None:
    calls = iter(range(10))
    graph, out = capture_graph(lambda: events.append(f"fn {next(calls)}") or "output", "cuda:0", "P", warmups=2)
    assert (graph, out) == ("graph", "output")
    assert events == [
        "side waits", "enter side", "fn 0", "fn 1", "leave side", "main waits",
        "capture into pool P", "fn 2", "captured",
    ]  # fmt: skip


def test_a_separate_warm_up_runs_instead_of_the_captured_function(events: list[str]) -> None:
    capture_graph(lambda: events.append("body"), "cuda:0", None, warmups=3, warm_up=lambda: events.append("reset+body"))
    assert events.count("reset+body") == 3 and events.count("body") == 1
    assert events.index("body") > events.index("capture into pool None")
