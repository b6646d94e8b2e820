"""A tiny AuK checkpoint in exactly the release layout, with random weights: for tests, CI and the demo.

    OUT/config.yaml                  model.name AuK or AuK-Flash, arch, vae, text_encoder, schedule
    OUT/auk_base.safetensors         (or auk_flash.safetensors) transformer.* + layer_weights + layer_scale
    OUT/vae.safetensors              weight-norm pairs, latent statistics, filter taps
    OUT/qwen/                        a tiny Qwen2.5-Omni snapshot with an offline tokenizer and feature extractor

Its output is noise: the weights are random. Everything else (key names, file layout, shapes relative to the
config, the fp32 export, the bf16-rounded rotary frequencies) matches the release, so the real loading code runs
on it unchanged. Deterministic for a given seed; the global RNG is restored afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from auk_worker.checkpoint import VAE_FILE, WEIGHTS_FILE, Variant
from auk_worker.model.dit import AuKDiT, DiTConfig
from auk_worker.tiny.qwen import write_tiny_qwen
from auk_worker.model.vae import AuKVAE, VAEConfig

QWEN_SUBDIR = "qwen"

# The release geometry (hop 480, the 12-wide first encoder conv) with narrow channels.
TINY_VAE_KWARGS = {
    **VAEConfig().to_release()["model_init_kwargs"],
    "upsample_initial_channel": 64,
    "downsample_channels": [12, 12, 16, 16, 24, 24, 32],
    "flow_hidden_channels": 16,
    "latent_dim": "${model.vae.latent_dim}",  # interpolated as in the release's config.yaml
}


def tiny_arch(text_hidden_dim: int) -> dict:
    return {
        "dim": 64,
        "heads": 4,
        "dim_head": 16,  # its own field: a small config must write it (the release's 1536 / 24 happens to be 64)
        "ff_mult": 2.0,
        "text_hidden_dim": text_hidden_dim,
        "num_layers": 2,
        "num_single_layers": 2,
        "attn_mask_enabled": True,
    }


def make_tiny_checkpoint(out: str | Path, variant: Variant = "base", seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_tiny_qwen(out / QWEN_SUBDIR, seed=seed)
    thinker = json.loads((out / QWEN_SUBDIR / "config.json").read_text())["thinker_config"]["text_config"]
    hidden, layers = thinker["hidden_size"], thinker["num_hidden_layers"]

    config = {
        "model": {
            "name": "AuK-Flash" if variant == "flash" else "AuK",
            "arch": tiny_arch(hidden),
            "vae": {
                "vae_name": "BigVGANFlowVAE",
                "vae_model_path": VAE_FILE,
                "latent_dim": 64,
                "downsample_rate": 480,
                "target_sample_rate": 24000,
                "model_init_kwargs": TINY_VAE_KWARGS,
            },
            "text_encoder": {"text_encoder_path": QWEN_SUBDIR},
            "schedule": {"odeint_kwargs": {"method": "euler"}, "audio_drop_prob": 0.3, "cond_drop_prob": 0.2},
        }
    }
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    vae_config = VAEConfig.from_release(config["model"]["vae"])
    dit_config = DiTConfig.from_arch(config["model"]["arch"], latent_dim=vae_config.latent_dim)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dit = AuKDiT(dit_config)
        _spread_zero_inits(dit)
        state = {f"transformer.{k}": v.detach().float().contiguous() for k, v in dit.state_dict().items()}
        # The release stores the rotary frequencies as a bf16-rounded copy of the 10000-base schedule.
        freqs = state["transformer.rotary_embed.inv_freq"]
        state["transformer.rotary_embed.inv_freq"] = freqs.to(torch.bfloat16).float()
        state["layer_weights"] = torch.randn(layers)
        # Each release has its own fusion scale (Flash's differs from base by 4.0).
        state["layer_scale"] = torch.tensor([1.0 if variant == "base" else 5.0])
        save_file(state, str(out / WEIGHTS_FILE[variant]), metadata={"format": "pt"})

        vae = AuKVAE(vae_config)
        vae_state = {k: v.detach().float().contiguous() for k, v in vae.release_state_dict().items()}
        vae_state["global_mean"] = 0.1 * torch.randn(vae_config.latent_dim)
        vae_state["global_log_std"] = 0.5 + torch.rand(vae_config.latent_dim)  # used under a square root
        save_file(vae_state, str(out / VAE_FILE), metadata={"format": "pt"})
    return out


def _spread_zero_inits(module: torch.nn.Module) -> None:
    """Give zero-initialised parameters (adaLN, output projection) small random values so every path is exercised."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() >= 1 and not param.any():
                param.normal_(0.0, 0.02)
