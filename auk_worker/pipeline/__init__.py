"""The render pipeline: ``AuKPipeline`` (pipeline.py) over the model's stages, with the per-render machinery in
render.py; its fast paths are one ``FastPaths`` (fastpaths.py), applied by wiring.py, whose CUDA graph runners
are in graphs.py (stage 1) and thinker_graphs.py (stage 0); voices.py holds what the voice cache keeps of a
reference clip."""

from auk_worker.pipeline.fastpaths import FastPaths, Precision, precision_dtype, resolve_device, resolve_precision
from auk_worker.pipeline.pipeline import AuKPipeline

__all__ = ["AuKPipeline", "FastPaths", "Precision", "precision_dtype", "resolve_device", "resolve_precision"]
