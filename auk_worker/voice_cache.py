"""What a reference clip costs to prepare, kept for its next job: an LRU bounded by bytes, keyed by content.

A zero-shot job's clip is fetched, decoded, resampled twice (24 kHz for the VAE, 16 kHz for the thinker), run
through the audio tower and encoded by the VAE before the DiT starts. None of it depends on the instruction, the
seed or the target length, so a voice rendered again skips all of it. Entries are keyed by ``(content key,
piece)``: the content key is the SHA-256 of the clip's encoded bytes (a voice's, an upload's, a speech request's
inline clip), so equal bytes share entries whoever sent them and different bytes never do.

Pieces stored here:

- ``"clip"`` (the worker): the decoded ``CheckedClip``, so a cached voice is not even downloaded again;
- ``"prepared"`` (the pipeline, ``AuKPipeline._prepared_voice``): the resampled copies, the audio tower's output
  and the reference latents (posterior mean only: a sampled posterior depends on the seed).

A cached piece is the very tensor the first render computed and every later render reads it through the same
operations, so a render with a cached voice is bit-identical to one without. The bound is ``AUK_VOICE_CACHE_BYTES``
(default 512 MiB; 0 turns the cache off); an entry larger than the bound is not kept. Torch-free: sizes are read
from ``nbytes`` (numpy) or ``element_size() * numel()`` (tensors) without importing torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

DEFAULT_MAX_BYTES = 512 * 1024 * 1024


def size_of(value: Any) -> int:
    """Bytes held by ``value``: arrays and tensors by their buffers, dataclasses and sequences by their parts."""
    if value is None or isinstance(value, (int, float, str, bool)):
        return 0
    if hasattr(value, "element_size") and hasattr(value, "numel"):  # a torch tensor
        return int(value.element_size() * value.numel())
    if hasattr(value, "nbytes"):  # a numpy array
        return int(value.nbytes)
    if is_dataclass(value):
        return sum(size_of(getattr(value, f.name)) for f in fields(value))
    if isinstance(value, (list, tuple)):
        return sum(size_of(item) for item in value)
    if isinstance(value, dict):
        return sum(size_of(item) for item in value.values())
    return 0


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


class VoiceCache:
    """A thread-safe LRU of prepared voice pieces, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, content_key: str | None, piece: str) -> Any | None:
        """The cached piece for this content, or None (counted as a miss)."""
        if content_key is None or self.max_bytes == 0:
            return None
        with self._lock:
            entry = self._entries.get((content_key, piece))
            if entry is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end((content_key, piece))
            self.stats.hits += 1
            return entry[0]

    def put(self, content_key: str | None, piece: str, value: Any) -> None:
        """Keep ``value``; the least recently used entries go until the total fits. Too large: not kept."""
        if content_key is None:
            return
        size = size_of(value)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop((content_key, piece), None)
            if old is not None:
                self.stats.bytes -= old[1]
            self._entries[(content_key, piece)] = (value, size)
            self.stats.bytes += size
            while self.stats.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.stats.bytes -= dropped
                self.stats.evictions += 1
            self.stats.entries = len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
