"""Building the codec from the release's ``vae.safetensors``: strictly, with each weight-norm pair folded on the
target device."""

from __future__ import annotations

import logging

import torch

from auk_worker.errors import CheckpointError
from auk_worker.model.vae.config import VAEConfig
from auk_worker.model.vae.vae import TRAINING_ONLY_PREFIX, AuKVAE, is_filter_key, weight_norm_keys

logger = logging.getLogger(__name__)


def load_vae(
    state: dict[str, torch.Tensor], config: VAEConfig, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> AuKVAE:
    """Build the VAE from a release-layout state dict, strictly, with weight norm folded on ``device``.

    Every key the module needs must be present and no other, except ``flow.*`` (skipped) and the low-pass
    taps (checked when present, computed when absent). Each conv weight is folded as w = g * v / ||v||, the
    norm over every axis but 0 (the input-channel axis of a transposed conv), in fp32 ON ``device``: a CPU
    fold differs by an ULP and the encoder amplifies that to ~4e-4 at the latent head. ``dtype`` other than
    fp32 casts afterwards and departs from upstream, which always runs the VAE in fp32.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = AuKVAE(config)
    wanted = model.state_dict()  # meta tensors, except the low-pass taps (built on the CPU)
    norm_keys = weight_norm_keys(model)

    needed = []
    for key in wanted:
        if key in norm_keys:
            needed += [key + "_g", key + "_v"]
        elif not is_filter_key(key):
            needed.append(key)
    missing = [key for key in needed if key not in state]
    if missing:
        raise CheckpointError(f"vae weights: missing {len(missing)} tensors: {', '.join(missing[:8])}")
    # flow.* is the residual coupling flow: it maps the posterior towards the prior for the training loss
    # only; inference decodes posterior latents directly, so its tensors are not used.
    known = set(needed) | {key for key in wanted if is_filter_key(key)}
    unexpected = [key for key in state if key not in known and not key.startswith(TRAINING_ONLY_PREFIX)]
    if unexpected:
        raise CheckpointError(f"vae weights: unexpected tensors: {', '.join(sorted(unexpected)[:8])}")

    loaded: dict[str, torch.Tensor] = {}
    for key, like in wanted.items():
        if key in norm_keys:
            gain_shape = (like.shape[0],) + (1,) * (like.dim() - 1)
            gain = _take(state, key + "_g", gain_shape, device)
            direction = _take(state, key + "_v", tuple(like.shape), device)
            loaded[key] = torch._weight_norm(direction, gain, 0)  # the kernel torch's weight_norm runs
        elif is_filter_key(key):
            loaded[key] = _filter_taps(state, key, like, device)
        else:
            loaded[key] = _take(state, key, tuple(like.shape), device)
    model.load_state_dict(loaded, strict=True, assign=True)
    model = model.to(dtype).eval().requires_grad_(False)
    ignored = sum(key.startswith(TRAINING_ONLY_PREFIX) for key in state)
    logger.info("vae: loaded %d tensors on %s (skipped %d training-only flow tensors)", len(needed), device, ignored)
    return model


def _take(state: dict[str, torch.Tensor], key: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    tensor = state[key]
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"vae weights: {key} has shape {tuple(tensor.shape)}, the config needs {shape}")
    return tensor.to(device=device, dtype=torch.float32)


def _filter_taps(
    state: dict[str, torch.Tensor], key: str, computed: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """The stored taps when present (after checking they are the computed filter), else the computed ones."""
    if key not in state:
        return computed.to(device)
    stored = _take(state, key, tuple(computed.shape), torch.device("cpu"))
    if not torch.allclose(stored, computed, rtol=0.0, atol=1e-6):
        raise CheckpointError(f"vae weights: {key} is not the 12-tap Kaiser low-pass this model computes")
    return stored.to(device)
