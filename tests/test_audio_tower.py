"""The whole-chunk audio tower (audio_tower.py) against transformers' Qwen2_5OmniAudioEncoder: same embeddings for
clips shorter than a chunk, whole chunks, partial last chunks and odd token counts; fixed shapes per chunk count;
and ThinkerTrunk.embed_audio with the runner attached. CPU only: the CUDA graph capture itself runs in test_gpu."""

from __future__ import annotations

import copy

import pytest
import torch

from auk_worker.errors import AudioError
from auk_worker.model.thinker.audio_tower import AudioTowerRunner, ChunkPlan
from auk_worker.model.thinker.prompt import audio_token_count
from auk_worker.model.thinker.trunk import ThinkerTrunk, load_thinker_trunk
from auk_worker.pipeline.thinker_graphs import AudioTowerGraphs
from auk_worker.tiny.qwen import tiny_config, tiny_vocab, write_tiny_qwen

# fp32: measured at most 6.3e-7 of the output's largest magnitude (different SDPA kernels, masked vs split).
FP32_TOLERANCE = 1e-5
# Half-precision weights, measured on CPU where the last chunk is partial (the masked SDPA kernel rounds differently
# from the reference's unmasked one; whole chunks came out identical): bf16 at most 5.3e-3 of the largest magnitude
# (cosine >= 0.999997), fp16 at most 7.6e-4.
HALF_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _randomize(tower: torch.nn.Module, seed: int) -> None:
    """Seeded weights with non-zero biases everywhere, so a padded column or key that leaked would show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(tower.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1 and name.endswith("weight"):  # LayerNorm gains
                param.copy_(1.0 + 0.1 * noise)
            elif param.ndim == 1:  # biases
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.15 * noise)


def tiny_trunk(n_window: int, seed: int = 0) -> ThinkerTrunk:
    """The tiny snapshot's trunk (audio d_model 32, 2 layers, 4 heads) with its audio chunks set by ``n_window``."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig

    raw = tiny_config(tiny_vocab()[1])["thinker_config"]
    raw["audio_config"]["n_window"] = n_window
    trunk = ThinkerTrunk(Qwen2_5OmniThinkerConfig.from_dict(raw)).eval().requires_grad_(False)
    _randomize(trunk.audio_tower, seed)
    return trunk


def mel(frames: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-mel-like features [1, 128, f] and their all-ones mask [1, f]."""
    features = torch.randn(1, 128, frames, generator=torch.Generator().manual_seed(seed + frames))
    return features, torch.ones(1, frames, dtype=torch.long)


def reference(trunk: ThinkerTrunk, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The transformers path: embed_audio with no runner attached."""
    assert trunk.audio_runner is None
    with torch.inference_mode():
        return trunk.embed_audio(features, mask)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


@pytest.fixture(scope="module")
def small() -> ThinkerTrunk:
    """Chunks of 8 frames -> 4 tokens."""
    return tiny_trunk(n_window=4)


@pytest.fixture(scope="module")
def release_window(tmp_path_factory) -> ThinkerTrunk:
    """The tiny snapshot as loaded for serving: n_window 100 (chunks of 200 frames), computed buffers rebuilt."""
    path = tmp_path_factory.mktemp("qwen") / "tiny"
    write_tiny_qwen(path, seed=0)
    return load_thinker_trunk(path, torch.device("cpu"), torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Planning


def test_chunk_plan_counts_chunks_last_frames_and_tokens():
    assert ChunkPlan.for_frames(150, n_window=100) == ChunkPlan(150, 200, 1, 150, 37)
    assert ChunkPlan.for_frames(200, n_window=100) == ChunkPlan(200, 200, 1, 200, 50)
    assert ChunkPlan.for_frames(201, n_window=100) == ChunkPlan(201, 200, 2, 1, 50)
    assert ChunkPlan.for_frames(3000, n_window=100) == ChunkPlan(3000, 200, 15, 200, 750)
    for frames in range(1, 50):
        plan = ChunkPlan.for_frames(frames, n_window=4)
        assert (plan.chunks - 1) * 8 + plan.last_frames == frames and 1 <= plan.last_frames <= 8
        assert plan.audio_tokens == audio_token_count(frames)
    with pytest.raises(AudioError):
        ChunkPlan.for_frames(0, n_window=100)


# ---------------------------------------------------------------------------------------------------------------
# Equality with transformers


@pytest.mark.parametrize(
    "frames",
    [
        3,  # shorter than one chunk: 2 tokens after conv2, one audio token
        5,  # shorter than one chunk, odd token count (3): the pool drops the last
        8,  # exactly one chunk
        16,  # exactly two chunks
        21,  # two chunks + 5 frames: 11 tokens, the last chunk's 3 padded keys masked
        26,  # three chunks + 2 frames: one token in the last chunk, odd total
        77,  # ten chunks, the last partial
    ],
)
def test_equals_transformers_fp32(small, frames):
    features, mask = mel(frames)
    expected = reference(small, features, mask)
    ours = AudioTowerRunner(small.audio_tower)(features, mask)
    assert ours.shape == (audio_token_count(frames), 64)
    assert relative_error(ours, expected) < FP32_TOLERANCE


@pytest.mark.parametrize("frames", [5, 6, 17, 61])
def test_pooling_pairs_tokens_across_chunks_when_a_chunk_has_an_odd_token_count(frames):
    """n_window 3: 3 tokens a chunk, so average-pool pairs straddle chunk borders, as in the reference."""
    trunk = tiny_trunk(n_window=3, seed=1)
    features, mask = mel(frames)
    ours = AudioTowerRunner(trunk.audio_tower)(features, mask)
    assert relative_error(ours, reference(trunk, features, mask)) < FP32_TOLERANCE


@pytest.mark.parametrize("frames", [150, 200, 400, 477, 1937])
def test_equals_transformers_at_the_release_window(release_window, frames):
    features, mask = mel(frames, seed=3)
    expected = reference(release_window, features, mask)
    ours = AudioTowerRunner(release_window.audio_tower)(features, mask)
    assert ours.shape == (audio_token_count(frames), 64)
    assert relative_error(ours, expected) < FP32_TOLERANCE


def test_clips_of_one_or_two_frames_give_no_tokens(small):
    for frames in (1, 2):
        features, mask = mel(frames)
        ours = AudioTowerRunner(small.audio_tower)(features, mask)
        assert ours.shape == (0, 64) == reference(small, features, mask).shape


def test_frames_are_picked_by_the_mask(small):
    """A right-padded clip (mask zeros past frame 21) encodes like its 21 valid frames alone."""
    features, _ = mel(30)
    mask = torch.zeros(1, 30, dtype=torch.long)
    mask[:, :21] = 1
    ours = AudioTowerRunner(small.audio_tower)(features, mask)
    alone = AudioTowerRunner(small.audio_tower)(features[:, :, :21].contiguous(), mask[:, :21])
    torch.testing.assert_close(ours, alone, rtol=0, atol=0)
    assert relative_error(ours, reference(small, features, mask)) < FP32_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_stay_close(dtype):
    trunk = tiny_trunk(n_window=100, seed=2).to(dtype)
    trunk.rebuild_computed_buffers(torch.device("cpu"))  # the serving layout: sinusoids stay fp32
    runner = AudioTowerRunner(trunk.audio_tower)
    for frames in (150, 400, 477):
        features, mask = mel(frames)
        expected = reference(trunk, features, mask)
        ours = runner(features, mask)
        assert ours.dtype == dtype
        assert relative_error(ours, expected) < HALF_TOLERANCE[dtype]
        cosine = torch.nn.functional.cosine_similarity(ours.float().flatten(), expected.float().flatten(), dim=0)
        assert cosine > 0.9999


# ---------------------------------------------------------------------------------------------------------------
# The fixed-shape core


def test_core_shapes_depend_only_on_the_chunk_count_and_read_no_data():
    """On the meta device every value is unknown: a host read or a data-dependent shape would raise."""
    tower = copy.deepcopy(tiny_trunk(n_window=4).audio_tower).to("meta")
    runner = AudioTowerRunner(tower)
    for chunks in (1, 2, 5):
        features = torch.empty(chunks, 128, 8, device="meta")
        chunk_frames = torch.empty(chunks, dtype=torch.long, device="meta")
        assert runner.core(features, chunk_frames).shape == (chunks * 4 // 2, 64)


def test_prepare_pads_the_last_chunk_with_zeros(small):
    features, mask = mel(21)
    chunks, chunk_frames, plan = AudioTowerRunner(small.audio_tower).prepare(features, mask)
    assert chunks.shape == (3, 128, 8) and chunk_frames.tolist() == [8, 8, 5] and plan.chunks == 3
    torch.testing.assert_close(chunks[1], features[0, :, 8:16], rtol=0, atol=0)
    torch.testing.assert_close(chunks[2, :, :5], features[0, :, 16:], rtol=0, atol=0)
    assert not chunks[2, :, 5:].any()


def test_graphs_off_cuda_run_the_eager_core(small):
    graphs = AudioTowerGraphs(AudioTowerRunner(small.audio_tower))
    graphs.capture_up_to(3)  # nothing to capture on CPU
    assert graphs.pool is None and not graphs.graphs
    features, mask = mel(21)
    torch.testing.assert_close(graphs(features, mask), AudioTowerRunner(small.audio_tower)(features, mask))


# ---------------------------------------------------------------------------------------------------------------
# Wired into the trunk


def test_embed_audio_with_the_runner_attached_equals_without(release_window):
    trunk = release_window
    keys = set(trunk.state_dict())
    features, mask = mel(477)
    expected = reference(trunk, features, mask)
    trunk.audio_runner = AudioTowerGraphs(AudioTowerRunner(trunk.audio_tower))
    try:
        assert set(trunk.state_dict()) == keys  # attaching registers no second copy of the weights
        with torch.inference_mode():
            ours = trunk.embed_audio(features, mask)
            batch_of_two = trunk.embed_audio(features.expand(2, -1, -1), mask.expand(2, -1))  # transformers path
    finally:
        trunk.audio_runner = None
    assert relative_error(ours, expected) < FP32_TOLERANCE
    torch.testing.assert_close(batch_of_two, torch.cat([expected, expected]), rtol=1e-5, atol=1e-5)
