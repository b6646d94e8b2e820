"""Input audio: decode any file soundfile reads, mix to mono, resample with soxr, and refuse bad clips.

Torch-free on purpose: the API validates uploads with the same code the worker uses. A clip that passed the checks
is a ``CheckedClip``; the pipeline takes one as it is, so a worker checks each job's clip once, when it decodes it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import soxr

from auk_worker.errors import AudioError
from auk_worker.rules import MAX_TOTAL_SECONDS, MIN_CLIP_SAMPLES_24K, resampled_length
from auk_worker.types import SAMPLE_RATE, AudioClip

THINKER_SAMPLE_RATE = 16_000  # the Whisper-style feature extractor's rate
MAX_CHANNELS = 8
MAX_PEAK = 1000.0  # full scale is 1.0; far louder than any real recording, far below where fp32 features overflow
_READ_BLOCK = 1 << 16  # frames a read: a header that lies about the length never sizes an allocation


@dataclass(frozen=True)
class CheckedClip(AudioClip):
    """A clip ``validate_clip`` made (mono float32, finite, within the length and peak limits). Only
    ``validate_clip`` and ``decode_audio`` make one; ``checked_clip`` passes it on without checking it again."""


def decode_audio(data: bytes, *, max_seconds: float = MAX_TOTAL_SECONDS) -> CheckedClip:
    """Decode an encoded clip (WAV, FLAC, OGG, ...) into mono float32 at its own sample rate.

    The file is read in blocks and no further than ``max_seconds`` allows, so a header that declares a huge length
    (a damaged or hostile file) never sizes an allocation: such a file decodes to the audio it holds, or fails as
    undecodable when libsndfile cannot seek past its real end."""
    if not data:
        raise AudioError("the audio file is empty (0 bytes)")
    try:
        with sf.SoundFile(io.BytesIO(data)) as handle:
            rate, channels, declared = handle.samplerate, handle.channels, handle.frames
            _check_format(rate, channels)  # before any sample is read
            limit = int(max_seconds * rate)  # frames; one more proves the clip too long
            blocks, total = [], 0
            while total <= limit:
                block = handle.read(min(_READ_BLOCK, limit + 1 - total), dtype="float32", always_2d=True)
                if len(block) == 0:
                    break
                blocks.append(block)
                total += len(block)
    except AudioError:
        raise
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        reason = str(exc).rsplit(": ", 1)[-1]  # libsndfile's own words, without the stream's repr
        raise AudioError(f"the file is not audio that can be decoded ({reason})") from None
    if total > limit:
        length = f"{declared / rate:.2f} s long by its header" if declared > limit else f"over {max_seconds:g} s long"
        raise AudioError(f"the audio is {length}; at most {max_seconds:g} s is accepted")
    samples = np.concatenate(blocks) if blocks else np.zeros((0, channels), dtype=np.float32)
    return validate_clip(samples, rate, max_seconds=max_seconds)


def _check_format(sample_rate: int, channels: int) -> None:
    if sample_rate <= 0:
        raise AudioError(f"the audio has an invalid sample rate ({sample_rate} Hz)")
    if channels > MAX_CHANNELS:
        raise AudioError(f"the audio has {channels} channels; at most {MAX_CHANNELS} are accepted")


def validate_clip(samples: np.ndarray, sample_rate: int, *, max_seconds: float = MAX_TOTAL_SECONDS) -> CheckedClip:
    """Check an in-memory clip ([t] or [t, channels]) and mix it to mono float32."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 1:
        samples = samples[:, None]
    if samples.ndim != 2:
        raise AudioError(f"audio must be [samples] or [samples, channels], got shape {tuple(samples.shape)}")
    _check_format(sample_rate, samples.shape[1])
    if samples.shape[0] == 0:
        raise AudioError("the audio holds no samples")
    if not np.isfinite(samples).all():
        raise AudioError("the audio contains NaN or infinite samples")
    peak = float(np.abs(samples).max())
    if peak > MAX_PEAK:
        raise AudioError(f"the audio's peak amplitude is {peak:.3g}; at most {MAX_PEAK:g} is accepted (full scale "
                         "is 1.0)")
    duration = samples.shape[0] / sample_rate
    if duration > max_seconds:
        raise AudioError(f"the audio is {duration:.2f} s long; at most {max_seconds:g} s is accepted")
    min_seconds = MIN_CLIP_SAMPLES_24K / SAMPLE_RATE
    if duration < min_seconds:
        raise AudioError(f"the audio is {duration * 1000:.1f} ms long; at least {min_seconds * 1000:.0f} ms is needed")
    # A mono clip is copied as it is: numpy's mean over an axis of one is ten times slower than the copy.
    mono = samples[:, 0].copy() if samples.shape[1] == 1 else samples.mean(axis=1, dtype=np.float32)
    return CheckedClip(samples=mono, sample_rate=int(sample_rate))  # both forms are new contiguous arrays


def checked_clip(clip: AudioClip) -> CheckedClip:
    """``clip`` itself when ``validate_clip`` made it; else the clip checked now (an in-memory clip handed over)."""
    if isinstance(clip, CheckedClip):
        return clip
    return validate_clip(clip.samples, clip.sample_rate)


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """soxr HQ resampling of a mono clip, padded or trimmed to ``resampled_length`` samples (the length the 30 s
    rule counts, ``rules.py``)."""
    if from_rate == to_rate:
        return samples.astype(np.float32, copy=False)
    out = soxr.resample(samples, from_rate, to_rate, quality="HQ").astype(np.float32, copy=False)
    want = resampled_length(len(samples), from_rate, to_rate)
    if len(out) < want:
        out = np.pad(out, (0, want - len(out)))
    return out[:want]


def read_audio_file(path: str) -> AudioClip:
    """Decode a clip from a path (the CLI's --audio)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise AudioError(f"cannot read the audio file {path}: {exc.strerror}") from None
    return decode_audio(data)
