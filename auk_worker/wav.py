"""Encode a waveform as a WAV file in memory (PCM 16-bit by default, float32 on request)."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf

SUBTYPES = {"pcm16": "PCM_16", "float32": "FLOAT"}


def write_wav(waveform: np.ndarray, sample_rate: int, output_format: str = "pcm16") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, np.asarray(waveform, dtype=np.float32), sample_rate, subtype=SUBTYPES[output_format], format="WAV")
    return buffer.getvalue()
