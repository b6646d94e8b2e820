"""Stage 0's audio tower as fixed-shape batched tensor ops, replayable from one CUDA graph per chunk count.

The Qwen2.5-Omni audio tower (transformers' ``Qwen2_5OmniAudioEncoder``) reads one clip's f mel frames in chunks
of w = 2 * n_window frames, the last one partial (f = 400 makes two full chunks, f = 401 a third of one frame).
Per chunk: conv1 (k3, pad 1) -> GELU -> zero the columns past the chunk's frames -> conv2 (k3, stride 2, pad 1)
-> GELU, then the sinusoidal positions 0..t-1 are added, so every chunk restarts at position 0. Each layer is
pre-norm (LayerNorm -> attention -> residual, LayerNorm -> fc1 -> GELU -> fc2 -> residual; fp16 sums clamped to
the format's max - 1000), with attention only among the valid tokens of one chunk, scaled by dh^-1/2 (k_proj has
no bias, q/v/out_proj do). The valid tokens of all chunks are then laid end to end and averaged in pairs (an odd
last token is dropped), layer-normed (``ln_post``) and projected (``proj``) to the text model's width.

transformers runs that with Python loops over chunks and a gather of the valid tokens, so its kernel count and
shapes follow the clip. ``AudioTowerRunner`` computes the same thing over zero-padded whole chunks:
- ``plan`` (host, from f alone): chunk count, frames of the last chunk, how many output rows are valid.
- ``prepare``: the clip's frames zero-padded to [c, m, w] and each chunk's frame count [c], on the device.
- ``core``: fixed shapes for a chunk count, no host syncs. One SDPA call per layer over [c, h, t, dh] with an
  additive key mask built once from the chunk frame counts, so the last chunk's padded tokens are never keys; q, k
  and v come from one product over the layer's stacked projection weights (``trunk.fuse_linears``). Only the
  last chunk has padding, so the valid tokens are a prefix of the flattened [c * t] sequence: pairing that
  sequence is the reference's per-clip pooling, and the valid output rows are the first na.
The pipeline's ``AudioTowerGraphs`` replays ``core`` from one CUDA graph per chunk count.

The runner shares the tower's modules (no weight copies) and holds no state between calls.

Shapes: f mel frames of the clip, m mel bins (128), c chunks, w frames per chunk (2 * n_window = 200 at release),
t tokens per chunk after conv2 (n_window), d tower width (1280), h heads (20), dh head width (64),
p pooled rows (c * t // 2), do output width (2048), na audio tokens of the clip (the first na of the p rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from auk_worker.errors import AudioError
from auk_worker.model.thinker.prompt import audio_token_count
from auk_worker.model.thinker.trunk import fuse_linears

@dataclass(frozen=True)
class ChunkPlan:
    """How one clip of ``frames`` mel frames splits into chunks; everything the host needs, known from f alone."""

    frames: int  # f
    chunk_frames: int  # w
    chunks: int  # c
    last_frames: int  # frames of the last chunk, 1..w
    audio_tokens: int  # na

    @classmethod
    def for_frames(cls, frames: int, n_window: int) -> ChunkPlan:
        if frames < 1:
            raise AudioError("prompt audio has no mel frames")
        w = 2 * n_window
        chunks = -(-frames // w)  # ceil
        return cls(frames, w, chunks, frames - (chunks - 1) * w, audio_token_count(frames))


def _encoder_layer(layer: nn.Module, qkv: nn.Linear, x: Tensor, key_bias: Tensor, heads: int) -> Tensor:
    """One pre-norm encoder layer over whole chunks: [c, t, d] -> [c, t, d]. ``qkv`` is the layer's three
    projections as one (``fuse_linears``); ``key_bias`` [c, 1, 1, t] is 0 for a chunk's valid keys, -inf past them."""
    attn = layer.self_attn
    c, t, d = x.shape
    q, k, v = qkv(layer.self_attn_layer_norm(x)).view(c, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)  # views
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_bias, scale=(d // heads) ** -0.5)  # [c, h, t, dh]
    x = x + attn.out_proj(o.transpose(1, 2).reshape(c, t, d))
    x = x + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
    if x.dtype == torch.float16:
        limit = torch.finfo(torch.float16).max - 1000
        x = x.clamp(-limit, limit)
    return x


def _conv_as_product(x: Tensor, conv: nn.Conv1d) -> Tensor:
    """``conv`` (no dilation, one group) as one matrix product over its input's windows: [c, i, w] -> [c, t, o],
    the layout the layers read. For conv2's [1280, 1280, 3] weight cuDNN converted the weight's layout at every
    call, which cost more than the convolution itself."""
    (taps,), (stride,), (pad,) = conv.kernel_size, conv.stride, conv.padding
    windows = F.pad(x, (pad, pad)).unfold(-1, taps, stride)  # [c, i, t, taps]
    columns = windows.transpose(1, 2).reshape(x.shape[0], windows.shape[2], -1)  # [c, t, i * taps], as the weight
    return F.linear(columns, conv.weight.view(conv.out_channels, -1), conv.bias)


class AudioTowerRunner:
    """The audio tower over one clip as batched whole-chunk ops: (features [1, m, f], mask [1, f]) -> [na, do].

    A plain object, not a module, so attaching it to the trunk registers no weights twice."""

    def __init__(self, tower: nn.Module) -> None:
        self.tower = tower
        self.n_window = tower.config.n_window
        self.heads = tower.config.encoder_attention_heads
        self.num_mel_bins = tower.config.num_mel_bins
        self.qkv = [fuse_linears([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                    for layer in tower.layers]
        self.layer = _encoder_layer  # compile_layers() swaps in its compiled form

    def compile_layers(self) -> None:
        """``torch.compile`` the encoder layer: one compilation serves every layer and chunk count (one more for a
        single chunk); its norms, residual adds and activations run as fused kernels."""
        self.layer = torch.compile(_encoder_layer, fullgraph=True, dynamic=True)

    @property
    def device(self) -> torch.device:
        return self.tower.conv1.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tower.conv1.weight.dtype

    def plan(self, frames: int) -> ChunkPlan:
        return ChunkPlan.for_frames(frames, self.n_window)

    def prepare(self, input_features: Tensor, feature_attention_mask: Tensor) -> tuple[Tensor, Tensor, ChunkPlan]:
        """One clip's valid frames as zero-padded chunks [c, m, w] and frames per chunk [c] (long), both on the
        tower's device. Reads the frame count on the host (a sync when the mask lives on the GPU; the processor's
        mask lives on the host)."""
        mask = feature_attention_mask[0]  # [F]
        plan = self.plan(int(mask.sum()))
        clip = input_features[0]  # [m, F]
        if plan.frames != clip.shape[-1]:  # frames picked by the mask (the processor's mask is all ones)
            clip = clip[:, mask.bool()]  # [m, f]
        c, w = plan.chunks, plan.chunk_frames
        padded = F.pad(clip.to(self.device, self.dtype, non_blocking=True), (0, c * w - plan.frames))  # [m, c * w]
        features = padded.view(self.num_mel_bins, c, w).transpose(0, 1).contiguous()  # [c, m, w]
        chunk_frames = torch.full((c,), w, dtype=torch.long)
        chunk_frames[-1] = plan.last_frames  # [c], set on the host: a scalar written into a GPU tensor waits for it
        return features, chunk_frames.to(self.device, non_blocking=True), plan

    def core(self, features: Tensor, chunk_frames: Tensor) -> Tensor:
        """Fixed-shape body: chunks [c, m, w] and frames per chunk [c] -> pooled, projected rows [p, do].

        The clip's audio tokens are the first na rows; the rest come from padding. No host syncs."""
        tower = self.tower
        c, _, w = features.shape
        frame_valid = torch.arange(w, device=features.device) < chunk_frames[:, None]  # [c, w]
        x = F.gelu(tower.conv1(features)) * frame_valid[:, None, :]  # [c, d, w]
        x = F.gelu(_conv_as_product(x, tower.conv2))  # [c, t, d]
        t, d = x.shape[1:]
        x = x + tower.positional_embedding.positional_embedding[:t].to(x.dtype)  # [c, t, d]

        chunk_tokens = (chunk_frames - 1) // 2 + 1  # [c], conv2's output length
        key_valid = torch.arange(t, device=features.device) < chunk_tokens[:, None]  # [c, t]
        # Additive, built once: a boolean mask would be turned into this in every layer's attention call.
        key_bias = torch.zeros(c, 1, 1, t, dtype=x.dtype, device=x.device).masked_fill(
            ~key_valid[:, None, None, :], float("-inf")
        )
        for layer, qkv in zip(tower.layers, self.qkv):
            x = self.layer(layer, qkv, x, key_bias, self.heads)

        p = c * t // 2
        pairs = x.reshape(c * t, d)[: 2 * p].view(p, 2, d)  # consecutive tokens of the clip, chunk after chunk
        pooled = (pairs[:, 0] + pairs[:, 1]) / 2  # [p, d]
        return tower.proj(tower.ln_post(pooled))  # [p, do]

    @torch.inference_mode()
    def __call__(self, input_features: Tensor, feature_attention_mask: Tensor) -> Tensor:
        features, chunk_frames, plan = self.prepare(input_features, feature_attention_mask)
        return self.core(features, chunk_frames)[: plan.audio_tokens]  # [na, do]
