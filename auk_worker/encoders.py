"""Streaming encoders: a waveform fed in pieces, each piece's bytes out as soon as they are encoded.

A streamed answer (``stream_format: "audio"``, vLLM-Omni's ``stream: true``) sends audio while the rest is still
being rendered or encoded. Each format that can go out so (``AudioFormat.streams``) has an encoder here whose
``feed(samples)`` returns the bytes ready so far and whose ``finish()`` returns the rest; the concatenation is one
valid file of that format:

- ``pcm``: the 16-bit samples, nothing else;
- ``wav``: a header whose RIFF and data lengths say "open" (0xFFFFFFFF, as streaming WAV writers do: the length is
  not known when the header goes out), then the 16-bit samples;
- ``mp3``, ``opus``, ``aac``: FFmpeg's encoders through PyAV (libmp3lame, libopus in Ogg with 20 ms pages, the
  native AAC in ADTS), each packet written out as it is muxed. Unlike the whole-file MP3 and Opus from libsndfile,
  a stream carries no encoder-delay tag, so a decoder may give back a few hundred samples of priming and padding.

The stored copy of a streamed job is the whole-file encoding (``formats.encode``), as for any job.

Torch-free.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import numpy as np

from auk_worker.types import SAMPLE_RATE

OPEN_LENGTH = 0xFFFFFFFF
# FFmpeg muxer and encoder settings per streamed format: (muxer, encoder, bit rate, muxer options).
_FFMPEG = {
    "mp3": ("mp3", "libmp3lame", 64_000, {}),
    "opus": ("ogg", "libopus", 48_000, {"page_duration": "20000"}),  # a page every 20 ms, not every second
    "aac": ("adts", "aac", 64_000, {}),
}


class Encoder(Protocol):
    def feed(self, samples: np.ndarray) -> bytes: ...

    def finish(self) -> bytes: ...


def _pcm16(samples: np.ndarray) -> bytes:
    """Float samples (full scale 1.0) as 16-bit little-endian, the same integers libsndfile writes for them (so a
    streamed ``wav`` or ``pcm`` holds the stored file's samples)."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return np.clip(np.floor(clipped * np.float32(32768.0)), -32768, 32767).astype("<i2").tobytes()


class PcmEncoder:
    def feed(self, samples: np.ndarray) -> bytes:
        return _pcm16(samples)

    def finish(self) -> bytes:
        return b""


def wav_header(sample_rate: int = SAMPLE_RATE, channels: int = 1, length: int = OPEN_LENGTH) -> bytes:
    """A 44-byte PCM-16 WAV header; ``length`` is the data chunk's size, open (0xFFFFFFFF) by default."""
    riff = OPEN_LENGTH if length == OPEN_LENGTH else 36 + length
    block = 2 * channels
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, 16)
            + b"data" + struct.pack("<I", length))  # fmt: skip


class WavEncoder:
    def __init__(self) -> None:
        self.header_sent = False

    def feed(self, samples: np.ndarray) -> bytes:
        head = b"" if self.header_sent else wav_header()
        self.header_sent = True
        return head + _pcm16(samples)

    def finish(self) -> bytes:
        return b"" if self.header_sent else wav_header()


class _Sink:
    """The file PyAV writes into: it keeps what was written until it is taken."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self.parts = b"".join(self.parts), []
        return data


class FFmpegEncoder:
    """An FFmpeg encoder and muxer (PyAV) that flushes each packet to its output as it is muxed."""

    def __init__(self, fmt: Any, sample_rate: int = SAMPLE_RATE) -> None:  # fmt: a formats.AudioFormat
        import av  # only where an FFmpeg-encoded stream is asked for

        muxer, codec, bit_rate, options = _FFMPEG[fmt.name]
        self.av = av
        self.sink = _Sink()
        self.container = av.open(self.sink, "w", format=muxer, container_options={"flush_packets": "1", **options})
        self.stream = self.container.add_stream(codec, rate=sample_rate)
        self.stream.layout = "mono"
        self.stream.bit_rate = fmt.bit_rate or bit_rate
        self.rate = sample_rate
        self.pts = 0

    def feed(self, samples: np.ndarray) -> bytes:
        samples = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
        if len(samples):
            frame = self.av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
            frame.sample_rate = self.rate
            frame.pts = self.pts
            self.pts += len(samples)
            for packet in self.stream.encode(frame):
                self.container.mux(packet)
        return self.sink.take()

    def finish(self) -> bytes:
        for packet in self.stream.encode(None):
            self.container.mux(packet)
        self.container.close()
        return self.sink.take()


def open_encoder(spec: Any) -> Encoder:
    """A streaming encoder for ``spec`` (a ``formats.AudioFormat``); ValueError for a format that does not stream."""
    if not spec.streams:
        raise ValueError(f"{spec.name} does not stream")
    if spec.name == "pcm":
        return PcmEncoder()
    if spec.name == "wav":
        return WavEncoder()
    return FFmpegEncoder(spec)


