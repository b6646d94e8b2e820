"""Output formats: encode a rendered waveform (float32, mono, 24 kHz) as the file a caller asked for.

The names follow OpenAI's speech API ``response_format`` (``mp3``, ``opus``, ``aac``, ``flac``, ``wav``, ``pcm``),
plus ``wav_float`` for the model's output without quantisation. Every format but AAC is written by libsndfile
through soundfile; ``pcm`` is libsndfile's headerless RAW, so its samples are the same bytes as a ``wav`` file's data
chunk. AAC (libsndfile has no encoder for it) is FFmpeg's native AAC encoder through PyAV (``av``), in an ADTS
stream (``audio/aac``, what OpenAI's ``aac`` answers carry), 64 kbit/s mono.

All formats keep the model's rate: Opus runs natively at 24 kHz (one of its five rates, 8/12/16/24/48 kHz), MP3 at
24 kHz is MPEG-2 Layer III, AAC-LC at 24 kHz is one of ADTS's rates. The lossy files carry their encoder delay and
padding (a LAME tag in the MP3, pre-skip and the final granule position in the Ogg Opus header) so that decoders
that honour them, libsndfile's included, give back exactly as many samples as were encoded; an ADTS stream has no
place for them (about 1024 samples of priming come first, and the last frame is padded).

``streams`` says whether a format can go out piece by piece as the audio is ready (``auk_worker/encoders.py``):
``pcm``, ``wav`` (its header with an open length), ``mp3``, ``opus`` and ``aac``; FLAC and the float WAV need the
whole file.

Torch-free: the API, the worker and the CLI all import it.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import numpy as np
import soundfile as sf

from auk_worker.errors import InputError
from auk_worker.types import SAMPLE_RATE


class UnsupportedFormat(InputError):
    """The caller asked for an output format this service does not produce."""

    code = "unsupported_format"


@dataclass(frozen=True)
class AudioFormat:
    """One output format: how it is named, served and written.

    ``container``/``subtype``/``bitrate_mode`` are libsndfile's names; ``compression`` is libsndfile's compression
    level in [0, 1] (0 the highest quality and bit rate), None to leave the codec's default. ``clip`` says whether
    the waveform is clamped to [-1, 1] first: every format but the float WAV, since integer samples and the lossy
    codecs' decoders cannot hold more than full scale.
    """

    name: str
    extension: str
    mime_type: str
    lossless: bool
    container: str
    subtype: str
    sample_rate: int = SAMPLE_RATE
    compression: float | None = None
    bitrate_mode: str | None = None
    clip: bool = True
    description: str = ""
    streams: bool = False  # can go out in pieces as the audio is ready (``encoders.py``)
    codec: str | None = None  # an FFmpeg encoder (through PyAV) in place of libsndfile, e.g. AAC
    bit_rate: int | None = None  # bits a second, for an FFmpeg encoder


FORMATS: Mapping[str, AudioFormat] = {
    f.name: f
    for f in (
        AudioFormat("wav", "wav", "audio/wav", True, "WAV", "PCM_16", description="WAV, 16-bit PCM", streams=True),
        AudioFormat("wav_float", "wav", "audio/wav", True, "WAV", "FLOAT", clip=False,
                    description="WAV, 32-bit float, not clipped"),
        AudioFormat("flac", "flac", "audio/flac", True, "FLAC", "PCM_16", description="FLAC, 16-bit"),
        AudioFormat("mp3", "mp3", "audio/mpeg", False, "MP3", "MPEG_LAYER_III",
                    compression=0.2, bitrate_mode="VARIABLE", streams=True,
                    description="MP3 (MPEG-2 Layer III), variable bit rate"),
        # The Opus encoder picks its own bit rate for mono 24 kHz input.
        AudioFormat("opus", "opus", "audio/ogg; codecs=opus", False, "OGG", "OPUS", streams=True,
                    description="Opus in an Ogg container"),
        AudioFormat("aac", "aac", "audio/aac", False, "ADTS", "AAC", streams=True, codec="aac", bit_rate=64_000,
                    description="AAC-LC in an ADTS stream, 64 kbit/s"),
        AudioFormat("pcm", "pcm", f"audio/pcm; rate={SAMPLE_RATE}; channels=1", True, "RAW", "PCM_16",
                    streams=True, description="raw signed 16-bit little-endian samples, no header"),
    )
}

DEFAULT_FORMAT = "wav"

# OpenAI names that are not offered, with the reason a caller is told (none now).
UNAVAILABLE: Mapping[str, str] = {}

# The values the job schema's ``output_format`` has taken so far, and the format each one means.
LEGACY_NAMES: Mapping[str, str] = {"pcm16": "wav", "float32": "wav_float"}


def get_format(name: str) -> AudioFormat:
    """The format called ``name`` (case-insensitive); ``UnsupportedFormat`` naming the offered ones otherwise."""
    key = name.strip().lower() if isinstance(name, str) else name
    found = FORMATS.get(key)
    if found is not None and _available(found):
        return found
    offered = ", ".join(name for name, spec in FORMATS.items() if _available(spec))
    if found is not None:
        raise UnsupportedFormat(f"response format {key!r} is not available: this build cannot write it; "
                                f"choose one of {offered}")
    if key in UNAVAILABLE:
        reason = UNAVAILABLE[key]
        raise UnsupportedFormat(f"response format {key!r} is not available: {reason}; choose one of {offered}")
    raise UnsupportedFormat(f"unknown response format {name!r}; choose one of {offered}")


def _available(spec: AudioFormat) -> bool:
    return _ffmpeg_has(spec.codec) if spec.codec else _written_here(spec.container, spec.subtype)


@cache
def _ffmpeg_has(codec: str) -> bool:
    """Whether PyAV is installed and its FFmpeg has the encoder ``codec``."""
    try:
        import av
    except ImportError:
        return False
    return codec in av.codecs_available


@cache
def _written_here(container: str, subtype: str) -> bool:
    """Whether the loaded libsndfile writes this format (a system build may lack MP3, say)."""
    return container in sf.available_formats() and subtype in sf.available_subtypes(container)


def encode(waveform: np.ndarray, fmt: AudioFormat | str = DEFAULT_FORMAT, sample_rate: int = SAMPLE_RATE) -> bytes:
    """Encode a mono waveform (float samples, full scale 1.0) as ``fmt`` and return the file's bytes.

    ``sample_rate`` must be the format's rate (24 kHz): the service renders at one rate and resamples nothing
    here. A waveform that is not one-dimensional or holds NaN or infinities is a programming error (the pipeline
    refuses non-finite output before it gets here), so it raises ValueError, not a caller's error.
    """
    spec = fmt if isinstance(fmt, AudioFormat) else get_format(fmt)
    if sample_rate != spec.sample_rate:
        raise ValueError(f"{spec.name} is written at {spec.sample_rate} Hz, got a waveform at {sample_rate} Hz")
    samples = np.asarray(waveform, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"expected a mono waveform [t], got shape {samples.shape}")
    if not np.isfinite(samples).all():
        raise ValueError("the waveform holds NaN or infinite samples")
    if spec.clip:
        samples = np.clip(samples, -1.0, 1.0)
    if spec.codec is not None:
        from auk_worker.encoders import open_encoder  # PyAV is loaded only where an FFmpeg format is asked for

        encoder = open_encoder(spec)
        return encoder.feed(samples) + encoder.finish()
    buffer = io.BytesIO()
    extra = {"endian": "LITTLE"} if spec.container == "RAW" else {}
    if spec.compression is not None:
        extra["compression_level"] = spec.compression
    if spec.bitrate_mode is not None:
        extra["bitrate_mode"] = spec.bitrate_mode
    sf.write(buffer, samples, spec.sample_rate, format=spec.container, subtype=spec.subtype, **extra)
    return buffer.getvalue()


def filename(stem: str, fmt: AudioFormat | str) -> str:
    """``stem`` with the format's extension, e.g. ``jobs/<id>.flac``."""
    spec = fmt if isinstance(fmt, AudioFormat) else get_format(fmt)
    return f"{stem}.{spec.extension}"
