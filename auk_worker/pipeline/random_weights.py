"""Random-weight pipelines at release size, built in memory: speed and memory do not depend on the values, so the
benchmarks and a worker started with ``AUK_PIPELINE=random-release`` run on them.

The dimensions are the release's (auk-model.md 3.1, 5.1, 2.1): DiT 1536 wide, 24 heads of 64, 10 double and 20
single blocks; the BigVGAN-flow VAE at its released channel widths; the Qwen2.5-Omni-3B thinker (36 layers of
2048, 16 query / 2 key-value heads, MLP 11008; Whisper-style audio tower of 32 layers of 1280). The tokenizer and
feature extractor come from a tiny snapshot (the compute depends on token counts, not on token ids).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from auk_worker.checkpoint import Release
from auk_worker.deploy import DeployConfig, load_deploy_config
from auk_worker.model.dit import AuKDiT, DiTConfig
from auk_worker.model.thinker import PromptProcessor, ThinkerEncoder, ThinkerTrunk
from auk_worker.model.vae import AuKVAE, VAEConfig
from auk_worker.pipeline.fastpaths import FastPaths, Precision, precision_dtype
from auk_worker.pipeline.pipeline import AuKPipeline
from auk_worker.tiny.qwen import write_tiny_qwen

# What ``random_pipeline(vae_fast_paths=False)`` turns off: the VAE's activations as convolutions, its narrow
# convolutions and upsamplers on cuDNN, its reference encode eager (the decode graphs stay).
VAE_FAST_PATHS = ("cuda_activation", "triton_activation", "compiled_activation", "narrow_conv", "upsampler",
                  "encode_graphs")

RELEASE_ARCH = {
    "dim": 1536,
    "heads": 24,
    "dim_head": 64,
    "ff_mult": 2.0,
    "text_hidden_dim": 2048,
    "num_layers": 10,
    "num_single_layers": 20,
    "attn_mask_enabled": True,
}
QWEN_3B_TEXT = {
    "hidden_size": 2048,
    "max_window_layers": 36,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "intermediate_size": 11008,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
}
QWEN_3B_AUDIO = {
    "d_model": 1280,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "output_dim": 2048,
    "num_mel_bins": 128,
    "n_window": 100,
}


def release_thinker_config(qwen_dir: Path):
    """The tiny snapshot's thinker config, resized to Qwen2.5-Omni-3B (token ids stay the tiny tokenizer's)."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig

    raw = json.loads((qwen_dir / "config.json").read_text())["thinker_config"]
    raw["text_config"] = {**raw["text_config"], **QWEN_3B_TEXT}
    raw["audio_config"] = {**raw["audio_config"], **QWEN_3B_AUDIO}
    return Qwen2_5OmniThinkerConfig.from_dict(raw)


def random_pipeline(
    variant: str = "base",
    device: str | torch.device = "cuda",
    precision: Precision = "fast",
    deploy: DeployConfig | None = None,
    compile_blocks: bool = True,
    vae_fast_paths: bool = True,
    seed: int = 0,
) -> AuKPipeline:
    """A release-size pipeline with random weights, warmed up like a loaded one (``startup`` holds the times); its
    fast paths are resolved from ``deploy`` as a loaded one's are, less the compiled blocks without
    ``compile_blocks`` and the VAE's kernels and encode graphs without ``vae_fast_paths`` (``VAE_FAST_PATHS``)."""
    device = torch.device(device)
    deploy = deploy or load_deploy_config()
    off = (() if compile_blocks else ("compiled_blocks",)) + (() if vae_fast_paths else VAE_FAST_PATHS)
    deploy = dataclasses.replace(deploy, disabled_fast_paths=(*deploy.disabled_fast_paths, *off))
    dtype = precision_dtype(precision)
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        qwen_dir = Path(tempfile.mkdtemp(prefix="auk-qwen-")) / "qwen"
        write_tiny_qwen(qwen_dir, seed=seed)
        thinker_config = release_thinker_config(qwen_dir)
        with torch.device(device):
            trunk = ThinkerTrunk(thinker_config).to(device, dtype).eval().requires_grad_(False)
            vae_config = VAEConfig()  # its defaults are the release geometry
            vae = AuKVAE(vae_config).to(device).eval().requires_grad_(False)  # some buffers are built on the CPU
            vae.global_log_std.fill_(1.0)
            dit = AuKDiT(DiTConfig.from_arch(RELEASE_ARCH, latent_dim=64)).to(device, dtype).eval().requires_grad_(False)
            # Small random modulation and output weights: the zero-initialised ones would make every step trivial.
            for name, param in dit.named_parameters():
                if not param.any():
                    param.normal_(0.0, 0.02)
            layer_weights = torch.randn(QWEN_3B_TEXT["num_hidden_layers"])
            layer_scale = torch.ones(1)
        encoder = ThinkerEncoder(PromptProcessor.from_pretrained(qwen_dir), trunk, layer_weights, layer_scale)
    release = Release(
        root=qwen_dir.parent,
        name="AuK-Flash" if variant == "flash" else "AuK",
        variant="flash" if variant == "flash" else "base",
        dit=dit.config,
        vae=vae_config,
        qwen_dir=qwen_dir,
    )
    fast_paths = FastPaths.resolve(deploy, device, precision, dit.config.dim_head)
    pipe = AuKPipeline(release, deploy, encoder, dit, vae, device, precision, {"dit": "random", "vae": "random"},
                       fast_paths)
    pipe.startup["load"] = time.perf_counter() - started
    pipe.warm_up()
    return pipe
