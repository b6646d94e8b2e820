"""Stage 0: the instruction/audio encoder (frozen Qwen2.5-Omni thinker + learned layer fusion).

AuK conditions its DiT on the hidden states of the Qwen2.5-Omni-3B thinker. One forward runs the prompt (a
default system turn, the user's instruction, then either the reference clip as audio tokens or the literal
marker ``|<no_prompt_audio>|``) through the thinker's audio tower and text model; the 36 layer outputs are
layer-normed and mixed with the checkpoint's own softmax weights and scale (ELMo-style fusion).

What this file owns, top to bottom:
- ``render_prompt``: the chat-template string the processor would produce, written out by hand.
- ``PromptProcessor``: tokenizer + Whisper log-mel features, expanding ``<|AUDIO|>`` to one token per audio
  embedding, without the image/video processors (and so without torchvision).
- ``fuse_hidden_states``: the fusion, always in fp32.
- ``ThinkerTrunk``: the thinker's text model and audio tower only; no vision tower, no LM head.
- ``thinker_layer``: one decoder layer written out, with the fusion of the hidden state it reads; the encoder's
  path through the text model (one compilable function for every layer, right-padded prompts in a batch).
- ``ThinkerEncoder``: strict loading from a Qwen2.5-Omni snapshot, ``embed``, ``conditions`` and ``encode``.

Shapes: b prompts in a batch, nt prompt tokens (audio placeholders included), na audio tokens,
m mel bins (128), f mel frames, d thinker hidden size (2048 at release), k fused layers (36 at release).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from auk_worker.errors import AudioError, CheckpointError, ConfigError, InputError, ModelError

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a helpful assistant."
NO_PROMPT_AUDIO = "|<no_prompt_audio>|"
AUDIO_PLACEHOLDER = "<|AUDIO|>"
AUDIO_ITEM = "<|audio_bos|>" + AUDIO_PLACEHOLDER + "<|audio_eos|>"
SAMPLE_RATE = 16_000
FUSION_LN_EPS = 1e-5

# Snapshot keys the encoder never loads, each with its cause. Anything else must be a `thinker.` key that the
# trunk expects; a bare-thinker snapshot (keys without `thinker.`) is read as if every key carried the prefix.
IGNORED_KEY_PREFIXES: dict[str, str] = {
    "thinker.visual.": "vision tower: AuK conditions on text and audio only (upstream sets thinker.visual = None)",
    "thinker.lm_head.": "LM head: the encoder reads hidden states and never computes logits",
    "talker.": "Qwen2.5-Omni speech-output talker, not part of the thinker",
    "token2wav.": "Qwen2.5-Omni speech-output vocoder, not part of the thinker",
}
THINKER_PREFIX = "thinker."


# ---------------------------------------------------------------------------------------------------------------
# Prompt


def render_prompt(instruction: str, has_audio: bool) -> str:
    """The string ``apply_chat_template(..., add_generation_prompt=True)`` renders for AuK's single user turn.

    The Qwen2.5-Omni template injects the default system turn, then concatenates the user's content items with
    nothing between them: the text item, then the audio item (or, without audio, the no-audio marker that
    upstream appends to the instruction text).
    """
    audio_part = AUDIO_ITEM if has_audio else NO_PROMPT_AUDIO
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{instruction}{audio_part}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def audio_token_count(num_frames: int) -> int:
    """Audio tokens for ``num_frames`` mel frames: conv2 (stride 2, pad 1) then an average pool of 2."""
    after_conv = (num_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


# ---------------------------------------------------------------------------------------------------------------
# Config


def read_thinker_config(qwen_dir: Path):
    """The thinker's transformers config from a snapshot's config.json (full Qwen2.5-Omni or a bare thinker)."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig

    path = Path(qwen_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"Qwen snapshot {qwen_dir} has no config.json")
    raw = json.loads(path.read_text())
    model_type = raw.get("model_type")
    if model_type == "qwen2_5_omni":
        if "thinker_config" not in raw:
            raise CheckpointError(f"{path}: a qwen2_5_omni config without thinker_config")
        # Only the thinker section: building the talker/token2wav configs would only log warnings.
        return Qwen2_5OmniThinkerConfig.from_dict(raw["thinker_config"])
    if model_type == "qwen2_5_omni_thinker":
        return Qwen2_5OmniThinkerConfig.from_dict(raw)
    raise CheckpointError(f"{path}: model_type {model_type!r} is not qwen2_5_omni or qwen2_5_omni_thinker")


def _is_full_omni_snapshot(qwen_dir: Path) -> bool:
    return json.loads((Path(qwen_dir) / "config.json").read_text()).get("model_type") == "qwen2_5_omni"


@dataclass(frozen=True)
class ThinkerSpec:
    """The few thinker dimensions the encoder checks against; read from the snapshot's own config."""

    hidden_size: int
    num_layers: int
    audio_token_id: int
    num_mel_bins: int

    @classmethod
    def from_config(cls, thinker_config) -> ThinkerSpec:
        return cls(
            hidden_size=thinker_config.text_config.hidden_size,
            num_layers=thinker_config.text_config.num_hidden_layers,
            audio_token_id=thinker_config.audio_token_index,
            num_mel_bins=thinker_config.audio_config.num_mel_bins,
        )


# ---------------------------------------------------------------------------------------------------------------
# Processor (tokenizer + Whisper features; no image or video processor)


def _check_audio(audio: np.ndarray) -> np.ndarray:
    audio = np.asarray(audio)
    if audio.ndim != 1 or audio.size == 0:
        raise AudioError(f"prompt audio must be a non-empty mono 16 kHz array, got shape {audio.shape}")
    if not np.issubdtype(audio.dtype, np.floating):
        raise AudioError(f"prompt audio must be floating point, got {audio.dtype}")
    if not np.isfinite(audio).all():
        raise AudioError("prompt audio contains NaN or infinite samples")
    return audio.astype(np.float32, copy=False)


class PromptProcessor:
    """Turns (instruction, 16 kHz clip or None) into the thinker's inputs, as Qwen2_5OmniProcessor would.

    The log-mel features are the Whisper feature extractor's, as the processor calls it (sampling_rate 16000,
    padding "max_length", truncation, attention mask), computed here with the same torch operations (its STFT,
    mel filters, log floor and scaling) on any device, so that on a GPU the host only copies the samples over.
    The padding stops a little past the clip instead of at the extractor's full window (300 s for Qwen2.5-Omni):
    every frame whose STFT window touches the clip is computed from the same samples either way and the log-mel
    floor is the same, so the valid frames are the processor's; only the all-padding frames that the thinker
    discards are not computed.
    """

    def __init__(self, tokenizer, feature_extractor, audio_token_id: int) -> None:
        placeholder = tokenizer.convert_ids_to_tokens(audio_token_id)
        if placeholder != AUDIO_PLACEHOLDER:
            raise CheckpointError(
                f"thinker audio_token_index {audio_token_id} is {placeholder!r} in the tokenizer, "
                f"expected {AUDIO_PLACEHOLDER!r}"
            )
        if feature_extractor.sampling_rate != SAMPLE_RATE:
            raise CheckpointError(f"feature extractor expects {feature_extractor.sampling_rate} Hz, not {SAMPLE_RATE}")
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.audio_token_id = audio_token_id
        self._stft_tables: dict[torch.device, tuple[Tensor, Tensor]] = {}  # device -> (window, mel filters)
        self.log_mel_graphs = None  # set by the GPU fast path: replays `log_mel` from CUDA graphs (accel.LogMelGraphs)
        # Chat markers and multimodal placeholders: inside an instruction they would change the prompt's layout.
        self.reserved_tokens = tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)

    @classmethod
    def from_pretrained(cls, qwen_dir: Path) -> PromptProcessor:
        from transformers import Qwen2TokenizerFast, WhisperFeatureExtractor

        qwen_dir = Path(qwen_dir)
        if not (qwen_dir / "preprocessor_config.json").is_file():
            raise CheckpointError(f"Qwen snapshot {qwen_dir} has no preprocessor_config.json")
        spec = ThinkerSpec.from_config(read_thinker_config(qwen_dir))
        # The Qwen2 tokenizer class directly: AutoTokenizer would parse the whole Omni config.json, whose talker
        # section makes transformers log token-id warnings that have nothing to do with the thinker.
        tokenizer = Qwen2TokenizerFast.from_pretrained(qwen_dir, local_files_only=True)
        feature_extractor = WhisperFeatureExtractor.from_pretrained(qwen_dir, local_files_only=True)
        if feature_extractor.feature_size != spec.num_mel_bins:
            raise CheckpointError(
                f"feature extractor makes {feature_extractor.feature_size} mel bins, "
                f"the audio tower takes {spec.num_mel_bins}"
            )
        return cls(tokenizer, feature_extractor, spec.audio_token_id)

    def __call__(
        self,
        instruction: str,
        audio_16k: np.ndarray | None,
        device: torch.device | str = "cpu",
        input_ids: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The thinker's inputs: ``input_ids`` and ``attention_mask`` on the host, and with a clip its
        ``input_features`` on ``device`` and their ``feature_attention_mask`` on the host. ``input_ids``: the
        prompt's tokens where the caller made them ahead (the method below); without them the clip's features are
        launched first, so that the GPU computes them while the host tokenizes."""
        self._check_instruction(instruction)
        batch: dict[str, Tensor] = {}
        if audio_16k is not None:
            features, feature_mask = self.audio_features(audio_16k, device)
            batch.update(input_features=features, feature_attention_mask=feature_mask)
        if input_ids is None:
            input_ids = self.input_ids(instruction, None if audio_16k is None else len(audio_16k))
        batch.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        return batch

    def input_ids(self, instruction: str, clip_samples: int | None) -> Tensor:
        """The prompt's token ids [1, nt] on the host, for a clip of ``clip_samples`` at 16 kHz (None: no clip).
        The clip's length alone sets its audio token count, so a render tokenizes while the clip is resampled.

        These are the ids of the prompt with its audio placeholder repeated once per audio token, made a faster
        way, in about a quarter of the time: the tokenizer's backend (the ids of calling the tokenizer, without its
        Python wrapping) encodes the prompt with one placeholder, and that id is then repeated. The placeholder is
        an added token, which the tokenizer splits out of the text before anything else, so n of them give n ids
        in its place and leave the text around them as it is."""
        self._check_instruction(instruction)
        ids = self.tokenizer.backend_tokenizer.encode(render_prompt(instruction, clip_samples is not None)).ids
        if clip_samples is not None:
            at = ids.index(self.audio_token_id)
            ids[at : at + 1] = [self.audio_token_id] * audio_token_count(self.audio_frames(clip_samples))
        return torch.tensor([ids], dtype=torch.long)

    def _check_instruction(self, instruction: str) -> None:
        for token in self.reserved_tokens:
            if token in instruction:
                raise InputError(f"instruction contains the reserved token {token!r}")

    def audio_frames(self, clip_samples: int) -> int:
        """The mel frames the extractor's attention mask keeps for a clip: one per hop begun, of at most the
        extractor's window."""
        extractor = self.feature_extractor
        return -(-min(clip_samples, extractor.n_samples) // extractor.hop_length)

    def audio_features(self, audio_16k: np.ndarray, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """Log-mel features of the clip's frames, [1, m, f] on ``device``, and their (all-ones) mask, [1, f] on
        the host."""
        audio = _check_audio(audio_16k)
        extractor = self.feature_extractor
        hop, n_fft = extractor.hop_length, extractor.n_fft
        if audio.size > extractor.n_samples:
            logger.warning(
                "prompt audio: %.1f s truncated to the extractor's %.1f s",
                audio.size / SAMPLE_RATE,
                extractor.n_samples / SAMPLE_RATE,
            )
            audio = audio[: extractor.n_samples]
        # n_fft samples of silence past the clip cover every window that touches it (see the class docstring).
        padded = min(extractor.n_samples, -(-(audio.size + n_fft) // hop) * hop)
        frames = self.audio_frames(audio.size)
        device = torch.device(device)
        if self.log_mel_graphs is not None and device == self.log_mel_graphs.device:
            log_mel = self.log_mel_graphs.log_mel(audio, padded)  # [m, >= padded / hop]
        else:
            wave = torch.zeros(padded, dtype=torch.float32, device=device)
            wave[: audio.size].copy_(torch.from_numpy(audio), non_blocking=True)
            log_mel = self.log_mel(wave)
        return log_mel[None, :, :frames], torch.ones(1, frames, dtype=torch.int32)

    def log_mel(self, wave: Tensor) -> Tensor:
        """The extractor's normalised log-mel spectrogram of a zero-padded clip: [s] -> [m, s / hop], s a multiple
        of the hop. More silence past the padding adds frames and changes none: silent frames sit at the log floor
        of 1e-10, under the clip's peak, which sets the floor they are raised to."""
        n_fft, hop = self.feature_extractor.n_fft, self.feature_extractor.hop_length
        if wave.device not in self._stft_tables:
            filters = np.asarray(self.feature_extractor.mel_filters, dtype=np.float32)  # [n_fft / 2 + 1, m]
            self._stft_tables[wave.device] = (
                torch.hann_window(n_fft, device=wave.device),
                torch.from_numpy(filters).T.contiguous().to(wave.device),
            )
        window, mel_filters = self._stft_tables[wave.device]
        stft = torch.stft(wave, n_fft, hop, window=window, return_complex=True)  # [n_fft / 2 + 1, s / hop + 1]
        power = (stft[..., :-1].abs() ** 2).contiguous()  # the last frame is dropped, as the extractor drops it
        log_spec = torch.clamp(mel_filters @ power, min=1e-10).log10()  # [m, s / hop]
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)  # the floor: 80 dB under the clip's peak
        return (log_spec + 4.0) / 4.0


# ---------------------------------------------------------------------------------------------------------------
# Fusion


def fuse_hidden_states(hidden_states: Sequence[Tensor], layer_weights: Tensor, layer_scale: Tensor) -> Tensor:
    """ELMo-style fusion: layer_scale * sum_i softmax(layer_weights)_i * LN(h_i) over the layer outputs.

    ``hidden_states`` is the thinker's tuple (embeddings first, final-normed last layer last); the embeddings are
    dropped. LN has no affine and eps 1e-5. Computed in fp32 whatever the thinker's dtype; returns [b, nt, d] fp32.
    """
    layers = hidden_states[1:]
    if len(layers) != layer_weights.numel():
        raise ModelError(
            f"thinker returned {len(hidden_states)} hidden states, fusion expects "
            f"{layer_weights.numel()} layers plus the embeddings"
        )
    weights = torch.softmax(layer_weights.float().flatten(), dim=0)  # [k]
    fused = torch.zeros(layers[0].shape, dtype=torch.float32, device=layers[0].device)  # [b, nt, d]
    for weight, hidden in zip(weights, layers):
        fused += weight * F.layer_norm(hidden.float(), (hidden.shape[-1],), eps=FUSION_LN_EPS)
    return fused * layer_scale.float().reshape(())


# ---------------------------------------------------------------------------------------------------------------
# Thinker without its vision tower and LM head


class ThinkerTrunk(nn.Module):
    """The thinker's text model (``model``) and audio tower (``audio_tower``); state-dict keys are the snapshot's
    ``thinker.*`` keys without the prefix. Its forward mirrors the thinker's for text and audio inputs."""

    def __init__(self, thinker_config) -> None:
        super().__init__()
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniAudioEncoder,
            Qwen2_5OmniThinkerTextModel,
        )

        # sdpa is the default backend of the upstream-validated stack and runs on CPU as well as CUDA.
        self.model = Qwen2_5OmniThinkerTextModel._from_config(thinker_config.text_config, attn_implementation="sdpa")
        self.audio_tower = Qwen2_5OmniAudioEncoder._from_config(thinker_config.audio_config, attn_implementation="sdpa")
        self.audio_token_id = thinker_config.audio_token_index
        # Set by the GPU fast path: an AudioTowerGraphs (audio_tower.py), the same math in fixed-shape chunks.
        self.audio_runner = None

    def rebuild_computed_buffers(self, device: torch.device) -> None:
        """Recreate the parameter-free modules whose buffers are computed at init rather than stored in the
        checkpoint (rotary inverse frequencies, the audio tower's sinusoids), e.g. after building on meta."""
        rotary = type(self.model.rotary_emb)
        for parent in list(self.modules()):  # transformers 4.x also gives each attention layer its own copy
            for name, child in list(parent.named_children()):
                if isinstance(child, rotary):
                    setattr(parent, name, rotary(config=child.config).to(device))
        sinusoids = type(self.audio_tower.positional_embedding)
        audio = self.audio_tower.config
        self.audio_tower.positional_embedding = sinusoids(audio.max_source_positions, audio.d_model).to(device)

    def embed_audio(self, input_features: Tensor, feature_attention_mask: Tensor) -> Tensor:
        """Audio tower over the valid frames of each clip: [b, m, f] -> [na, d]."""
        if self.audio_runner is not None and input_features.shape[0] == 1 and feature_attention_mask.ndim == 2:
            return self.audio_runner(input_features, feature_attention_mask)
        device = self.audio_tower.conv1.weight.device
        input_features, feature_attention_mask = input_features.to(device), feature_attention_mask.to(device)
        frames = feature_attention_mask.sum(-1)  # [b]
        valid = input_features.permute(0, 2, 1)[feature_attention_mask.bool()].permute(1, 0)  # [m, sum f]
        after_conv = (frames - 1) // 2 + 1  # [b]
        dtype = self.audio_tower.conv1.weight.dtype
        return self.audio_tower(valid.to(dtype), feature_lens=frames, aftercnn_lens=after_conv).last_hidden_state

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        input_features: Tensor | None = None,
        feature_attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        """All hidden states of the text model: the embeddings, then each layer's output, the last final-normed.

        One unpadded prompt at a time: ``attention_mask`` (the processor's, all ones) is accepted and checked."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ModelError("the thinker trunk encodes one unpadded prompt; got a padded attention mask")
        return self.text_hidden_states(self.embed(input_ids, input_features, feature_attention_mask))

    def embed(
        self, input_ids: Tensor, input_features: Tensor | None = None, feature_attention_mask: Tensor | None = None
    ) -> Tensor:
        """Token embeddings with the audio tower's outputs at the audio placeholder positions: [b, nt, d].

        The inputs may stay on the host, as the processor makes them: they are read there (the audio-token count
        is checked against the tower's output) and copied over without waiting for the GPU."""
        device = self.model.embed_tokens.weight.device
        embeds = self.model.embed_tokens(input_ids.to(device, non_blocking=True))  # [b, nt, d]
        if input_features is not None:
            audio = self.embed_audio(input_features, feature_attention_mask)  # [na, d]
            slots = input_ids == self.audio_token_id  # [b, nt]
            if int(slots.sum()) != audio.shape[0]:
                raise ModelError(f"prompt has {int(slots.sum())} audio tokens, the audio tower made {audio.shape[0]}")
            slots = slots.to(device, non_blocking=True)
            embeds = embeds.masked_scatter(slots.unsqueeze(-1), audio.to(embeds.dtype))
        return embeds

    def text_hidden_states(self, embeds: Tensor) -> tuple[Tensor, ...]:
        """The text model over embeddings of one unpadded prompt (or one right-padded: attention is causal)."""
        # Without images or video, M-RoPE's three sections share one index: plain positions 0..nt-1.
        b, nt = embeds.shape[:2]
        positions = torch.arange(nt, device=embeds.device).expand(3, b, nt)  # [3, b, nt]
        out = self.model(
            inputs_embeds=embeds,
            position_ids=positions,
            use_cache=False,
            output_hidden_states=True,
            return_dict=True,
        )
        return tuple(out.hidden_states)


# ---------------------------------------------------------------------------------------------------------------
# The text model, one decoder layer at a time


def written_out_supported(text_config) -> str | None:
    """Why the written-out layers cannot stand in for transformers' text model under this config (None: they can).

    They cover what Qwen2.5-Omni's thinker uses: full causal attention in every layer and the default rotary
    frequencies with M-RoPE sections that all read one position index (text and audio, no images or video)."""
    if any(kind != "full_attention" for kind in getattr(text_config, "layer_types", None) or ()):
        return "sliding-window layers"
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope.get('rope_type')!r}"
    return None


def rotary_tables(rotary: nn.Module, nt: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [nt, dh] for positions 0..nt-1, as the model's rotary module makes them: fp32 angles, then the
    model's dtype. M-RoPE's sections all read the same index here, so its recomposition is the identity."""
    positions = torch.arange(nt, device=rotary.inv_freq.device, dtype=torch.float32)
    angles = positions[:, None] * rotary.inv_freq.float()[None, :]  # [nt, dh / 2]
    angles = torch.cat((angles, angles), dim=-1)
    scaling = rotary.attention_scaling
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def _rms_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """Qwen's RMSNorm with its rounding: normalised in fp32, back to x's dtype, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [b, heads, nt, dh]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def fuse_linears(projections: Sequence[nn.Linear]) -> nn.Linear:
    """Linears that read the same input as one product: their weights stacked along the output ([sum o_i, i]),
    a missing bias as zeros (no bias at all where none has one). Each module's weight and bias become views of the
    stacked ones, so the weights are held once and the state dict is unchanged; call this once the weights are
    final (a later ``.to`` would copy them apart). The outputs split back by the modules' widths."""
    weight = torch.cat([proj.weight.detach() for proj in projections])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if any(proj.bias is not None for proj in projections):
        bias = torch.cat([
            torch.zeros_like(proj.weight[:, 0]) if proj.bias is None else proj.bias.detach() for proj in projections
        ])
        fused.bias = nn.Parameter(bias, requires_grad=False)
    start = 0
    for proj in projections:
        end = start + proj.weight.shape[0]
        proj.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if proj.bias is not None:
            proj.bias = nn.Parameter(fused.bias[start:end], requires_grad=False)
        start = end
    return fused


@dataclass(frozen=True)
class LayerProducts:
    """A decoder layer's projections that read the same input, each group as one product (``fuse_linears``): q, k
    and v after the first norm, the feed-forward's gate and up after the second."""

    qkv: nn.Linear
    gate_up: nn.Linear

    @classmethod
    def of(cls, layer: nn.Module) -> LayerProducts:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]), fuse_linears([mlp.gate_proj, mlp.up_proj]))


def thinker_layer(
    layer: nn.Module,
    qkv: nn.Linear,
    gate_up: nn.Linear,
    h: Tensor,
    fused: Tensor,
    weight: Tensor,
    cos: Tensor,
    sin: Tensor,
) -> tuple[Tensor, Tensor]:
    """One decoder layer over right-padded prompts, h [b, nt, d] -> [b, nt, d], and the fusion of the state it
    reads: ``fused + weight * LN(h)`` in fp32 (a weight of 0 adds exactly nothing, for the embeddings).

    The arithmetic is transformers' (RMSNorm rounding, rotary in the model dtype, causal SDPA with grouped
    key-value heads); attention is causal, so padding after a prompt never reaches its positions. q, k and v come
    from one product, the gate and up projections from another (the layer's ``LayerProducts``): the same dot
    products, two launches where there were five. One function for every layer (weights are arguments, modules
    passed as such), so ``torch.compile`` builds it once for all of them."""
    attn, mlp = layer.self_attn, layer.mlp
    b, nt, _ = h.shape
    dh = attn.head_dim
    fused = fused + weight * F.layer_norm(h.float(), (h.shape[-1],), eps=FUSION_LN_EPS)
    x = _rms_norm(h, layer.input_layernorm)
    widths = (attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0])
    q, k, v = (part.view(b, nt, -1, dh).transpose(1, 2) for part in qkv(x).split(widths, dim=-1))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
    h = h + attn.o_proj(out.transpose(1, 2).reshape(b, nt, -1))
    x = _rms_norm(h, layer.post_attention_layernorm)
    gate, up = gate_up(x).chunk(2, dim=-1)
    h = h + mlp.down_proj(mlp.act_fn(gate) * up)
    return h, fused


def _snapshot_tensor_files(qwen_dir: Path) -> dict[str, Path]:
    """Map every tensor key of the snapshot to its safetensors file (sharded with an index, or single)."""
    index = qwen_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = {key: qwen_dir / name for key, name in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise CheckpointError(f"{index} names {path.name}, which is missing")
        return files
    single = qwen_dir / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as handle:
            return {key: single for key in handle.keys()}
    raise CheckpointError(f"Qwen snapshot {qwen_dir} has neither model.safetensors nor model.safetensors.index.json")


def _trunk_key(snapshot_key: str, full_snapshot: bool) -> str | None:
    """The trunk's key for a snapshot key, None for an ignored one; unknown prefixes are a CheckpointError."""
    key = snapshot_key if full_snapshot else THINKER_PREFIX + snapshot_key
    if any(key.startswith(prefix) for prefix in IGNORED_KEY_PREFIXES):
        return None
    if not key.startswith(THINKER_PREFIX):
        raise CheckpointError(f"unexpected key {snapshot_key!r} in the Qwen snapshot")
    return key[len(THINKER_PREFIX) :]


def _read_trunk_weights(
    qwen_dir: Path, expected: dict[str, Tensor], computed: set[str], device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, Tensor]]:
    """Yield (trunk key, tensor on device) for every thinker key, checking names and shapes strictly."""
    full_snapshot = _is_full_omni_snapshot(qwen_dir)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for snapshot_key, path in _snapshot_tensor_files(qwen_dir).items():
        key = _trunk_key(snapshot_key, full_snapshot)
        # A stored copy of a computed buffer (an export that kept the sinusoids, say) is skipped: transformers
        # also recomputes these at init and ignores the copy.
        if key is None or key in computed:
            continue
        if key not in expected:
            raise CheckpointError(f"unexpected key {snapshot_key!r} in the Qwen snapshot")
        by_file.setdefault(path, []).append((snapshot_key, key))
    found = {key for pairs in by_file.values() for _, key in pairs}
    missing = sorted(set(expected) - found)
    if missing:
        raise CheckpointError(f"Qwen snapshot is missing {len(missing)} thinker keys, e.g. {missing[:5]}")
    for path, pairs in by_file.items():
        with safe_open(path, framework="pt") as handle:
            for snapshot_key, key in pairs:
                tensor = handle.get_tensor(snapshot_key)
                if tuple(tensor.shape) != tuple(expected[key].shape):
                    raise CheckpointError(
                        f"{snapshot_key}: shape {tuple(tensor.shape)} in the snapshot, "
                        f"{tuple(expected[key].shape)} expected"
                    )
                target = dtype if tensor.is_floating_point() else tensor.dtype
                yield key, tensor.to(device=device, dtype=target)


def load_thinker_trunk(qwen_dir: Path, device: torch.device, dtype: torch.dtype) -> ThinkerTrunk:
    """Build the trunk on the meta device (no vision tower, no LM head) and load its weights strictly."""
    qwen_dir = Path(qwen_dir)
    config = read_thinker_config(qwen_dir)
    with torch.device("meta"):
        trunk = ThinkerTrunk(config)
    expected = trunk.state_dict()
    computed = {name for name, _ in trunk.named_buffers()} - set(expected)  # non-persistent buffers
    state = dict(_read_trunk_weights(qwen_dir, expected, computed, device, dtype))
    trunk.load_state_dict(state, strict=True, assign=True)
    trunk.rebuild_computed_buffers(device)
    still_meta = [name for name, t in [*trunk.named_parameters(), *trunk.named_buffers()] if t.is_meta]
    if still_meta:
        raise ModelError(f"thinker tensors left unmaterialised after loading: {still_meta[:5]}")
    trunk.requires_grad_(False)
    return trunk.eval()


# ---------------------------------------------------------------------------------------------------------------
# Public entry


class ThinkerEncoder:
    """Prompt -> fused thinker condition. Load once; ``encode`` per request (no state kept between calls), or
    ``embed`` each prompt and take their ``conditions`` together (one text-model pass for up to ``max_rows``)."""

    def __init__(
        self, processor: PromptProcessor, trunk: ThinkerTrunk, layer_weights: Tensor, layer_scale: Tensor
    ) -> None:
        self.processor = processor
        self.trunk = trunk
        self.device = trunk.model.embed_tokens.weight.device
        self.layer_weights = layer_weights.detach().to(self.device, torch.float32)
        self.layer_scale = layer_scale.detach().to(self.device, torch.float32)
        self.hidden_size = trunk.model.config.hidden_size
        self.graphs = None  # set by the GPU fast path: replays `fuse` from CUDA graphs at fixed prompt sizes
        self.max_rows = 1  # prompts per text-model pass: the deploy config's stage 0 max_num_seqs
        # None: the text model runs as written-out layers (thinker_layer); otherwise why transformers' own runs.
        self.fallback = written_out_supported(trunk.model.config)
        self.layer = thinker_layer  # compile_layers() swaps in its compiled form
        # The written-out layers' stacked products; the trunk's q/k/v and gate/up weights become views of them.
        self.products = [LayerProducts.of(layer) for layer in trunk.model.layers] if self.fallback is None else []
        weights = torch.softmax(self.layer_weights.flatten(), dim=0)  # [k]
        # Layer i's call fuses the state it reads (layer i-1's output, weight i-1); the embeddings get weight 0.
        self._read_weights = (torch.zeros((), device=self.device), *weights[:-1])
        self._last_weight = weights[-1]

    @classmethod
    def load(
        cls,
        qwen_dir: Path,
        layer_weights: Tensor,
        layer_scale: Tensor,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> ThinkerEncoder:
        """``dtype`` float32 is the exact recipe; bfloat16 keeps the weights in bf16 (faster). Fusion is fp32."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"thinker dtype must be float32 or bfloat16, got {dtype}")
        qwen_dir = Path(qwen_dir)
        spec = ThinkerSpec.from_config(read_thinker_config(qwen_dir))
        if tuple(layer_weights.shape) != (spec.num_layers,):
            raise CheckpointError(
                f"layer_weights has shape {tuple(layer_weights.shape)}, the thinker has {spec.num_layers} layers"
            )
        if layer_scale.numel() != 1:
            raise CheckpointError(f"layer_scale has shape {tuple(layer_scale.shape)}, expected one value")
        processor = PromptProcessor.from_pretrained(qwen_dir)
        trunk = load_thinker_trunk(qwen_dir, torch.device(device), dtype)
        logger.info(
            "thinker %s: %d layers, hidden %d, %s on %s", qwen_dir, spec.num_layers, spec.hidden_size, dtype, device
        )
        return cls(processor, trunk, layer_weights, layer_scale)

    def compile_layers(self, backend: str | Callable = "inductor") -> bool:
        """``torch.compile`` the decoder layer (one compilation serves all of them and every prompt length; one
        more for batches of several prompts). False where transformers' text model runs instead."""
        if self.fallback is not None:
            logger.info("thinker: not compiled (%s: transformers' text model runs)", self.fallback)
            return False
        self.layer = torch.compile(thinker_layer, fullgraph=True, dynamic=True, backend=backend)
        return True

    @torch.inference_mode()
    def encode(self, instruction: str, audio_16k: np.ndarray | None) -> tuple[Tensor, Tensor]:
        """One prompt: (fused condition fp32 [1, nt, d], text mask bool [1, nt])."""
        (condition,) = self.conditions([self.embed(instruction, audio_16k)])
        return condition[None], torch.ones(condition.shape[:1], dtype=torch.bool, device=self.device)[None]

    @torch.inference_mode()
    def embed(self, instruction: str, audio_16k: np.ndarray | None, input_ids: Tensor | None = None) -> Tensor:
        """The prompt's input embeddings [nt, d]: the processor (the tokenizer on the host, unless ``input_ids``
        holds the prompt's tokens already; a clip's log-mel features on the encoder's device), the audio tower,
        the token lookup. Bad input raises here, before any prompt joins a batch."""
        batch = self.processor(instruction, audio_16k, self.device, input_ids)  # features on the device, ids on host
        embeds = self.trunk.embed(batch["input_ids"], batch.get("input_features"), batch.get("feature_attention_mask"))
        return embeds[0]

    @torch.inference_mode()
    def conditions(self, embeds: Sequence[Tensor]) -> list[Tensor]:
        """Fused conditions fp32 [nt_i, d] of prompt embeddings [nt_i, d], ``max_rows`` prompts per text-model pass,
        each right-padded to the pass's longest (causal attention: the padding never reaches a prompt)."""
        conditions: list[Tensor] = []
        for start in range(0, len(embeds), self.max_rows):
            chunk = embeds[start : start + self.max_rows]
            batch = chunk[0].new_zeros(len(chunk), max(e.shape[0] for e in chunk), chunk[0].shape[-1])
            for row, prompt in enumerate(chunk):
                batch[row, : prompt.shape[0]] = prompt
            fused = self.graphs.fuse(batch) if self.graphs is not None else None  # None: too long for a graph
            if fused is None:
                fused = self.fuse(batch)
            conditions.extend(fused[row, : prompt.shape[0]] for row, prompt in enumerate(chunk))
        return conditions

    def fuse(self, embeds: Tensor) -> Tensor:
        """Embeddings [b, nt, d] -> fused condition fp32 [b, nt, d] (the text model and the layer fusion)."""
        model = self.trunk.model
        if self.fallback is not None:
            hidden_states = self.trunk.text_hidden_states(embeds)
            return fuse_hidden_states(hidden_states, self.layer_weights, self.layer_scale)
        cos, sin = rotary_tables(model.rotary_emb, embeds.shape[1], embeds.dtype)
        h, fused = embeds, torch.zeros(embeds.shape, dtype=torch.float32, device=embeds.device)
        for layer, products, weight in zip(model.layers, self.products, self._read_weights):
            h, fused = self.layer(layer, products.qkv, products.gate_up, h, fused, weight, cos, sin)
        # The last state the fusion reads is the final-normed one, as in transformers' hidden_states.
        fused = fused + self._last_weight * F.layer_norm(model.norm(h).float(), (h.shape[-1],), eps=FUSION_LN_EPS)
        return fused * self.layer_scale.reshape(())
