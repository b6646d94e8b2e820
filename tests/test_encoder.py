"""Encoder stage: prompt layout, processor equivalence, fusion arithmetic, strict loading and the thinker forward,
all on the tiny offline Qwen2.5-Omni snapshot."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from auk_worker.errors import AudioError, CheckpointError, InputError, ModelError
from auk_worker.model.thinker import PromptProcessor, ThinkerEncoder
from auk_worker.model.thinker.prompt import NO_PROMPT_AUDIO, SYSTEM_PROMPT, render_prompt
from auk_worker.model.thinker.trunk import fuse_hidden_states, fuse_linears, thinker_layer, written_out_supported
from auk_worker.tiny.qwen import write_tiny_qwen

INSTRUCTION = "Make the voice sound like it is in a large hall."
TINY_LAYERS = 4
TINY_HIDDEN = 64


@pytest.fixture(scope="module", autouse=True)
def _offline():
    """Everything below reads the tiny snapshot from disk; any attempt to reach the Hub fails."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen") / "tiny"
    write_tiny_qwen(path, seed=0)
    return path


@pytest.fixture(scope="module")
def processor(snapshot) -> PromptProcessor:
    return PromptProcessor.from_pretrained(snapshot)


@pytest.fixture(scope="module")
def fusion() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([0.3, -1.0, 0.5, 2.0]), torch.tensor([1.7])


@pytest.fixture(scope="module")
def encoder(snapshot, fusion) -> ThinkerEncoder:
    return ThinkerEncoder.load(snapshot, *fusion, device="cpu", dtype=torch.float32)


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(round(seconds * 16000))
    t = np.arange(n) / 16000
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)


def expected_audio_tokens(num_samples: int) -> int:
    """25 tokens a second: 10 ms mel frames, halved by conv2 (rounding up), halved by the pool (rounding down)."""
    frames = math.ceil(num_samples / 160)
    return math.ceil(frames / 2) // 2


def copy_snapshot(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------------------------
# Prompt


def test_render_prompt_exact_strings():
    head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    assert SYSTEM_PROMPT == "You are a helpful assistant."
    assert render_prompt("Add rain.", has_audio=False) == head + "Add rain.|<no_prompt_audio>|" + tail
    assert render_prompt("Add rain.", has_audio=True) == head + "Add rain.<|audio_bos|><|AUDIO|><|audio_eos|>" + tail


def test_render_prompt_matches_the_chat_template(processor, snapshot):
    template = json.loads((snapshot / "chat_template.json").read_text())["chat_template"]
    with_audio = [
        {"role": "user", "content": [{"type": "text", "text": INSTRUCTION}, {"type": "audio", "audio": "ref.wav"}]}
    ]
    text_only = [{"role": "user", "content": [{"type": "text", "text": INSTRUCTION + NO_PROMPT_AUDIO}]}]
    for messages, has_audio in ((with_audio, True), (text_only, False)):
        rendered = processor.tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert rendered == render_prompt(INSTRUCTION, has_audio)


def test_text_only_ids_decode_to_the_rendered_prompt(processor):
    batch = processor(INSTRUCTION, None)
    assert set(batch) == {"input_ids", "attention_mask"}
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (1, batch["input_ids"].shape[1])
    assert bool(batch["attention_mask"].all())
    decoded = processor.tokenizer.decode(batch["input_ids"][0], skip_special_tokens=False)
    assert decoded == render_prompt(INSTRUCTION, has_audio=False)
    assert processor.audio_token_id not in batch["input_ids"][0].tolist()


@pytest.mark.parametrize("seconds, tokens", [(1.0, 25), (3.7, 92), (10.0, 250), (31.0, 775)])
def test_audio_placeholder_expands_to_one_token_per_audio_embedding(processor, seconds, tokens):
    audio = clip(seconds)
    assert expected_audio_tokens(audio.size) == tokens
    batch = processor(INSTRUCTION, audio)
    ids = batch["input_ids"][0].tolist()
    frames = math.ceil(audio.size / 160)
    assert batch["input_features"].shape == (1, 128, frames)
    assert batch["feature_attention_mask"].shape == (1, frames) and bool(batch["feature_attention_mask"].all())

    vocab = processor.tokenizer.convert_tokens_to_ids
    bos, eos = vocab("<|audio_bos|>"), vocab("<|audio_eos|>")
    start = ids.index(bos)
    assert ids[start + 1 : start + 1 + tokens] == [processor.audio_token_id] * tokens
    assert ids[start + 1 + tokens] == eos
    assert ids.count(processor.audio_token_id) == tokens
    decoded = processor.tokenizer.decode(ids, skip_special_tokens=False)
    assert decoded == render_prompt(INSTRUCTION, True).replace("<|AUDIO|>", "<|AUDIO|>" * tokens)
    # The tokens a render makes ahead, from the clip's length alone, while the clip is still being resampled.
    ahead = processor.input_ids(INSTRUCTION, audio.size)
    assert torch.equal(ahead, batch["input_ids"])
    assert torch.equal(processor(INSTRUCTION, audio, input_ids=ahead)["input_ids"], ahead)


@pytest.mark.parametrize(
    "instruction",
    [
        INSTRUCTION,
        " leading space, trailing space ",
        "\n\nnewlines first\nand inside\n",
        "Ünïcödé — 语音合成, émojis 🎙️ and digits 12345.",
        "tabs\tand  double  spaces!?",
    ],
)
def test_input_ids_are_the_tokenizers_ids_of_the_expanded_prompt(processor, instruction):
    """``input_ids`` encodes the prompt with one audio placeholder and repeats its id; that gives the ids of
    calling the tokenizer on the prompt with the placeholder repeated, whatever the text next to it, and the ids
    of calling it on the text-only prompt."""
    for samples in (None, 800, 16_000, 59_360, 480_000):
        text = render_prompt(instruction, samples is not None)
        if samples is not None:
            text = text.replace("<|AUDIO|>", "<|AUDIO|>" * expected_audio_tokens(samples))
        expected = processor.tokenizer(text, return_tensors="pt")["input_ids"]
        ids = processor.input_ids(instruction, samples)
        assert ids.dtype == expected.dtype and torch.equal(ids, expected), (instruction, samples)


def test_features_equal_the_processor_full_window_padding(processor):
    """Padding only past the clip gives the same valid frames as the processor's 300 s max_length padding."""
    extractor = processor.feature_extractor
    for samples in (5939, 192_000):  # a partial last hop, then 12 s
        audio = clip(samples / 16000, seed=1)
        full = extractor(
            audio, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt"
        )
        assert full["input_features"].shape[-1] == 30000  # Qwen2.5-Omni's 300 s window
        frames = int(full["attention_mask"].sum())
        features, mask = processor.audio_features(audio)
        assert mask.shape == (1, frames)
        torch.testing.assert_close(features, full["input_features"][:, :, :frames], rtol=0, atol=1e-6)


def test_more_silence_past_the_clip_changes_no_frame(processor):
    """What the log-mel graphs rely on: a clip in a longer zero buffer gives the same frames, and silence after."""
    hop = processor.feature_extractor.hop_length
    for samples in (5939, 16_000):
        audio = clip(samples / 16000, seed=2)
        features, _ = processor.audio_features(audio)
        frames = features.shape[-1]
        wave = torch.zeros(4 * 16_000)
        wave[:samples] = torch.from_numpy(audio)
        log_mel = processor.log_mel(wave)
        assert log_mel.shape == (128, wave.numel() // hop)
        torch.testing.assert_close(log_mel[None, :, :frames], features, rtol=0, atol=1e-6)
        assert torch.all(log_mel[:, frames + 3 :] == log_mel[0, -1])  # past every window that touches the clip


def test_matches_the_transformers_processor(processor, snapshot, monkeypatch):
    from transformers import AutoTokenizer, Qwen2_5OmniProcessor, WhisperFeatureExtractor
    from transformers.processing_utils import ProcessorMixin

    class NoVision:  # stands in for the image/video processors; only their merge sizes are read
        model_input_names: list[str] = []
        merge_size = 2
        temporal_patch_size = 2

    # Without torchvision/Pillow the image and video processors cannot be built; the processor's class check is
    # bypassed so that its text and audio path (the part AuK uses) can still be compared.
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg))
    try:
        reference = Qwen2_5OmniProcessor(
            image_processor=NoVision(),
            video_processor=NoVision(),
            feature_extractor=WhisperFeatureExtractor.from_pretrained(snapshot),
            tokenizer=AutoTokenizer.from_pretrained(snapshot),
        )
    except Exception as exc:  # noqa: BLE001 - any refusal means this transformers cannot run the comparison
        pytest.skip(f"Qwen2_5OmniProcessor cannot be built without vision processors here: {exc}")

    text_only = reference(text=render_prompt(INSTRUCTION, False), return_tensors="pt", padding=True)
    assert torch.equal(text_only["input_ids"], processor(INSTRUCTION, None)["input_ids"])
    for seconds in (1.0, 3.7):
        audio = clip(seconds, seed=2)
        ref = reference(text=render_prompt(INSTRUCTION, True), audio=[audio], return_tensors="pt", padding=True)
        mine = processor(INSTRUCTION, audio)
        assert torch.equal(ref["input_ids"], mine["input_ids"])
        frames = int(ref["feature_attention_mask"].sum())
        assert mine["input_features"].shape[-1] == frames
        torch.testing.assert_close(mine["input_features"], ref["input_features"][:, :, :frames], rtol=0, atol=1e-6)


def test_processor_rejects_reserved_tokens_and_bad_audio(processor):
    with pytest.raises(InputError, match="AUDIO"):
        processor("add <|AUDIO|> here", None)
    with pytest.raises(InputError, match="im_end"):
        processor("stop<|im_end|>", None)
    with pytest.raises(AudioError):
        processor(INSTRUCTION, np.zeros((2, 16000), np.float32))
    with pytest.raises(AudioError):
        processor(INSTRUCTION, np.array([0.0, np.nan], np.float32))
    with pytest.raises(AudioError):
        processor(INSTRUCTION, np.zeros(0, np.float32))


# ---------------------------------------------------------------------------------------------------------------
# Fusion


def test_fuse_hidden_states_matches_hand_computation():
    b, nt, d = 1, 2, 4
    embeddings = torch.full((b, nt, d), 123.0)  # must be ignored
    layers = [
        torch.arange(8, dtype=torch.float32).reshape(b, nt, d),
        torch.tensor([[[1.0, 1.0, 1.0, 5.0], [-2.0, 0.0, 2.0, 4.0]]]),
        (torch.arange(8, dtype=torch.float32).reshape(b, nt, d) ** 2).to(torch.bfloat16),
    ]
    logits = torch.tensor([0.5, -1.0, 2.0])
    scale = torch.tensor([3.0])

    weights = np.exp(logits.numpy() - logits.numpy().max())
    weights /= weights.sum()
    expected = np.zeros((b, nt, d))
    for w, h in zip(weights, layers):
        x = h.float().numpy().astype(np.float64)
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        expected += w * (x - mean) / np.sqrt(var + 1e-5)
    expected *= 3.0

    fused = fuse_hidden_states([embeddings, *layers], logits, scale)
    assert fused.dtype == torch.float32 and fused.shape == (b, nt, d)
    np.testing.assert_allclose(fused.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_fuse_hidden_states_refuses_a_different_layer_count():
    hidden = [torch.zeros(1, 2, 4)] * 4  # embeddings + 3 layers
    with pytest.raises(ModelError, match="4 hidden states"):
        fuse_hidden_states(hidden, torch.zeros(4), torch.ones(1))


# ---------------------------------------------------------------------------------------------------------------
# Loading


def test_load_ignores_vision_head_talker_and_vocoder(encoder, snapshot):
    keys = load_file(snapshot / "model.safetensors").keys()
    for family in ("thinker.visual.", "thinker.lm_head.", "talker.", "token2wav."):
        assert any(k.startswith(family) for k in keys)
    names = [name for name, _ in encoder.trunk.named_modules()]
    assert not any("visual" in name or "lm_head" in name for name in names)
    assert hasattr(encoder.trunk, "audio_tower") and hasattr(encoder.trunk, "model")
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in encoder.trunk.parameters())


def _rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_load_skips_stored_copies_of_computed_buffers(encoder, snapshot, fusion, tmp_path):
    stored = copy_snapshot(snapshot, tmp_path / "stored_sinusoids")
    key = "thinker.audio_tower.positional_embedding.positional_embedding"
    _rewrite_weights(stored, lambda t: t.update({key: torch.zeros(1500, 32)}))
    loaded = ThinkerEncoder.load(stored, *fusion, device="cpu", dtype=torch.float32)
    sinusoids = loaded.trunk.audio_tower.positional_embedding.positional_embedding
    assert torch.equal(sinusoids, encoder.trunk.audio_tower.positional_embedding.positional_embedding)
    assert sinusoids.abs().sum() > 0


def test_load_refuses_a_missing_key(snapshot, fusion, tmp_path):
    broken = copy_snapshot(snapshot, tmp_path / "missing")
    _rewrite_weights(broken, lambda t: t.pop("thinker.model.layers.2.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.down_proj\.weight"):
        ThinkerEncoder.load(broken, *fusion, device="cpu", dtype=torch.float32)


def test_load_refuses_an_unexpected_key(snapshot, fusion, tmp_path):
    broken = copy_snapshot(snapshot, tmp_path / "unexpected")
    _rewrite_weights(broken, lambda t: t.update({"thinker.foo": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"thinker\.foo"):
        ThinkerEncoder.load(broken, *fusion, device="cpu", dtype=torch.float32)
    _rewrite_weights(broken, lambda t: (t.pop("thinker.foo"), t.update({"vae.conv.weight": torch.zeros(2)})))
    with pytest.raises(CheckpointError, match=r"vae\.conv\.weight"):
        ThinkerEncoder.load(broken, *fusion, device="cpu", dtype=torch.float32)


def test_load_refuses_a_shape_mismatch(snapshot, fusion, tmp_path):
    broken = copy_snapshot(snapshot, tmp_path / "shape")
    _rewrite_weights(broken, lambda t: t.update({"thinker.model.norm.weight": torch.ones(32)}))
    with pytest.raises(CheckpointError, match=r"thinker\.model\.norm\.weight.*\(32,\).*\(64,\)"):
        ThinkerEncoder.load(broken, *fusion, device="cpu", dtype=torch.float32)


def test_load_refuses_fusion_tensors_of_another_depth(snapshot):
    with pytest.raises(CheckpointError, match="4 layers"):
        ThinkerEncoder.load(snapshot, torch.zeros(36), torch.ones(1), device="cpu", dtype=torch.float32)


def test_sharded_and_bare_thinker_snapshots_load_the_same_weights(encoder, snapshot, fusion, tmp_path):
    sharded = tmp_path / "sharded"
    write_tiny_qwen(sharded, seed=0, num_shards=3)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()

    bare = copy_snapshot(snapshot, tmp_path / "bare")
    config = json.loads((bare / "config.json").read_text())["thinker_config"]
    (bare / "config.json").write_text(json.dumps(config))

    def thinker_only(tensors: dict) -> None:
        for key in list(tensors):
            value = tensors.pop(key)
            if key.startswith("thinker."):
                tensors[key.removeprefix("thinker.")] = value

    _rewrite_weights(bare, thinker_only)

    reference = encoder.trunk.state_dict()
    for path in (sharded, bare):
        other = ThinkerEncoder.load(path, *fusion, device="cpu", dtype=torch.float32).trunk.state_dict()
        assert other.keys() == reference.keys()
        assert all(torch.equal(other[k], reference[k]) for k in reference)


# ---------------------------------------------------------------------------------------------------------------
# Forward


def test_encode_shapes_counts_and_determinism(encoder, processor):
    audio = clip(3.7)
    condition, mask = encoder.encode(INSTRUCTION, audio)
    nt = processor(INSTRUCTION, audio)["input_ids"].shape[1]
    assert condition.shape == (1, nt, TINY_HIDDEN) and condition.dtype == torch.float32
    assert mask.shape == (1, nt) and mask.dtype == torch.bool and bool(mask.all())
    assert torch.isfinite(condition).all()

    text_condition, text_mask = encoder.encode(INSTRUCTION, None)
    marker_tokens = len(processor.tokenizer(NO_PROMPT_AUDIO)["input_ids"])
    # audio item = bos + 92 audio tokens + eos, replacing the no-audio marker
    assert condition.shape[1] - text_condition.shape[1] == 92 + 2 - marker_tokens
    assert text_mask.shape == (1, text_condition.shape[1])

    again, _ = encoder.encode(INSTRUCTION, audio)
    assert torch.equal(condition, again)
    other_clip, _ = encoder.encode(INSTRUCTION, clip(3.7, seed=5))
    assert not torch.allclose(condition, other_clip)


def test_last_hidden_state_is_the_final_normed_last_layer(encoder, processor):
    captured = {}

    def grab(module, args, output):
        captured["last_layer"] = output[0] if isinstance(output, tuple) else output

    handle = encoder.trunk.model.layers[-1].register_forward_hook(grab)
    try:
        with torch.inference_mode():
            hidden = encoder.trunk(**processor(INSTRUCTION, clip(1.0)))
    finally:
        handle.remove()
    assert len(hidden) == TINY_LAYERS + 1
    pre_norm = captured["last_layer"]
    assert not torch.allclose(hidden[-1], pre_norm)
    with torch.inference_mode():
        torch.testing.assert_close(hidden[-1], encoder.trunk.model.norm(pre_norm), rtol=0, atol=0)


@pytest.fixture(scope="module")
def reference_thinker(snapshot):
    """transformers' whole thinker (vision tower and LM head included), fp32: what upstream runs."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        snapshot, attn_implementation="sdpa", torch_dtype=torch.float32
    ).eval()


def test_trunk_matches_the_transformers_thinker_forward(encoder, processor, reference_thinker):
    """The trunk (no vision tower, own audio merge and positions) reproduces the full thinker's hidden states."""
    reference = reference_thinker
    for audio in (clip(3.7), None):
        batch = processor(INSTRUCTION, audio)
        with torch.inference_mode():
            expected = reference(**batch, output_hidden_states=True).hidden_states
            hidden = encoder.trunk(**batch)
        assert len(hidden) == len(expected) == TINY_LAYERS + 1
        for ours, theirs in zip(hidden, expected):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_stay_close_and_fuse_in_fp32(encoder, snapshot, fusion):
    fast = ThinkerEncoder.load(snapshot, *fusion, device="cpu", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in fast.trunk.parameters())
    audio = clip(1.0)
    exact, _ = encoder.encode(INSTRUCTION, audio)
    approx, _ = fast.encode(INSTRUCTION, audio)
    assert approx.dtype == torch.float32 and approx.shape == exact.shape
    cosine = torch.nn.functional.cosine_similarity(approx.flatten(), exact.flatten(), dim=0)
    assert cosine > 0.99


def test_written_out_layers_give_the_transformers_thinker_condition(encoder, processor, fusion, reference_thinker):
    """encode (the written-out decoder layers with the fusion folded in) against the fusion of the full
    transformers thinker's hidden states, text-only and with a clip."""
    assert encoder.fallback is None, "the tiny thinker is a config the written-out layers cover"
    for audio in (clip(3.7), None):
        with torch.inference_mode():
            hidden = reference_thinker(**processor(INSTRUCTION, audio), output_hidden_states=True).hidden_states
            expected = fuse_hidden_states(hidden, *fusion)
            condition, _ = encoder.encode(INSTRUCTION, audio)
        torch.testing.assert_close(condition, expected, rtol=1e-5, atol=1e-5)


def test_fused_linears_compute_each_projection_and_hold_its_weights_once():
    """Projections of one input (widths 5, 3, 2; the middle one without a bias) stacked into one product: its
    output splits into the three projections' outputs, and each module's weight and bias are now views of the
    stacked ones, so its state dict and its own forward are what they were."""
    torch.manual_seed(0)
    projections = [torch.nn.Linear(8, 5), torch.nn.Linear(8, 3, bias=False), torch.nn.Linear(8, 2)]
    states = [{k: v.clone() for k, v in p.state_dict().items()} for p in projections]
    x = torch.randn(4, 8)
    with torch.inference_mode():
        expected = [p(x) for p in projections]
        fused = fuse_linears(projections)
        parts = fused(x).split([5, 3, 2], dim=-1)
        for proj, state, part, before in zip(projections, states, parts, expected):
            torch.testing.assert_close(part, before, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(proj(x), before, rtol=0, atol=0)
            assert proj.state_dict().keys() == state.keys()
            for key, value in proj.state_dict().items():
                assert torch.equal(value, state[key]), key
            assert proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    torch.testing.assert_close(fused.bias[5:8], torch.zeros(3))  # the missing bias adds nothing
    no_bias = fuse_linears([torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4, bias=False)])
    assert no_bias.bias is None and no_bias.weight.shape == (8, 8)


def test_transformers_text_model_stands_in_where_the_layers_do_not_apply(encoder, processor):
    config = encoder.trunk.model.config
    assert written_out_supported(config) is None
    sliding = config.__class__.from_dict({**config.to_dict(), "layer_types": ["sliding_attention"] * TINY_LAYERS})
    assert written_out_supported(sliding) == "sliding-window layers"
    scaled = config.__class__.from_dict(
        {**config.to_dict(), "rope_parameters": {**config.rope_parameters, "rope_type": "linear", "factor": 2.0}}
    )
    assert "linear" in written_out_supported(scaled)

    written_out, _ = encoder.encode(INSTRUCTION, clip(1.0))
    encoder.fallback = "a test"
    try:
        assert not encoder.compile_layers()
        transformers_path, _ = encoder.encode(INSTRUCTION, clip(1.0))
    finally:
        encoder.fallback = None
    torch.testing.assert_close(written_out, transformers_path, rtol=1e-5, atol=1e-5)


def test_prompts_batched_in_one_pass_give_their_own_conditions(encoder):
    """conditions() right-pads prompts of different lengths into passes of max_rows: each prompt's condition is
    the one it gets alone (causal attention never lets the padding in)."""
    prompts = [("Whisper.", None), (INSTRUCTION, clip(2.3)), (INSTRUCTION * 3, None), ("Shout it.", clip(0.7))]
    embeds = [encoder.embed(instruction, audio) for instruction, audio in prompts]
    alone = [encoder.encode(instruction, audio)[0][0] for instruction, audio in prompts]
    assert len({e.shape[0] for e in embeds}) == len(prompts), "prompts of four different lengths"
    encoder.max_rows = 3  # a pass of three, then a pass of one
    try:
        together = encoder.conditions(embeds)
    finally:
        encoder.max_rows = 1
    assert [c.shape for c in together] == [a.shape for a in alone]
    for batched, single in zip(together, alone):
        torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)


def test_one_compilation_serves_every_layer_and_length(encoder):
    """The decoder layer is one function of its weights: compiled once for all layers and prompt lengths (one
    more for batches of several prompts), so the worker's start-up compiles it twice, not per layer or size."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    assert encoder.compile_layers(backend=counting_backend)  # the worker's settings, a counting backend
    compiled = encoder.layer
    d = TINY_HIDDEN
    try:
        with torch.inference_mode():
            for rows, nt in ((1, 7), (1, 19), (3, 11), (2, 5)):
                embeds = torch.randn(rows, nt, d)
                encoder.layer = thinker_layer
                expected = encoder.fuse(embeds)
                encoder.layer = compiled
                torch.testing.assert_close(encoder.fuse(embeds), expected, rtol=1e-5, atol=1e-5)
    finally:
        encoder.layer = thinker_layer
        torch._dynamo.reset()
    assert len(graphs) == 2, f"{len(graphs)} compilations"


def _save_pretrained_thinker(snapshot: Path, dst: Path, keys_with_prefix: bool) -> Path:
    """The tiny snapshot's thinker as transformers' ``save_pretrained`` writes it (config model_type
    qwen2_5_omni_thinker, keys without ``thinker.``), then the processor's files copied beside it. With
    ``keys_with_prefix`` the keys are rewritten to carry ``thinker.``, as a thinker cut out of the full checkpoint
    keeps them."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    # transformers loads the thinker from its own layout (a thinker config, keys without the prefix), then saves it
    source = dst.parent / f"{dst.name}-source"
    source.mkdir()
    config = json.loads((snapshot / "config.json").read_text())["thinker_config"]
    (source / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_5_omni_thinker"}))
    weights = load_file(snapshot / "model.safetensors")
    save_file({k.removeprefix("thinker."): v for k, v in weights.items() if k.startswith("thinker.")},
              str(source / "model.safetensors"), metadata={"format": "pt"})
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(dst)
    assert json.loads((dst / "config.json").read_text())["model_type"] == "qwen2_5_omni_thinker"
    if keys_with_prefix:
        _rewrite_weights(dst, lambda t: t.update({f"thinker.{k}": t.pop(k) for k in list(t)}))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "preprocessor_config.json",
                 "chat_template.json"):
        shutil.copy(snapshot / name, dst / name)
    return dst


@pytest.mark.parametrize("keys_with_prefix", [False, True], ids=["keys-bare", "keys-prefixed"])
def test_a_thinker_saved_by_transformers_loads_as_the_release_does(encoder, snapshot, fusion, tmp_path,
                                                                    keys_with_prefix):
    saved = _save_pretrained_thinker(snapshot, tmp_path / "saved", keys_with_prefix)
    loaded = ThinkerEncoder.load(saved, *fusion, device="cpu", dtype=torch.float32)
    reference = encoder.trunk.state_dict()
    other = loaded.trunk.state_dict()
    assert other.keys() == reference.keys()
    assert all(torch.equal(other[k], reference[k]) for k in reference)
    audio = clip(1.3)
    assert torch.equal(loaded.encode(INSTRUCTION, audio)[0], encoder.encode(INSTRUCTION, audio)[0])


def test_a_thinker_saved_without_its_processor_files_is_refused_with_what_to_do(snapshot, tmp_path):
    saved = _save_pretrained_thinker(snapshot, tmp_path / "saved", keys_with_prefix=False)
    for name in ("tokenizer.json", "vocab.json", "preprocessor_config.json"):
        (saved / name).unlink()
    with pytest.raises(CheckpointError, match=r"no preprocessor_config\.json and no tokenizer.*Qwen2_5OmniProcessor"):
        PromptProcessor.from_pretrained(saved)


def test_a_thinker_whose_keys_mix_both_forms_is_refused(snapshot, fusion, tmp_path):
    saved = _save_pretrained_thinker(snapshot, tmp_path / "saved", keys_with_prefix=False)
    _rewrite_weights(saved, lambda t: t.update({"thinker.model.norm.weight": t.pop("model.norm.weight")}))
    with pytest.raises(CheckpointError, match=r"mix 'thinker\.model\.norm\.weight'.*save_pretrained"):
        ThinkerEncoder.load(saved, *fusion, device="cpu", dtype=torch.float32)
