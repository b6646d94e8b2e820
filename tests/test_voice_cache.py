"""The voice cache: a voice rendered again skips its preparation and gives the same samples, bit for bit, as a
render that prepared it (the tiny checkpoint on the CPU, fp32); the cache stays within its byte bound."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from auk_worker.voice_cache import VoiceCache, size_of

ZERO_SHOT = 'Say the following with the same voice: "Hi."'


def test_lru_by_bytes() -> None:
    cache = VoiceCache(max_bytes=3000)
    for name in "abc":
        cache.put(name, "clip", np.zeros(250, np.float32))  # 1000 bytes each
    assert len(cache) == 3 and cache.stats.bytes == 3000
    assert cache.get("a", "clip") is not None  # a is now the most recent
    cache.put("d", "clip", np.zeros(250, np.float32))  # b goes: least recently used
    assert cache.get("b", "clip") is None and cache.get("a", "clip") is not None
    assert cache.stats.bytes == 3000 and cache.stats.evictions == 1
    cache.put("huge", "clip", np.zeros(10_000, np.float32))  # larger than the bound: not kept, nothing evicted
    assert cache.get("huge", "clip") is None and len(cache) == 3
    assert VoiceCache(0).get("a", "clip") is None  # 0 is off
    assert cache.stats.hits == 2 and cache.stats.misses >= 2


def test_size_of_counts_tensors_and_dataclasses() -> None:
    torch = pytest.importorskip("torch")

    @dataclasses.dataclass
    class Piece:
        a: np.ndarray
        b: object
        n: int

    assert size_of(Piece(np.zeros(10, np.float32), torch.zeros(3, 4), 7)) == 40 + 48


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    from auk_worker.pipeline import AuKPipeline
    from auk_worker.tiny.checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "base", variant="base")
    return AuKPipeline.load(path, device="cpu")


def test_cached_voice_renders_bit_identical(pipe) -> None:
    """Render a voice cold without a cache, then twice through a cache (a miss that fills it, a hit that reads it):
    the three waveforms are equal sample for sample, and the hit skipped the reference encode."""
    from auk_worker.types import AudioClip, RenderRequest

    rng = np.random.default_rng(3)
    samples = (0.2 * rng.standard_normal(int(0.9 * 44_100))).astype(np.float32)
    clip = AudioClip(samples=samples, sample_rate=44_100, key="sha256-of-the-voice")
    request = RenderRequest(ZERO_SHOT, audio=clip, gen_seconds=0.5, num_inference_steps=3, seed=11)

    pipe.voice_cache = None
    cold = pipe.render(request)
    cache = VoiceCache(64 * 1024 * 1024)
    pipe.voice_cache = cache
    try:
        first = pipe.render(request)
        assert cache.stats.misses == 1 and len(cache) == 1
        second = pipe.render(dataclasses.replace(request, instruction='Say the following with the same voice: "Hi."'))
        assert cache.stats.hits == 1
        other_seed = pipe.render(dataclasses.replace(request, seed=12))
    finally:
        pipe.voice_cache = None
    assert np.array_equal(cold.waveform, first.waveform)
    assert np.array_equal(first.waveform, second.waveform)
    assert second.timings["vae_encode"] == 0.0 and first.timings["vae_encode"] > 0.0
    assert not np.array_equal(first.waveform, other_seed.waveform)  # the cache keeps the voice, not the noise
    assert cache.stats.bytes > 0
