"""Building the DiT from the release's weights file, strictly, in the serving dtype."""

from __future__ import annotations

import torch

from auk_worker.checkpoint import Release, load_strict, read_safetensors, split_dit_weights
from auk_worker.model.dit.model import AuKDiT


def load_dit(release: Release, device: torch.device, dtype: torch.dtype) -> tuple[AuKDiT, dict[str, torch.Tensor]]:
    """The release's DiT on ``device`` in ``dtype`` (eval, no grad), and the thinker's layer-fusion weights that
    share its file."""
    state, fusion = split_dit_weights(read_safetensors(release.weights_path, device), str(release.weights_path))
    with torch.device("meta"):
        dit = AuKDiT(release.dit)
    # Weights take the serving dtype one tensor at a time; the rotary frequencies always stay fp32.
    state = {k: v.float() if k == "rotary_embed.inv_freq" else v.to(dtype) for k, v in state.items()}
    load_strict(dit, state, str(release.weights_path), prefix="transformer.")
    return dit.eval().requires_grad_(False), fusion
