"""Output formats: every format decodes back (soundfile; raw PCM by numpy) with the right rate, channels and length;
the lossless ones round-trip exactly at 16 bits; integer formats clip; unsupported names are caller errors."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soundfile as sf

from auk_worker.errors import InputError
from auk_worker.formats import FORMATS, LEGACY_NAMES, UnsupportedFormat, encode, filename, get_format
from auk_worker.streaming import FIRST_PIECE_S, PIECE_S, AudioStream, open_encoder
from auk_worker.types import SAMPLE_RATE

# Lossy codecs work in frames and add encoder delay and padding: an MP3 frame at 24 kHz (MPEG-2 Layer III) is
# 576 samples and LAME adds its delay on top, an Opus frame 20 ms (480 samples) after a pre-skip. Both files
# record how much to trim (the LAME tag's delay and padding; OpusHead's pre-skip and the last page's granule
# position), and libsndfile's decoders trim it, so the decoded length is expected to equal the encoded one; the
# tolerance of one frame is what a decoder that honoured the header only to the frame would still meet.
LOSSY_LENGTH_TOLERANCE = {"mp3": 576, "opus": 480}
# ADTS has no field for the encoder's delay: FFmpeg's AAC decode starts with 1024 samples of priming and ends on a
# whole 1024-sample frame.
AAC_PRIMING = 1024


def speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """Two tones under a slow envelope plus a little noise: enough structure for the lossy codecs."""
    t = np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    rng = np.random.default_rng(seed)
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)
    tones = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1250 * t)
    return (envelope * tones + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def decode(data: bytes, name: str) -> tuple[np.ndarray, int, int]:
    """(samples as float32, rate, channels); raw PCM has no header, so its rate and layout are the format's."""
    if name == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768, SAMPLE_RATE, 1
    if name == "aac":  # libsndfile reads no AAC: FFmpeg's decoder (PyAV), priming dropped
        samples, rate, channels = decode_ffmpeg(data, "aac")
        return samples[AAC_PRIMING:, 0], rate, channels
    samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return samples[:, 0], rate, samples.shape[1]


def decode_ffmpeg(data: bytes, demuxer: str | None = None) -> tuple[np.ndarray, int, int]:
    """(samples [t, channels], rate, channels) as FFmpeg decodes them."""
    with av.open(io.BytesIO(data), format=demuxer) as container:  # a short ADTS stream is not probed: name it
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() for frame in container.decode(stream)]
        rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
    return np.concatenate(frames, axis=1).T, rate, channels


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("seconds", [0.01, 1.0, 3.37])
def test_every_format_decodes_back_with_rate_channels_and_length(name: str, seconds: float) -> None:
    x = speechlike(seconds)
    data = encode(x, name)
    y, rate, channels = decode(data, name)
    assert rate == SAMPLE_RATE and channels == 1
    if FORMATS[name].lossless:
        assert len(y) == len(x)
    elif name == "aac":  # the last frame is padded to 1024 samples
        assert 0 <= len(y) - len(x) < 1024, (len(y), len(x))
    else:
        assert abs(len(y) - len(x)) <= LOSSY_LENGTH_TOLERANCE[name], (len(y), len(x))


@pytest.mark.parametrize("name", ["mp3", "opus", "aac"])
def test_lossy_formats_keep_the_signal_in_place(name: str) -> None:
    """The decoded audio lines up with the input (no leftover encoder delay) and resembles it."""
    x = speechlike(2.0, seed=1)
    y, _, _ = decode(encode(x, name), name)
    n = min(len(x), len(y))
    middle = slice(2400, n - 2400)  # away from the codec's start-up and tail
    lags = range(-48, 49)
    score = [float(np.dot(x[middle], np.roll(y[:n], -lag)[middle])) for lag in lags]
    assert lags[int(np.argmax(score))] == 0
    error = y[middle] - x[middle]
    snr_db = 10 * np.log10(np.sum(x[middle] ** 2) / np.sum(error**2))
    assert snr_db > 6, snr_db


@pytest.mark.parametrize("name", ["wav", "flac", "pcm"])
def test_lossless_16_bit_formats_round_trip_exactly(name: str) -> None:
    """Every 16-bit value, written as k / 32768, comes back as the same integer."""
    k = np.arange(-32768, 32768, dtype=np.int32)
    data = encode((k / 32768).astype(np.float32), name)
    if name == "pcm":
        back = np.frombuffer(data, dtype="<i2")
        assert len(data) == 2 * k.size  # no header
    else:
        back, _ = sf.read(io.BytesIO(data), dtype="int16")
    np.testing.assert_array_equal(back, k)


def test_pcm_is_the_wav_data_chunk() -> None:
    x = speechlike(0.5, seed=2)
    wav, pcm = encode(x, "wav"), encode(x, "pcm")
    assert wav.endswith(pcm) and wav[:4] == b"RIFF"


def test_float_wav_is_exact_and_not_clipped() -> None:
    x = speechlike(0.5, seed=3) * 3.0  # peaks above full scale survive in float
    y, _ = sf.read(io.BytesIO(encode(x, "wav_float")), dtype="float32")
    np.testing.assert_array_equal(y, x)
    assert sf.info(io.BytesIO(encode(x, "wav_float"))).subtype == "FLOAT"


@pytest.mark.parametrize("name", ["wav", "flac", "pcm", "mp3", "opus", "aac"])
def test_out_of_range_samples_are_clamped_not_wrapped(name: str) -> None:
    """A tone at four times full scale comes back as a clipped tone, never louder than full scale (give or take a
    lossy codec's ringing) and never wrapped around to the other sign."""
    t = np.arange(SAMPLE_RATE // 2) / SAMPLE_RATE
    x = (4.0 * np.sin(2 * np.pi * 200 * t)).astype(np.float32)
    y, _, _ = decode(encode(x, name), name)
    if FORMATS[name].lossless:
        assert y.max() == 32767 / 32768 and y.min() == -1.0
        np.testing.assert_array_equal(np.sign(y[np.abs(x) > 0.01]), np.sign(x[np.abs(x) > 0.01]))
    else:
        middle = y[2400:len(x) - 2400]
        assert 0.8 < np.abs(middle).max() < 1.3
        assert np.mean(np.sign(middle) == np.sign(x[2400:-2400])) > 0.95


def test_table_matches_openai_names_and_mime_types() -> None:
    assert {"mp3", "opus", "aac", "flac", "wav", "pcm"} <= set(FORMATS)
    assert get_format("aac").mime_type == "audio/aac" and encode(speechlike(0.1), "aac")[:2] == b"\xff\xf1"  # ADTS
    assert get_format("MP3").mime_type == "audio/mpeg"
    assert get_format("wav").mime_type == "audio/wav" and get_format("flac").mime_type == "audio/flac"
    assert get_format("opus").mime_type.startswith("audio/ogg")
    assert all(f.sample_rate == SAMPLE_RATE for f in FORMATS.values())
    assert filename("jobs/abc", "flac") == "jobs/abc.flac"
    assert {FORMATS[v].name for v in LEGACY_NAMES.values()} == {"wav", "wav_float"}


def test_unknown_names_are_caller_errors_naming_the_offered_formats() -> None:
    with pytest.raises(UnsupportedFormat, match="unknown response format 'ogg'.*choose one of wav, wav_float, flac, "
                                                "mp3, opus, aac, pcm") as info:  # fmt: skip
        encode(np.zeros(10, dtype=np.float32), "ogg")
    assert isinstance(info.value, InputError) and info.value.code == "unsupported_format"


# ---------------------------------------------------------------------------------------------------- streaming


STREAMED = sorted(name for name, spec in FORMATS.items() if spec.streams)


def test_the_formats_that_stream() -> None:
    assert STREAMED == ["aac", "mp3", "opus", "pcm", "wav"]
    with pytest.raises(ValueError, match="flac does not stream"):
        open_encoder("flac")


@pytest.mark.parametrize("name", STREAMED)
def test_pieces_make_one_file_that_decodes_to_the_whole(name: str) -> None:
    """Pieces of uneven sizes, each encoded as it comes: the bytes of every piece together are one file of the
    format; PCM and WAV hold the whole-file encoding's very samples, the lossy ones the signal in place."""
    x = speechlike(2.3, seed=4)
    encoder = open_encoder(name)
    parts = [encoder.feed(piece) for piece in np.split(x, [4800, 6000, 30000])] + [encoder.finish()]
    assert sum(1 for part in parts[:-1] if part) >= 3  # bytes come out as the pieces go in, not only at the end
    data = b"".join(parts)
    if name in ("pcm", "wav"):
        y, rate, _ = decode(data, name)
        np.testing.assert_array_equal(y, decode(encode(x, name), name)[0])
        if name == "wav":
            assert data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"  # open lengths
        return
    y, rate, channels = decode_ffmpeg(data)
    assert channels == 1 and rate in (SAMPLE_RATE, 48_000)  # FFmpeg decodes Opus at 48 kHz
    y = y[:, 0] if rate == SAMPLE_RATE else y[::2, 0]
    assert 0 <= len(y) - len(x) <= 4096
    lags = range(0, 4096)
    middle = slice(4800, len(x) - 4800)
    score = [float(np.dot(x[middle], y[lag:][middle])) for lag in lags]
    delay = lags[int(np.argmax(score))]
    error = y[delay:][middle] - x[middle]
    assert 10 * np.log10(np.sum(x[middle] ** 2) / np.sum(error**2)) > 6


def test_an_audio_stream_sends_a_short_first_piece_then_the_rest_and_a_final_marker() -> None:
    sent: list[tuple[dict, bytes]] = []
    stream = AudioStream(lambda header, body: sent.append((header, body)), "pcm", {"render": 0.5})
    x = speechlike(2.5, seed=5)
    stream.feed(x[:SAMPLE_RATE])  # a segment, then another, as a long text's segments finish
    stream.feed(x[SAMPLE_RATE:])
    stream.close()
    headers = [header for header, _ in sent]
    assert [h["status"] for h in headers] == ["piece"] * (len(sent) - 1) + ["succeeded"] and headers[-1]["final"]
    assert [h["seq"] for h in headers[:-1]] == list(range(len(sent) - 1))
    assert headers[0]["samples"] == int(FIRST_PIECE_S * SAMPLE_RATE) and headers[0]["timings"]["render"] == 0.5
    assert max(h["samples"] for h in headers[:-1]) == int(PIECE_S * SAMPLE_RATE)
    assert b"".join(body for _, body in sent) == encode(x, "pcm")


def test_bad_waveforms_are_programming_errors() -> None:
    with pytest.raises(ValueError, match="mono"):
        encode(np.zeros((2, 10), dtype=np.float32))
    with pytest.raises(ValueError, match="NaN"):
        encode(np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(ValueError, match="24000 Hz"):
        encode(np.zeros(10, dtype=np.float32), "wav", sample_rate=16_000)
