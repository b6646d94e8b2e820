"""What the DiT benchmarks share about the release-size model: the weights a position passes, the GPU's peak rate
that utilisation is quoted against, and a context of given sizes. The random-weight release-size pipeline itself is
the product's (``auk_worker/pipeline/random_weights.py``: a worker runs it with ``AUK_PIPELINE=random-release``);
it is re-exported here for the benchmarks.
"""

from __future__ import annotations

import torch

from auk_worker.model.dit import AuKDiT, DiTContext
from auk_worker.model.fp8 import block_linears
from auk_worker.pipeline.random_weights import (  # noqa: F401 - re-exported for the benchmarks
    QWEN_3B_AUDIO,
    QWEN_3B_TEXT,
    RELEASE_ARCH,
    VAE_FAST_PATHS,
    random_pipeline,
    release_thinker_config,
)

PEAK_FLOPS = 790e12  # the H200's dense bf16 rate, measured on random data: what DiT utilisation is quoted against


def position_weights(dit: torch.nn.Module) -> int:
    """Block-linear weights one position passes per forward: all of a single block's, and half of a double block's
    (audio positions pass the audio stream's linears, text positions the text stream's twins of the same sizes).
    The embeddings and the output projection are left out (per job, or under 0.1 %)."""
    double = {id(module) for block in dit.transformer_blocks for module in block.modules()}
    weights = [(getattr(parent, name).weight.numel(), id(parent) in double) for parent, name in block_linears(dit)]
    return sum(size // 2 if in_double else size for size, in_double in weights)


def make_ctx(dit: AuKDiT, rows: int, text: int, ref: int, frames: int, pad: int) -> tuple[DiTContext, torch.Tensor]:
    """A CFG context of ``rows`` equal requests (``text`` tokens, ``ref`` reference and ``frames`` target frames,
    each padded by ``pad`` masked positions; a reference of 0 frames: none) and a noisy target for it."""
    device = dit.device
    nt, np_, n = text + pad, (ref + pad if ref else 0), frames + pad
    lens = lambda v: torch.full((rows,), v, device=device)  # noqa: E731
    ctx = dit.prepare(
        text=torch.randn(rows, nt, 2048, device=device),
        text_lens=lens(text),
        ref=torch.randn(rows, np_, 64, device=device) if np_ else None,
        ref_lens=lens(ref) if np_ else None,
        ref_valid_lens=lens(ref) if np_ else None,
        target_len=n,
        target_lens=lens(frames) if pad else None,
        cfg=True,
    )
    return ctx, torch.randn(rows, n, 64, device=device)
