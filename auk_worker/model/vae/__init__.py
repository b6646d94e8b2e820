"""The codec, read in config.py (hyper-parameters and tiling geometry), alias_free.py (the decoder's anti-aliased
activation), vae.py (``AuKVAE``) and load.py (``load_vae``). The hand-written kernels it can run in place of its
torch form live under kernels/; the pipeline's wiring chooses them."""

from auk_worker.model.vae.config import VAEConfig, plan_tiles
from auk_worker.model.vae.load import load_vae
from auk_worker.model.vae.vae import AuKVAE

__all__ = ["AuKVAE", "VAEConfig", "load_vae", "plan_tiles"]
