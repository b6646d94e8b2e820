"""Capturing one CUDA graph the way every fast path here does it (no torch work at import time).

Kernels are chosen, workspaces allocated and compiled code built on a side stream first (the warm-up calls),
then one call is captured into a graph that draws its memory from ``pool``. The caller keeps the static inputs
``fn`` reads and the outputs it returned: replaying the graph rewrites those outputs in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture_graph(
    fn: Callable[[], T],
    device: torch.device,
    pool: object,
    warmups: int = 1,
    warm_up: Callable[[], object] | None = None,
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``warm_up`` (``fn`` when None) ``warmups`` times on a side stream, then capture ``fn``: (graph, output)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            (warm_up or fn)()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
