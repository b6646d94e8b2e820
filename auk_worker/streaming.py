"""A streamed answer: audio fed as it becomes final, cut into pieces, each encoded (``encoders.py``) and sent as
soon as it is ready; the stored copy of a streamed job is the whole-file encoding (``formats.encode``), as for any
job. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from auk_worker import encoders
from auk_worker.formats import AudioFormat, get_format
from auk_worker.types import SAMPLE_RATE

def open_encoder(fmt: AudioFormat | str) -> encoders.Encoder:
    """A streaming encoder for ``fmt`` (a format or its name); ValueError for a format that does not stream."""
    return encoders.open_encoder(fmt if isinstance(fmt, AudioFormat) else get_format(fmt))


def pieces(waveform: np.ndarray, size: int) -> list[np.ndarray]:
    """``waveform`` cut into pieces of ``size`` samples (the last one shorter)."""
    return [waveform[start:start + size] for start in range(0, len(waveform), size)] or [waveform[:0]]


# ---------------------------------------------------------------------------------------------------- a job's stream

FIRST_PIECE_S = 0.2  # the first piece is short, so that it is encoded and out soon
PIECE_S = 1.0  # later pieces


class AudioStream:
    """One job's streamed answer: audio fed as it becomes final (a whole render, or each segment of a long text as
    it finishes) is cut into pieces, encoded and sent one message a piece; ``close`` sends the encoder's tail with
    the final marker.

    ``send(header, body)`` delivers one message (``ReplySender.send`` bound to the job). A piece's header is
    ``{"status": "piece", "seq", "format", "content_type", "samples", "timings"?}``; the last message's is
    ``{"status": "succeeded", "final": true, "seq", "format", "content_type", "samples", "timings"}``. ``timings``
    (seconds: ``started_at`` as wall time, then ``prepare``, ``render``, ``encode``) ride on the first piece and
    on the last message."""

    def __init__(self, send: Callable[[dict[str, Any], bytes], None], fmt: AudioFormat | str,
                 timings: dict[str, float] | None = None) -> None:  # fmt: skip
        self.send = send
        self.spec = fmt if isinstance(fmt, AudioFormat) else get_format(fmt)
        self.encoder = open_encoder(self.spec)
        self.timings = dict(timings or {})
        self.seq = 0
        self.samples = 0
        self.encode_s = 0.0

    def _header(self, status: str, samples: int) -> dict[str, Any]:
        header = {"status": status, "seq": self.seq, "format": self.spec.name, "content_type": self.spec.mime_type,
                  "samples": samples}  # fmt: skip
        if self.seq == 0 or status == "succeeded":
            header["timings"] = {**self.timings, "encode": self.encode_s}
        return header

    def feed(self, waveform: np.ndarray) -> None:
        """Encode and send ``waveform`` (float, mono, 24 kHz), the first piece short."""
        start = 0
        while start < len(waveform):
            size = int((FIRST_PIECE_S if self.seq == 0 and self.samples == 0 else PIECE_S) * SAMPLE_RATE)
            piece = waveform[start:start + size]
            started = time.perf_counter()
            data = self.encoder.feed(piece)
            self.encode_s += time.perf_counter() - started
            start += len(piece)
            self.samples += len(piece)
            if data:  # an encoder may hold a short piece back until it fills a frame
                self.send(self._header("piece", len(piece)), data)
                self.seq += 1

    def close(self) -> None:
        """Send the encoder's tail and the final marker."""
        started = time.perf_counter()
        tail = self.encoder.finish()
        self.encode_s += time.perf_counter() - started
        self.send({**self._header("succeeded", self.samples), "final": True}, tail)
