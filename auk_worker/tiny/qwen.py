"""Writes a tiny, complete, offline Qwen2.5-Omni snapshot for tests.

Same layout as the release snapshot (``config.json`` with a ``thinker_config``, ``model.safetensors`` or shards
with an index, a byte-level BPE tokenizer with Qwen's special tokens, the Whisper ``preprocessor_config.json`` and
``chat_template.json``), at sizes that run a forward on CPU in milliseconds: text hidden 64, 4 layers, 4 query /
2 key-value heads; audio tower d_model 32, 2 layers, 128 mel bins, n_window 100. The weights are random and
deterministic for a seed. The snapshot also holds a few ``thinker.visual.*``, ``thinker.lm_head.*``, ``talker.*``
and ``token2wav.*`` tensors, like the real one, so that loaders meet every key family the release has.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from torch import Tensor

from auk_worker.model.thinker.prompt import read_thinker_config
from auk_worker.model.thinker.trunk import ThinkerTrunk

TEXT_HIDDEN = 64
AUDIO_D_MODEL = 32

# Byte-level BPE: the 256 byte symbols, these merges, then Qwen's special tokens in their release order.
MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("r", "e"),
    ("Ġ", "s"), ("a", "n"), ("e", "n"), ("o", "u"), ("Ġ", "w"), ("i", "t"), ("Ġ", "c"), ("u", "s"),
    ("us", "er"), ("i", "s"), ("a", "s"), ("s", "t"), ("Ġ", "o"), ("Ġ", "f"), ("a", "r"), ("l", "e"),
]  # fmt: skip
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>",
    "<|IMAGE|>", "<|VIDEO|>",
]  # fmt: skip
VOCAB_SIZE = 320  # the embedding is larger than the tokenizer, as in the release (151936 vs 151665)

# The Qwen2.5-Omni chat template (release chat_template.json), kept verbatim because tests render against it.
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio {{ audio_count.value }}: "
    "{% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Whisper front end of the release (preprocessor_config.json): 128 mels, 10 ms hop, a 300 s window.
PREPROCESSOR_CONFIG = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "processor_class": "Qwen2_5OmniProcessor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 300,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "dither": 0.0,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "merge_size": 2,
    "patch_size": 14,
    "temporal_patch_size": 2,
}


def byte_symbols() -> list[str]:
    """GPT-2 byte-level alphabet in byte order: printable bytes stand for themselves, the rest shift past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def tiny_vocab() -> tuple[dict[str, int], dict[str, int]]:
    """(BPE vocab, special token ids)."""
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    specials = {token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)}
    return vocab, specials


def tiny_config(specials: dict[str, int]) -> dict:
    """A release-shaped Qwen2.5-Omni config.json (talker/token2wav sections left to their defaults)."""
    return {
        "architectures": ["Qwen2_5OmniModel"],
        "model_type": "qwen2_5_omni",
        "enable_audio_output": True,
        "thinker_config": {
            "model_type": "qwen2_5_omni_thinker",
            "architectures": ["Qwen2_5OmniThinkerForConditionalGeneration"],
            "audio_token_index": specials["<|AUDIO|>"],
            "image_token_index": specials["<|IMAGE|>"],
            "video_token_index": specials["<|VIDEO|>"],
            "audio_start_token_id": specials["<|audio_bos|>"],
            "audio_end_token_id": specials["<|audio_eos|>"],
            "vision_start_token_id": specials["<|vision_bos|>"],
            "vision_end_token_id": specials["<|vision_eos|>"],
            "vision_token_id": specials["<|vision_pad|>"],
            "bos_token_id": specials["<|endoftext|>"],
            "eos_token_id": specials["<|im_end|>"],
            "pad_token_id": specials["<|endoftext|>"],
            "user_token_id": tiny_vocab()[0]["user"],
            "position_id_per_seconds": 25,
            "seconds_per_chunk": 2,
            "initializer_range": 0.02,
            "audio_config": {
                "model_type": "qwen2_5_omni_audio_encoder",
                "d_model": AUDIO_D_MODEL,
                "encoder_layers": 2,
                "encoder_attention_heads": 4,
                "encoder_ffn_dim": 64,
                "num_mel_bins": 128,
                "n_window": 100,
                "max_source_positions": 1500,
                "output_dim": TEXT_HIDDEN,
                "activation_function": "gelu",
                "scale_embedding": False,
                "dropout": 0.0,
                "attention_dropout": 0.0,
                "activation_dropout": 0.0,
            },
            "text_config": {
                "model_type": "qwen2_5_omni_text",
                "hidden_size": TEXT_HIDDEN,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_act": "silu",
                "vocab_size": VOCAB_SIZE,
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                # head_dim 16: the three M-RoPE sections split its 8 frequencies (release: 16/24/24 of 64).
                "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
                "use_sliding_window": False,
                "sliding_window": 32768,
                "max_window_layers": 4,
                "tie_word_embeddings": False,
                "attention_dropout": 0.0,
            },
            "vision_config": {
                "model_type": "qwen2_5_omni_vision_encoder",
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_heads": 2,
                "in_channels": 3,
                "out_hidden_size": TEXT_HIDDEN,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 112,
                "fullatt_block_indexes": [0],
            },
        },
    }


def write_tokenizer(out_dir: Path, vocab: dict[str, int], specials: dict[str, int]) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tokenizer.token_to_id("<|AUDIO|>") != specials["<|AUDIO|>"]:
        raise AssertionError("special token ids do not follow the BPE vocab")
    tokenizer.save(str(out_dir / "tokenizer.json"))

    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    merges = "#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in MERGES)
    (out_dir / "merges.txt").write_text(merges)
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    added = {str(i): {"content": t, **flags} for t, i in specials.items()}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 32768,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        "extra_special_tokens": {
            "image_token": "<|IMAGE|>",
            "audio_token": "<|AUDIO|>",
            "video_token": "<|VIDEO|>",
            "vision_bos_token": "<|vision_bos|>",
            "vision_eos_token": "<|vision_eos|>",
            "audio_bos_token": "<|audio_bos|>",
            "audio_eos_token": "<|audio_eos|>",
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2))


def random_thinker_weights(out_dir: Path, seed: int) -> dict[str, Tensor]:
    """Every trunk tensor under its snapshot name, drawn from one seeded generator in sorted-name order."""
    generator = torch.Generator().manual_seed(seed)
    trunk = ThinkerTrunk(read_thinker_config(out_dir))
    weights = {}
    for name, tensor in sorted(trunk.state_dict().items()):
        noise = torch.randn(tensor.shape, generator=generator)
        if tensor.ndim == 1 and name.endswith("weight"):  # RMSNorm / LayerNorm gains
            value = 1.0 + 0.1 * noise
        elif tensor.ndim == 1:  # biases
            value = 0.02 * noise
        else:  # projections, convolutions, embeddings
            value = 0.05 * noise
        weights["thinker." + name] = value.contiguous()
    return weights


def ignored_family_tensors(seed: int) -> dict[str, Tensor]:
    """One or two tensors per key family a loader must skip (shapes only loosely release-like)."""
    generator = torch.Generator().manual_seed(seed + 1)
    shapes = {
        "thinker.visual.patch_embed.proj.weight": (16, 3, 2, 14, 14),
        "thinker.visual.merger.ln_q.weight": (16,),
        "thinker.lm_head.weight": (VOCAB_SIZE, TEXT_HIDDEN),
        "talker.model.embed_tokens.weight": (16, 8),
        "token2wav.code2wav_bigvgan_model.conv_pre.weight": (8, 4, 3),
    }
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def write_tiny_qwen(out_dir: Path, seed: int = 0, num_shards: int = 1) -> None:
    """Write the tiny snapshot into ``out_dir`` (created if needed). ``num_shards`` > 1 writes an index."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, specials = tiny_vocab()
    (out_dir / "config.json").write_text(json.dumps(tiny_config(specials), indent=2))
    (out_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    write_tokenizer(out_dir, vocab, specials)

    tensors = {**random_thinker_weights(out_dir, seed), **ignored_family_tensors(seed)}
    if num_shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for shard in range(num_shards):
        filename = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::num_shards]}
        save_file(part, str(out_dir / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
