"""Compile caches that outlive a worker process, so a restarted or added worker starts warm.

A worker's start-up is mostly compile work: Inductor's kernels for the compiled DiT blocks and thinker, Triton's
own kernels, and the autotuning behind both. Torch and Triton cache all of it on disk, by default under ``/tmp``
of the process's container, which a restart or a new pod does not share. ``use_compile_caches`` points those
caches at one directory (``AUK_CACHE_DIR``: a volume, shared by the workers of a host or a node), before torch is
imported, so the second process to compile a given graph for a given GPU and torch build reads the result instead.

Entries are keyed by the graph, the torch and Triton versions and the device, so a shared directory is safe
across variants, deploy configs and GPU generations; a stale entry is never used, only left behind.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

# Which cache each variable moves, relative to AUK_CACHE_DIR.
CACHE_VARIABLES = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",  # Inductor's FX graph and AOTAutograd caches, its autotune results
    "TRITON_CACHE_DIR": "triton",  # compiled Triton kernels (Inductor's and the project's own)
}
# Inductor's on-disk caches, on by default in current torch; set so an older build behaves the same.
SWITCHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def use_compile_caches(cache_dir: Path | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Point torch's and Triton's caches under ``cache_dir``; returns the variables it set.

    A variable the operator set already wins. Called before torch is imported: torch reads some of these once.
    """
    env = os.environ if environ is None else environ
    if cache_dir is None:
        return {}
    if environ is None and "torch" in sys.modules:
        log.warning("compile caches: torch is already imported; AUK_CACHE_DIR may not apply to every cache")
    chosen: dict[str, str] = {}
    for name, sub in CACHE_VARIABLES.items():
        if not env.get(name):
            path = Path(cache_dir) / sub
            path.mkdir(parents=True, exist_ok=True)
            chosen[name] = str(path)
    for name, value in SWITCHES.items():
        if not env.get(name):
            chosen[name] = value
    env.update(chosen)
    return chosen
