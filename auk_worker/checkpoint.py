"""The AuK release layout: config.yaml, auk_{base,flash}.safetensors, vae.safetensors and a Qwen2.5-Omni-3B snapshot.

    tencent/AuK        config.yaml  auk_base.safetensors   vae.safetensors
    tencent/AuK-Flash  config.yaml  auk_flash.safetensors  vae.safetensors
    Qwen/Qwen2.5-Omni-3B  (referenced by model.text_encoder.text_encoder_path)

The variant comes from ``model.name`` in config.yaml (``AuK`` / ``AuK-Base`` or ``AuK-Flash``), never from a
file name. Weights load strictly: the DiT file holds ``transformer.*`` plus the two fusion tensors
``layer_weights`` and ``layer_scale``; any other key, a missing key or a mis-shaped tensor is a CheckpointError
naming it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from safetensors import safe_open

from auk_worker.errors import CheckpointError
from auk_worker.model.dit import AuKDiT, DiTConfig
from auk_worker.model.vae import VAEConfig

log = logging.getLogger(__name__)

Variant = Literal["base", "flash"]

VARIANT_BY_NAME: dict[str, Variant] = {"AuK": "base", "AuK-Base": "base", "AuK-Flash": "flash"}
WEIGHTS_FILE: dict[Variant, str] = {"base": "auk_base.safetensors", "flash": "auk_flash.safetensors"}
VAE_FILE = "vae.safetensors"
HUB_REPOS: dict[Variant, str] = {"base": "tencent/AuK", "flash": "tencent/AuK-Flash"}
QWEN_REPO = "Qwen/Qwen2.5-Omni-3B"
FUSION_KEYS = ("layer_weights", "layer_scale")

# Keys of config.yaml's `model` mapping; anything else there is a CheckpointError.
_MODEL_KEYS = {"name", "arch", "vae", "text_encoder", "schedule"}
# Training-only schedule keys; the sampler's own knobs come from the request and the deploy config.
_SCHEDULE_KEYS = {"odeint_kwargs", "audio_drop_prob", "cond_drop_prob", "t_sampling", "P_mean", "P_std"}


@dataclass(frozen=True)
class Release:
    """A parsed release directory; nothing is loaded yet."""

    root: Path
    name: str
    variant: Variant
    dit: DiTConfig
    vae: VAEConfig
    qwen_dir: Path
    schedule: dict[str, Any] = field(default_factory=dict)

    @property
    def weights_path(self) -> Path:
        return self.root / WEIGHTS_FILE[self.variant]

    @property
    def vae_path(self) -> Path:
        return self.root / VAE_FILE


def read_release(root: str | Path, qwen_path: str | Path | None = None) -> Release:
    """Parse ``root/config.yaml`` and check that the files the variant needs are there."""
    root = Path(root)
    config_path = root / "config.yaml"
    if not config_path.is_file():
        raise CheckpointError(f"{root} is not an AuK checkpoint: config.yaml is missing")
    try:
        raw = yaml.safe_load(config_path.read_text())
    except yaml.YAMLError as exc:
        raise CheckpointError(f"{config_path} is not valid YAML: {exc}") from None
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError(f"{config_path}: the top-level 'model' mapping is missing")
    unknown = sorted(set(model) - _MODEL_KEYS)
    if unknown:
        raise CheckpointError(f"{config_path}: unknown key model.{unknown[0]}")
    name = model.get("name")
    if name not in VARIANT_BY_NAME:
        raise CheckpointError(f"{config_path}: model.name must be one of {sorted(VARIANT_BY_NAME)}, got {name!r}")
    variant = VARIANT_BY_NAME[name]
    for section in ("arch", "vae"):
        if not isinstance(model.get(section), dict):
            raise CheckpointError(f"{config_path}: model.{section} is missing")
    vae = VAEConfig.from_release(model["vae"])
    dit = DiTConfig.from_arch(model["arch"], latent_dim=vae.latent_dim)
    schedule = model.get("schedule") or {}
    unknown = sorted(set(schedule) - _SCHEDULE_KEYS)
    if unknown:
        raise CheckpointError(f"{config_path}: unknown key model.schedule.{unknown[0]}")
    method = (schedule.get("odeint_kwargs") or {}).get("method", "euler")
    if method != "euler":
        raise CheckpointError(f"{config_path}: model.schedule.odeint_kwargs.method {method!r} is not supported (euler only)")
    release = Release(
        root=root,
        name=name,
        variant=variant,
        dit=dit,
        vae=vae,
        qwen_dir=_resolve_qwen(root, model.get("text_encoder") or {}, qwen_path),
        schedule=schedule,
    )
    for path in (release.weights_path, release.vae_path):
        if not path.is_file():
            raise CheckpointError(f"{root}: {path.name} is missing (model.name {name!r} needs it)")
    return release


def _resolve_qwen(root: Path, section: dict, override: str | Path | None) -> Path:
    """The thinker snapshot: an explicit path, else text_encoder_path as given, relative to the release, or beside it."""
    if override is not None:
        candidates = [Path(override)]
    else:
        configured = section.get("text_encoder_path")
        if not configured:
            raise CheckpointError(f"{root}/config.yaml: model.text_encoder.text_encoder_path is missing")
        configured = Path(str(configured))
        candidates = [configured, root / configured, root.parent / configured.name]
    for path in candidates:
        if (path / "config.json").is_file():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise CheckpointError(f"no Qwen2.5-Omni snapshot found (tried {tried}); pass --qwen-path DIR")


def read_safetensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of one file, read straight onto ``device``."""
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def split_dit_weights(state: dict[str, torch.Tensor], source: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split the DiT file into the backbone (``transformer.`` stripped) and the two fusion tensors."""
    dit, fusion, unknown = {}, {}, []
    for key, tensor in state.items():
        if key.startswith("transformer."):
            dit[key.removeprefix("transformer.")] = tensor
        elif key in FUSION_KEYS:
            fusion[key] = tensor
        else:
            unknown.append(key)
    if unknown:
        raise CheckpointError(f"{source}: unexpected tensor {unknown[0]!r} ({len(unknown)} unexpected in all)")
    missing = [key for key in FUSION_KEYS if key not in fusion]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}")
    if not dit:
        raise CheckpointError(f"{source}: no transformer.* tensors")
    return dit, fusion


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], source: str, prefix: str = "") -> None:
    """``load_state_dict(strict=True, assign=True)`` with errors that name the first offending key."""
    expected = module.state_dict(keep_vars=True)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{source}: missing tensor '{prefix}{missing[0]}' ({len(missing)} missing in all)")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor '{prefix}{unexpected[0]}' ({len(unexpected)} unexpected in all)")
    for key, param in expected.items():
        if tuple(param.shape) != tuple(state[key].shape):
            raise CheckpointError(
                f"{source}: tensor '{prefix}{key}' has shape {tuple(state[key].shape)}, expected {tuple(param.shape)}"
            )
    module.load_state_dict(state, strict=True, assign=True)


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    """A short content hash of a weight file's header (tensor names, shapes, offsets) and first megabyte."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        handle.seek(0)
        digest.update(handle.read(8 + header_len + chunk))
    return digest.hexdigest()[:16]


def download_release(dest: str | Path, variant: Variant = "base", revision: str | None = None) -> Path:
    """Fetch the released weights with huggingface_hub: ``dest/AuK[-Flash]`` and ``dest/Qwen2.5-Omni-3B``.

    The release's config.yaml names the thinker as ``ckpts/Qwen2.5-Omni-3B``; ``read_release`` also finds it beside
    the release directory, which is where this puts it.
    """
    from huggingface_hub import snapshot_download

    dest = Path(dest)
    repo = HUB_REPOS[variant]
    release_dir = dest / repo.split("/")[1]
    snapshot_download(
        repo, revision=revision, local_dir=release_dir, allow_patterns=["config.yaml", WEIGHTS_FILE[variant], VAE_FILE]
    )
    qwen_dir = dest / QWEN_REPO.split("/")[1]
    # The thinker only: talker and token2wav shards are not needed, but they share shard files with the
    # thinker in the published snapshot, so every shard is fetched.
    snapshot_download(QWEN_REPO, local_dir=qwen_dir, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    return release_dir


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
