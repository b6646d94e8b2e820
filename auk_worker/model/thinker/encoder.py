"""Stage 0: the instruction/audio encoder (frozen Qwen2.5-Omni thinker + learned layer fusion).

AuK conditions its DiT on the hidden states of the Qwen2.5-Omni-3B thinker. One forward runs the prompt (a
default system turn, the user's instruction, then either the reference clip as audio tokens or the literal
marker ``|<no_prompt_audio>|``) through the thinker's audio tower and text model; the 36 layer outputs are
layer-normed and mixed with the checkpoint's own softmax weights and scale (ELMo-style fusion).

``ThinkerEncoder``: strict loading from a Qwen2.5-Omni snapshot, ``embed``, ``conditions`` and ``encode``. Its
fast-path slots (set by the pipeline's wiring): ``graphs`` (the text model and fusion replayed from CUDA graphs)
and ``layer`` (the written-out decoder layer, compiled by ``compile_layers``).

Shapes: b prompts in a batch, nt prompt tokens (audio placeholders included), d thinker hidden size (2048 at
release), k fused layers (36 at release).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from auk_worker.errors import CheckpointError, ConfigError
from auk_worker.model.thinker.prompt import PromptProcessor, ThinkerSpec, read_thinker_config
from auk_worker.model.thinker.trunk import (
    FUSION_LN_EPS,
    LayerProducts,
    ThinkerTrunk,
    fuse_hidden_states,
    load_thinker_trunk,
    rotary_tables,
    thinker_layer,
    written_out_supported,
)

logger = logging.getLogger(__name__)

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
        self.graphs = None  # set by the wiring: replays `fuse` from CUDA graphs at fixed prompt sizes (EncoderGraphs)
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
