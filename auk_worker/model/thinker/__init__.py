"""Stage 0: the Qwen2.5-Omni thinker as a frozen encoder, read in prompt.py (the prompt and its processor),
trunk.py (the thinker's text model and audio tower, the layer fusion, loading), encoder.py (``ThinkerEncoder``)
and audio_tower.py (the audio tower as fixed-shape batched ops)."""

from auk_worker.model.thinker.encoder import ThinkerEncoder
from auk_worker.model.thinker.prompt import PromptProcessor
from auk_worker.model.thinker.trunk import ThinkerTrunk

__all__ = ["PromptProcessor", "ThinkerEncoder", "ThinkerTrunk"]
