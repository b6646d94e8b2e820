"""Segments into one waveform: short cross-fades, the pauses punctuation asks for, one loudness; incrementally, so
that each segment's part of the file is final (and can be streamed) as soon as the next one may no longer touch it.

At a boundary the earlier segment fades out over its last ``C`` samples and the later one fades in over its first
``C``, starting ``pause - C`` after the earlier one's end: with no pause the two overlap by exactly ``C`` (a
cross-fade); with a pause they are apart by ``pause - C`` of silence. So a boundary adds ``pause - C`` to the
length, and the joined length is known before anything renders (``joined_samples``).

- ``power`` curves (sin/cos, sin^2 + cos^2 = 1) keep the power of two UNRELATED signals steady: text segments.
- ``amplitude`` curves (sin^2/cos^2, summing to 1) keep the level of two COHERENT signals steady: windows of one
  recording, which render the same sound twice in their overlap; equal-power curves would raise it by up to 3 dB.

Loudness: each text segment is scaled to ``TARGET_RMS`` measured over its active 20 ms blocks (a gate drops the
silences), at most +-20 dB and never past a 0.99 peak. The gain depends on the segment alone, so a streamed segment
needs nothing that follows it.
"""

from __future__ import annotations

import numpy as np

TARGET_RMS = 0.1  # -20 dBFS over the active blocks
GATE_RMS = 10 ** (-50 / 20)  # blocks quieter than -50 dBFS are silence, left out of the measure
MAX_GAIN = 10.0  # +-20 dB
PEAK = 0.99
BLOCK_S = 0.02
CROSSFADE_S = 0.04


def curves(length: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(fade-out, fade-in) of ``length`` samples: equal ``power`` or equal ``amplitude``."""
    t = (np.arange(length, dtype=np.float64) + 0.5) / max(length, 1)
    out, into = np.cos(0.5 * np.pi * t), np.sin(0.5 * np.pi * t)
    if kind == "amplitude":
        out, into = out**2, into**2
    elif kind != "power":
        raise ValueError(f"curve must be 'power' or 'amplitude', got {kind!r}")
    return out.astype(np.float32), into.astype(np.float32)


def level_gain(samples: np.ndarray, sample_rate: int) -> float:
    """The gain that brings ``samples`` to ``TARGET_RMS`` over its active blocks (1.0 for silence)."""
    block = max(1, int(BLOCK_S * sample_rate))
    whole = len(samples) // block * block
    if whole == 0:
        return 1.0
    power = np.mean(np.square(samples[:whole].astype(np.float64)).reshape(-1, block), axis=1)
    active = power[power > GATE_RMS**2]
    if active.size == 0:
        return 1.0
    gain = float(np.clip(TARGET_RMS / np.sqrt(active.mean()), 1 / MAX_GAIN, MAX_GAIN))
    peak = float(np.max(np.abs(samples))) if len(samples) else 0.0
    return min(gain, PEAK / peak) if peak * gain > PEAK else gain


def joined_samples(lengths: list[int], pauses: list[int], crossfade: int) -> int:
    """Length of the joined file: the segments, plus ``pause - C`` at each boundary (``pauses[i]`` follows
    segment i; the last is ignored)."""
    return sum(lengths) + sum(pauses[i] - crossfade for i in range(len(lengths) - 1))


class Joiner:
    """Adds segments in order; each ``add`` returns the samples of the file that became final."""

    def __init__(self, sample_rate: int, *, crossfade: int | None = None, curve: str = "power",
                 loudness: bool = True) -> None:  # fmt: skip
        self.sample_rate = sample_rate
        self.crossfade = int(round(CROSSFADE_S * sample_rate)) if crossfade is None else crossfade
        self.curve = curve
        self.loudness = loudness
        self.buffer = np.zeros(0, dtype=np.float32)  # the file from ``emitted`` on
        self.emitted = 0  # samples handed out so far
        self.next_start = 0  # where the next segment begins
        self.spans: list[tuple[int, int]] = []  # each segment's (start, end) in the file, in samples
        self.gains: list[float] = []
        self.done = False

    def add(self, samples: np.ndarray, pause: int = 0, *, last: bool = False) -> np.ndarray:
        """Place the next segment (followed by ``pause`` samples of silence unless ``last``); return what is final."""
        if self.done:
            raise RuntimeError("the last segment was already added")
        x = np.asarray(samples, dtype=np.float32).copy()
        gain = level_gain(x, self.sample_rate) if self.loudness else 1.0
        self.gains.append(gain)
        x *= np.float32(gain)
        fade = min(self.crossfade, len(x) // 2)
        fade_out, fade_in = curves(fade, self.curve)
        first = not self.spans
        if not first and fade:
            x[:fade] *= fade_in
        if not last and fade:
            x[len(x) - fade :] *= fade_out
        start = self.next_start
        offset = start - self.emitted
        if offset < 0:
            raise ValueError("a segment shorter than twice the cross-fade cannot overlap its neighbour")
        needed = offset + len(x)
        if needed > len(self.buffer):
            self.buffer = np.concatenate([self.buffer, np.zeros(needed - len(self.buffer), dtype=np.float32)])
        self.buffer[offset:needed] += x
        end = start + len(x)
        self.spans.append((start, end))
        if last:
            self.done = True
            return self._emit(len(self.buffer))
        self.next_start = end + max(pause, 0) - self.crossfade
        return self._emit(min(end - self.crossfade, self.next_start) - self.emitted)

    def _emit(self, count: int) -> np.ndarray:
        count = max(0, min(count, len(self.buffer)))
        chunk, self.buffer = self.buffer[:count], self.buffer[count:]
        self.emitted += count
        return chunk


def join(segments: list[np.ndarray], pauses: list[int], sample_rate: int, **options: object) -> np.ndarray:
    """Every segment at once (``Joiner``'s output concatenated)."""
    joiner = Joiner(sample_rate, **options)  # type: ignore[arg-type]
    chunks = [joiner.add(seg, pauses[i], last=i == len(segments) - 1) for i, seg in enumerate(segments)]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
