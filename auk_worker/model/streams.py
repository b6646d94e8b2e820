"""Running independent branches of a model side by side on CUDA streams.

At latency sizes one branch's kernels leave most of the GPU idle, so where a model has independent branches (a
double block's two streams, a decoder stage's three residual blocks) the side branches are queued on their own
streams. Every side stream's work starts after what the current stream has queued (:func:`beside`), and the
current stream waits for it before using its results (:func:`join`). That ordering also keeps the caching
allocator safe: a tensor is only freed on the current stream after the side streams that read it have been
joined, and a side stream only reuses memory after waiting for the current stream. Both work inside CUDA graph
capture, where they become the graph's fork and join.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def beside(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the body on ``stream``, after the work already queued on the current stream (None: on the current
    stream). Pair with :func:`join` before the current stream uses what the body made."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def join(*streams: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for the work queued on each of ``streams`` (None entries: nothing to wait for)."""
    for stream in streams:
        if stream is not None:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
