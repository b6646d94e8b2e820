"""Stage 0's trunk: the Qwen2.5-Omni thinker's text model and audio tower (no vision tower, no LM head), its
decoder layer written out, the ELMo-style fusion of its hidden states, and strict loading from a snapshot.

- ``fuse_hidden_states``: the fusion, always in fp32.
- ``ThinkerTrunk``: the thinker's text model and audio tower only; no vision tower, no LM head.
- ``thinker_layer``: one decoder layer written out, with the fusion of the hidden state it reads; the encoder's
  path through the text model (one compilable function for every layer, right-padded prompts in a batch).
- ``load_thinker_trunk``: built on the meta device, loaded strictly from the snapshot's safetensors.

Shapes: b prompts in a batch, nt prompt tokens, na audio tokens, m mel bins, f mel frames, d thinker hidden size
(2048 at release), k fused layers (36 at release).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from auk_worker.errors import CheckpointError, ModelError
from auk_worker.model.thinker.prompt import is_full_omni_snapshot, read_thinker_config

FUSION_LN_EPS = 1e-5


# Snapshot keys the encoder never loads, each with its cause. Anything else must be a `thinker.` key that the
# trunk expects. A bare-thinker snapshot (config model_type qwen2_5_omni_thinker) comes in two forms, both read:
# keys without `thinker.` (transformers' own save_pretrained of the thinker class writes these), read as if every
# key carried the prefix, and keys that already carry it (a thinker cut out of the full checkpoint as it is).
IGNORED_KEY_PREFIXES: dict[str, str] = {
    "thinker.visual.": "vision tower: AuK conditions on text and audio only (upstream sets thinker.visual = None)",
    "thinker.lm_head.": "LM head: the encoder reads hidden states and never computes logits",
    "talker.": "Qwen2.5-Omni speech-output talker, not part of the thinker",
    "token2wav.": "Qwen2.5-Omni speech-output vocoder, not part of the thinker",
}
THINKER_PREFIX = "thinker."


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
        # Set by the wiring: an AudioTowerGraphs (the pipeline's thinker graphs), the same math in fixed-shape chunks.
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


def _keys_carry_prefix(qwen_dir: Path, keys: Iterable[str]) -> bool:
    """Whether a bare-thinker snapshot's keys carry ``thinker.``: all of them or none, never a mix."""
    keys = list(keys)
    prefixed = [key for key in keys if key.startswith(THINKER_PREFIX)]
    if not prefixed:
        return False
    if len(prefixed) == len(keys):
        return True
    plain = next(key for key in keys if not key.startswith(THINKER_PREFIX))
    raise CheckpointError(
        f"Qwen snapshot {qwen_dir}: a bare thinker (model_type qwen2_5_omni_thinker) whose keys mix "
        f"{prefixed[0]!r} and {plain!r}; save the thinker again with save_pretrained (keys without 'thinker.'), "
        f"or point at the full Qwen2.5-Omni-3B snapshot"
    )


def _trunk_key(snapshot_key: str, prefixed: bool) -> str | None:
    """The trunk's key for a snapshot key, None for an ignored one; unknown prefixes are a CheckpointError.
    ``prefixed``: the snapshot's keys carry ``thinker.`` (a full Qwen2.5-Omni snapshot always does)."""
    key = snapshot_key if prefixed else THINKER_PREFIX + snapshot_key
    if any(key.startswith(prefix) for prefix in IGNORED_KEY_PREFIXES):
        return None
    if not key.startswith(THINKER_PREFIX):
        raise CheckpointError(f"unexpected key {snapshot_key!r} in the Qwen snapshot")
    return key[len(THINKER_PREFIX) :]


def _read_trunk_weights(
    qwen_dir: Path, expected: dict[str, Tensor], computed: set[str], device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, Tensor]]:
    """Yield (trunk key, tensor on device) for every thinker key, checking names and shapes strictly."""
    files = _snapshot_tensor_files(qwen_dir)
    prefixed = is_full_omni_snapshot(qwen_dir) or _keys_carry_prefix(qwen_dir, files)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for snapshot_key, path in files.items():
        key = _trunk_key(snapshot_key, prefixed)
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


