"""Stage 1 backbone: the AuK DiT, read top to bottom in config.py (hyper-parameters, kernel table, per-request
context), layers.py, attention.py, blocks.py and model.py (``AuKDiT``). The hand-written kernels it can run in
place of its torch form live under kernels/; the pipeline's wiring chooses them."""

from auk_worker.model.dit.config import DiTConfig, DiTContext, DiTKernels
from auk_worker.model.dit.model import AuKDiT

__all__ = ["AuKDiT", "DiTConfig", "DiTContext", "DiTKernels"]
