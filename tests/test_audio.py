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
    with pytest.raises(AudioError, match="31.00 s long by its header; at most 30 s"):
        decode_audio(wav_bytes(np.zeros(31 * 8_000, dtype=np.float32), 8_000))
    with pytest.raises(AudioError, match="at least 20 ms"):
        decode_audio(wav_bytes(np.zeros(100, dtype=np.float32), 24_000))


def test_too_many_channels():
    with pytest.raises(AudioError, match="9 channels"):
        validate_clip(np.zeros((24_000, 9), dtype=np.float32), 24_000)
    # From a file the header's channel count is checked before any sample is read, with the same words.
    with pytest.raises(AudioError, match="^the audio has 9 channels; at most 8 are accepted$"):
        decode_audio(wav_bytes(np.zeros((24_000, 9), dtype=np.float32), 24_000))


def _flac_declaring(total_samples: int, seconds: float = 1.0, rate: int = 16_000) -> bytes:
    """A real FLAC clip whose STREAMINFO header claims ``total_samples`` frames (its 36-bit field, file bytes
    18-25 with the sample rate, channels and bit depth before it), as a damaged or hostile file would."""
    data = bytearray(wav_bytes(np.zeros(int(seconds * rate), dtype=np.float32) + 0.25, rate, "PCM_16", "FLAC"))
    assert data[:4] == b"fLaC"
    field = int.from_bytes(data[18:26], "big")
    field = (field & ~((1 << 36) - 1)) | total_samples
    data[18:26] = field.to_bytes(8, "big")
    return bytes(data)


def test_a_header_declaring_a_huge_length_is_an_audio_error_not_an_allocation():
    """Decoding once allocated what the header declared: 2^36 frames here, 256 GiB of float32, a MemoryError
    and an HTTP 500 for one upload. Now the file is read in blocks of bounded size; this one then fails cleanly
    (libsndfile cannot seek past the real end of a FLAC stream that claims more)."""
    with pytest.raises(AudioError, match="not audio that can be decoded"):
        decode_audio(_flac_declaring((1 << 36) - 1))
    # The same clip with its true length decodes.
    clip = decode_audio(_flac_declaring(16_000))
    assert (clip.sample_rate, len(clip.samples)) == (16_000, 16_000)
    np.testing.assert_allclose(clip.samples, 0.25, atol=1e-4)


def test_a_clip_longer_than_the_limit_is_refused_without_reading_it_all():
    # The header's length is the one reported; the read stops one frame past the limit.
    with pytest.raises(AudioError, match="40.00 s long by its header; at most 30 s"):
        decode_audio(wav_bytes(np.zeros(40 * 8_000, dtype=np.float32), 8_000))
    with pytest.raises(AudioError, match="3.00 s long by its header; at most 2 s"):
        decode_audio(_flac_declaring(48_000, seconds=3.0), max_seconds=2.0)


def test_absurdly_loud_samples_are_refused():
    """A finite float clip at 1e30 decoded fine and then failed its job as a model error (non-finite audio)."""
    x = np.zeros(24_000, dtype=np.float32)
    x[5] = 1e30
    with pytest.raises(AudioError, match="peak amplitude is 1e\\+30; at most 1000"):
        decode_audio(wav_bytes(x, 24_000, "FLOAT"))
    x[5] = 4.0  # loud, clipped, but audio: accepted
    assert validate_clip(x, 24_000).samples[5] == 4.0
