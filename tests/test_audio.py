"""Input audio: any rate and channel count in, mono float32 out; every bad clip gets its own error."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from auk_worker.audio import decode_audio, resample, validate_clip
from auk_worker.errors import AudioError


def wav_bytes(samples: np.ndarray, rate: int, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, subtype=subtype, format=fmt)
    return buffer.getvalue()


def test_stereo_44k_is_mixed_to_mono_at_its_own_rate():
    t = np.arange(44_100) / 44_100
    left, right = 0.5 * np.sin(2 * np.pi * 220 * t), 0.1 * np.ones_like(t)
    clip = decode_audio(wav_bytes(np.stack([left, right], axis=1), 44_100, "FLOAT"))
    assert clip.sample_rate == 44_100
    assert clip.samples.dtype == np.float32 and clip.samples.shape == (44_100,)
    np.testing.assert_allclose(clip.samples, (left + right) / 2, atol=1e-6)


@pytest.mark.parametrize("shape", [(24_000,), (24_000, 1)])
def test_mono_clip_comes_back_equal_and_as_its_own_copy(shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    clip = validate_clip(x, 24_000)
    assert clip.samples.shape == (24_000,) and clip.samples.flags.c_contiguous
    np.testing.assert_array_equal(clip.samples, x.reshape(-1))
    assert not np.shares_memory(clip.samples, x)


def test_flac_decodes():
    clip = decode_audio(wav_bytes(np.zeros(16_000, dtype=np.float32) + 0.25, 16_000, "PCM_16", "FLAC"))
    assert clip.duration_s == pytest.approx(1.0)
    assert clip.samples[100] == pytest.approx(0.25, abs=1e-4)


def test_resample_length_is_ceil_of_ratio():
    x = np.random.default_rng(0).standard_normal(44_101).astype(np.float32)
    y = resample(x, 44_100, 24_000)
    assert len(y) == -(-44_101 * 24_000 // 44_100)
    assert y.dtype == np.float32
    tone = np.sin(2 * np.pi * 440 * np.arange(48_000) / 48_000).astype(np.float32)
    down = resample(tone, 48_000, 16_000)
    expected = np.sin(2 * np.pi * 440 * np.arange(16_000) / 16_000)
    assert np.abs(down[200:-200] - expected[200:-200]).max() < 1e-2


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"this is not a wav file at all" * 10, "not audio"),
    ],
)
def test_undecodable_bytes(data, message):
    with pytest.raises(AudioError, match=message):
        decode_audio(data)


def test_wav_with_no_samples():
    with pytest.raises(AudioError, match="no samples"):
        decode_audio(wav_bytes(np.zeros((0, 1), dtype=np.float32), 24_000))


def test_non_finite_samples():
    x = np.zeros(24_000, dtype=np.float32)
    x[10] = np.nan
    with pytest.raises(AudioError, match="NaN or infinite"):
        decode_audio(wav_bytes(x, 24_000, "FLOAT"))
    x[10] = np.inf
    with pytest.raises(AudioError, match="NaN or infinite"):
        validate_clip(x, 24_000)


def test_too_long_and_too_short():
    with pytest.raises(AudioError, match="31.00 s long; at most 30 s"):
        decode_audio(wav_bytes(np.zeros(31 * 8_000, dtype=np.float32), 8_000))
    with pytest.raises(AudioError, match="at least 20 ms"):
        decode_audio(wav_bytes(np.zeros(100, dtype=np.float32), 24_000))


def test_too_many_channels():
    with pytest.raises(AudioError, match="9 channels"):
        validate_clip(np.zeros((24_000, 9), dtype=np.float32), 24_000)
