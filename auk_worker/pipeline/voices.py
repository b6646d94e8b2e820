"""The engine's side of the voice cache (``auk_worker/voice_cache.py``): what a reference clip costs to prepare,
and the two thinker calls that let a render reuse it.

``AuKPipeline._conditioned`` looks a clip up by its content key (``AudioClip.key``); on a miss it computes the
audio tower's output with ``audio_embeds`` and keeps a ``PreparedVoice``; on a hit it skips the resampling, the
audio tower and the VAE encode. Both paths build the prompt's embeddings with ``embed_with_audio``, the same
operations as ``ThinkerTrunk.embed``, so a render from the cache is bit-identical to one without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auk_worker.errors import ModelError
from auk_worker.model.thinker import ThinkerEncoder
from auk_worker.types import AudioClip
from auk_worker.voice_cache import VoiceCache

PIECE = "prepared"  # the voice cache's name for these entries


@dataclass(frozen=True)
class PreparedVoice:
    """What a reference clip costs before the DiT, kept in the voice cache under the clip's content key."""

    clip_24k: np.ndarray  # [t24] float32, the VAE's copy
    audio_16k: np.ndarray  # [t16] float32, the thinker's copy
    audio_embeds: torch.Tensor  # [na, dt] the audio tower's output
    ref: torch.Tensor | None  # [np, l] posterior-mean reference latents (None: first made with a sampled posterior)
    ref_valid: int


def cached_voice(cache: VoiceCache | None, clip: AudioClip | None) -> PreparedVoice | None:
    """What an earlier render prepared for this clip's content (``clip.key``), when a cache is attached."""
    if cache is None or clip is None or clip.key is None:
        return None
    return cache.get(clip.key, PIECE)


def audio_embeds(
    encoder: ThinkerEncoder, instruction: str, audio_16k: np.ndarray, input_ids: torch.Tensor
) -> torch.Tensor:
    """The audio tower's output for a clip [na, dt]: what ``ThinkerEncoder.embed`` computes for its audio."""
    batch = encoder.processor(instruction, audio_16k, encoder.device, input_ids)
    return encoder.trunk.embed_audio(batch["input_features"], batch["feature_attention_mask"])


def embed_with_audio(encoder: ThinkerEncoder, input_ids: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """The prompt's embeddings [nt, dt] with ``audio`` [na, dt] at its audio placeholders: the same operations as
    ``ThinkerTrunk.embed``, so a cached tower output gives the same bits as a fresh one."""
    trunk = encoder.trunk
    device = trunk.model.embed_tokens.weight.device
    embeds = trunk.model.embed_tokens(input_ids.to(device, non_blocking=True))  # [1, nt, d]
    slots = input_ids == trunk.audio_token_id  # [1, nt]
    if int(slots.sum()) != audio.shape[0]:
        raise ModelError(f"prompt has {int(slots.sum())} audio tokens, the cached voice has {audio.shape[0]}")
    embeds = embeds.masked_scatter(slots.to(device, non_blocking=True).unsqueeze(-1), audio.to(embeds.dtype))
    return embeds[0]
