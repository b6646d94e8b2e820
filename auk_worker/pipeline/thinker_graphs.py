"""Stage 0's CUDA graph runners: the thinker's text model and fusion, its audio tower, and the reference clip's
log-mel features, each replayed from a graph per fixed shape instead of launched kernel by kernel.

- ``EncoderGraphs`` replays the thinker's text model and the layer fusion at the deploy config's prompt sizes,
  for one prompt and for a pass of several.
- ``AudioTowerGraphs`` replays the audio tower's fixed-shape body (``AudioTowerRunner.core``) per chunk count.
- ``LogMelGraphs`` replays the prompt processor's log-mel features of a reference clip per whole second of it.

Nothing here changes what is computed; the wiring (``wiring.py``) attaches them to the encoder's slots.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor

from auk_worker.model.thinker.audio_tower import AudioTowerRunner
from auk_worker.model.thinker.encoder import ThinkerEncoder
from auk_worker.model.thinker.prompt import PromptProcessor
from auk_worker.pipeline.cuda_graph import capture_graph

logger = logging.getLogger(__name__)


class EncoderGraphs:
    """The thinker's text model and the layer fusion replayed from CUDA graphs at fixed prompt sizes.

    A pass of ``nt`` tokens runs in the smallest capture size that holds it, right-padded with zero embeddings:
    attention is causal, so padding after a prompt cannot reach its positions. A pass of several prompts runs in
    the graphs of ``rows`` prompts (the encoder's ``max_rows``), its missing rows zero. Passes longer than the
    largest size run eager (the deploy config's ``cudagraph_capture_sizes`` rule). The audio tower and the
    embedding lookup stay eager: they run before, on each prompt's own length.
    """

    def __init__(self, encoder: ThinkerEncoder, sizes: tuple[int, ...]) -> None:
        self.encoder = encoder
        self.sizes = tuple(sorted(sizes))
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture_all(self) -> None:
        for rows in sorted({1, self.encoder.max_rows}):
            for size in self.sizes:
                self._graph(rows, size)

    def fuse(self, embeds: Tensor) -> Tensor | None:  # [b, nt, d] -> [b, nt, d] fp32, or None when too long
        b, nt = embeds.shape[:2]
        size = next((s for s in self.sizes if s >= nt), None)
        if size is None or b > self.encoder.max_rows:
            return None
        graph, static_in, static_out = self._graph(1 if b == 1 else self.encoder.max_rows, size)
        static_in.zero_()
        static_in[:b, :nt].copy_(embeds)
        graph.replay()
        return static_out[:b, :nt].clone()

    def _graph(self, rows: int, size: int) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor]:
        if (rows, size) not in self.graphs:
            weight = self.encoder.trunk.model.embed_tokens.weight
            static_in = torch.zeros(rows, size, weight.shape[1], device=weight.device, dtype=weight.dtype)
            fuse = lambda: self.encoder.fuse(static_in)  # noqa: E731
            graph, static_out = capture_graph(fuse, weight.device, self.pool, warmups=2)
            self.graphs[rows, size] = (graph, static_in, static_out)
        return self.graphs[rows, size]


class _CoreGraph:
    """``core`` for one chunk count captured as a CUDA graph, with the static inputs it reads."""

    def __init__(self, runner: AudioTowerRunner, chunks: int, pool: object) -> None:
        device = runner.device
        w = 2 * runner.n_window
        self.features = torch.zeros(chunks, runner.num_mel_bins, w, device=device, dtype=runner.dtype)
        self.chunk_frames = torch.full((chunks,), w, dtype=torch.long, device=device)
        self.graph, self.out = capture_graph(  # out [p, do]
            lambda: runner.core(self.features, self.chunk_frames), device, pool, warmups=2
        )

    def run(self, features: Tensor, chunk_frames: Tensor) -> Tensor:
        self.features.copy_(features)
        self.chunk_frames.copy_(chunk_frames)
        self.graph.replay()
        return self.out


class AudioTowerGraphs:
    """``AudioTowerRunner`` with ``core`` replayed from one CUDA graph per chunk count, captured on first use or
    ahead by ``capture`` / ``capture_up_to``; all graphs share one memory pool. Off CUDA the core runs eager."""

    def __init__(self, runner: AudioTowerRunner) -> None:
        self.runner = runner
        self.graphs: dict[int, _CoreGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if runner.device.type == "cuda" else None

    @torch.inference_mode()  # like every call: the static buffers are then written in the mode they were made in
    def capture(self, chunks: int) -> None:
        if self.pool is None or chunks in self.graphs:
            return
        self.graphs[chunks] = _CoreGraph(self.runner, chunks, self.pool)
        logger.info("audio tower graphs: captured %d chunks (%d cached)", chunks, len(self.graphs))

    def capture_up_to(self, max_chunks: int) -> None:
        """Every chunk count 1..max_chunks (15 covers the feature extractor's 30 s at n_window 100)."""
        for chunks in range(1, max_chunks + 1):
            self.capture(chunks)

    @torch.inference_mode()
    def __call__(self, input_features: Tensor, feature_attention_mask: Tensor) -> Tensor:
        features, chunk_frames, plan = self.runner.prepare(input_features, feature_attention_mask)
        if self.pool is None:
            return self.runner.core(features, chunk_frames)[: plan.audio_tokens]  # [na, do]
        self.capture(plan.chunks)
        return self.graphs[plan.chunks].run(features, chunk_frames)[: plan.audio_tokens].clone()  # [na, do]


class LogMelGraphs:
    """The prompt processor's log-mel features replayed from one CUDA graph per bucket of padded clip length.

    A clip goes into a zero buffer of whole ``bucket_samples`` (at most the feature extractor's window) and the
    graph runs ``PromptProcessor.log_mel`` over all of it; the processor keeps the clip's frames, which equal
    those of its own shorter padding (see there). ``capture_up_to`` takes every bucket of the clips the service
    accepts at start-up (31 of a second each for 30 s).
    """

    def __init__(self, processor: PromptProcessor, device: torch.device, bucket_samples: int) -> None:
        self.processor = processor
        self.device = device
        self.bucket_samples = bucket_samples
        self.max_samples = processor.feature_extractor.n_samples
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture_up_to(self, clip_samples: int) -> None:
        """Every bucket a clip of up to ``clip_samples`` samples can need (the processor pads it by n_fft)."""
        padded = clip_samples + self.processor.feature_extractor.n_fft
        for bucket in range(self.bucket_samples, padded + self.bucket_samples, self.bucket_samples):
            self._graph(self._bucket(bucket))

    def log_mel(self, audio: np.ndarray, padded: int) -> Tensor:
        """``log_mel`` of ``audio`` zero-padded to at least ``padded`` samples: [m, >= padded / hop] (a copy)."""
        graph, static_wave, static_out = self._graph(self._bucket(padded))
        static_wave.zero_()
        static_wave[: audio.size].copy_(torch.from_numpy(audio), non_blocking=True)
        graph.replay()
        return static_out.clone()

    def _bucket(self, samples: int) -> int:
        return min(self.max_samples, -(-samples // self.bucket_samples) * self.bucket_samples)

    def _graph(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor]:
        if bucket not in self.graphs:
            static_wave = torch.zeros(bucket, device=self.device)
            graph, static_out = capture_graph(lambda: self.processor.log_mel(static_wave), self.device, self.pool)
            self.graphs[bucket] = (graph, static_wave, static_out)
        return self.graphs[bucket]

