"""The GPU fast path: DiT steps replayed from per-shape CUDA graphs, VAE decodes replayed from per-length graphs.

Nothing here changes what is computed; it changes how the kernels are launched:

- ``StepGraphs`` captures one whole guided Euler step (DiT forward over the cond and uncond rows, the CFG
  combine, the fp32 state update) as a CUDA graph per shape (rows, target, text, reference, which masks exist).
  The time grid, the step index and the guidance scale live in device buffers that the graph reads, and the
  step index advances inside the graph, so one graph serves every step and every schedule: a render copies its
  context in once and replays the graph ``num_steps`` times. The adaLN modulation rows of the whole grid are
  computed once per render (``ModulationTable``) and the graph reads its step's row. At most ``max_dit_graphs``
  are kept; a full cache is retired whole before a new capture (the deploy config's rule).
- The repeated blocks are compiled (regional ``torch.compile`` of each block phase) before capture when
  ``compile_blocks`` is set, so the graph replays fused kernels. The double blocks' text stream runs on a second
  CUDA stream beside the audio stream: at latency sizes neither stream fills the GPU alone.
- ``EncoderGraphs`` replays the thinker's text model and the layer fusion at the deploy config's prompt sizes,
  for one prompt and for a pass of several.
- ``DecodeGraphs`` replays the VAE decoder per latent length (LRU of ``auk_vae_max_graphs``); the configured
  buckets are captured at start-up, and the pipeline tiles longer clips with the largest bucket. Each stage's
  three AMP blocks run side by side on CUDA streams.
- ``LogMelGraphs`` replays the prompt processor's log-mel features of a reference clip per whole second of it.
- ``EncodeGraphs`` replays the VAE encoder over reference clips zero-padded to whole seconds, exactly (the
  encoder cuts each conv output back to the clip's own length).

Eager and graph paths use the same modules and the same fp32 state arithmetic; the remaining difference comes
from compiled kernels (fused reductions round differently) and is measured by the GPU tests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from auk_worker.cuda_graph import capture_graph
from auk_worker.model.dit import PLAIN_PHASES, AuKDiT, DiTContext
from auk_worker.model.encoder import PromptProcessor, ThinkerEncoder
from auk_worker.model.sampling import MAX_STEPS, cfg_combine
from auk_worker.model.vae import AuKVAE

log = logging.getLogger(__name__)

StepCallback = Callable[[int, int], None]
MODULATION_STEPS = 64  # steps of adaLN rows held at once (about 48 MB in bf16 at release size)

# cuBLAS handles without a workspace. With one, cuBLAS picks for some of the DiT's shapes (the single blocks'
# feed-forward input at 12 s zero-shot, every block linear of a bulk pass) a persistent kernel that needs a zeroed
# 4-byte counter: a memset node before each such product in the step graph, with about 9 µs of idle GPU around it,
# 20 times a step at 12 s zero-shot. Without a workspace it runs the same tiles statically scheduled, no memset.
# torch reads both variables once, at the process's first matrix product on a GPU.
CUBLAS_WITHOUT_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


def cublas_without_workspace() -> dict[str, str]:
    """Ask for cuBLAS handles without a workspace where the environment does not say otherwise; returns the two
    settings now in the environment. Call before the process's first matrix product on the GPU (``AuKPipeline``
    does, as it is built): torch keeps the workspace size it read then."""
    for name, value in CUBLAS_WITHOUT_WORKSPACE.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in CUBLAS_WITHOUT_WORKSPACE}


def _leaves(obj: object) -> Iterator[Tensor | None]:
    """Every tensor (or None) of a nested dataclass, in field order."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value)
        elif isinstance(value, Tensor) or value is None:
            yield value


def _settings(obj: object) -> Iterator[object]:
    """Every value of a nested dataclass that is not a tensor (flags such as a layout's kernel switches)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _settings(value)
        elif not isinstance(value, Tensor) and value is not None:
            yield value


def _signature(ctx: DiTContext) -> tuple:
    """What a captured graph depends on: the context's settings, and the shape and dtype of every context tensor
    (None where absent)."""
    return tuple(_settings(ctx)) + tuple(None if t is None else (tuple(t.shape), t.dtype) for t in _leaves(ctx))


class ModulationTable:
    """The adaLN modulation rows of up to ``capacity`` consecutive steps, shared by every step graph.

    The rows depend on t alone (:meth:`AuKDiT.modulation`), so a render computes them for its grid in one batched
    pass instead of re-reading all the modulation weights (about a third of the DiT's) at every step. A graph reads
    row ``row`` and advances it; renders with more steps than ``capacity`` refill the table window by window.
    The rows of the last few grids are kept, so a render on a recurring schedule only copies them in.
    """

    def __init__(self, dit: AuKDiT, capacity: int, cached_grids: int = 4) -> None:
        width = sum(dit.modulation_widths)
        self.dit = dit
        self.capacity = capacity
        self.rows = torch.zeros(capacity, width, device=dit.device, dtype=dit.dtype)
        self.row = torch.zeros(1, dtype=torch.long, device=dit.device)
        self.cached_grids = cached_grids
        self.cache: OrderedDict[tuple[float, ...], Tensor] = OrderedDict()

    def fill(self, times: Tensor) -> None:  # times [k <= capacity] fp32, on the host (read there without a sync)
        key = tuple(times.tolist())
        rows = self.cache.get(key)
        if rows is None:
            rows = self.dit.modulation(times.to(self.dit.device, non_blocking=True))  # [k, width]
            self.cache[key] = rows
            while len(self.cache) > self.cached_grids:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        self.rows[: times.numel()].copy_(rows)
        self.row.zero_()

    def next(self) -> Tensor:  # [1, width]; call only inside a step
        current = self.rows.index_select(0, self.row)
        self.row.add_(1)
        return current


class _StepGraph:
    def __init__(self, dit: AuKDiT, ctx: DiTContext, rows: int, table: ModulationTable, pool: object) -> None:
        device = dit.device
        self.ctx = _clone_ctx(ctx)  # static copy the graph reads; refreshed per render
        self.x = torch.zeros(rows, ctx.target_len, dit.config.latent_dim, device=device)  # fp32 ODE state
        self.grid = torch.zeros(MAX_STEPS + 1, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # [1]: index_select keeps it on the device
        self.scale = torch.zeros((), device=device)
        self.table = table
        self._dit = dit

        def warm_up() -> None:  # from step 0 each time; compiles, picks kernels, allocates workspaces
            self.step.zero_()
            self.table.row.zero_()
            self._body()

        self.graph, _ = capture_graph(self._body, device, pool, warmups=3, warm_up=warm_up)

    def _body(self) -> None:
        t = self.grid.index_select(0, self.step).squeeze(0)  # 0-d, read on the device (no host sync)
        dt = self.grid.index_select(0, self.step + 1).squeeze(0) - t
        v = self._dit(self.x.to(self._dit.dtype), t, self.ctx, modulation=self.table.next())
        if self.ctx.cfg:
            v_cond, v_uncond = v.chunk(2, dim=0)
            v = cfg_combine(v_cond, v_uncond, self.scale.to(v.dtype))
        self.x.add_(dt * v.float())
        self.step.add_(1)

    def run(self, ctx: DiTContext, x0: Tensor, grid: Tensor, scale: float, on_step: StepCallback | None) -> Tensor:
        for static, fresh in zip(_leaves(self.ctx), _leaves(ctx)):
            if static is not None:
                static.copy_(fresh)
        self.x.copy_(x0)
        total = grid.numel() - 1
        self.grid[: total + 1].copy_(grid, non_blocking=True)
        self.step.zero_()
        self.scale.fill_(scale)
        # A replay returns at once; without pacing the loop would queue every step in a few milliseconds and
        # report progress (and check for a cancel) long before the GPU got there. With a callback, step k is
        # reported once it has finished, while step k + 1 is already queued, so the GPU never waits on the host.
        finished = [torch.cuda.Event() for _ in range(total)] if on_step is not None else []
        for i in range(total):
            if i % self.table.capacity == 0:
                self.table.fill(grid[i : min(i + self.table.capacity, total)])
            self.graph.replay()
            if on_step is not None:
                finished[i].record()
                if i > 0:
                    finished[i - 1].synchronize()
                    on_step(i, total)
        if finished:
            finished[-1].synchronize()
            on_step(total, total)
        return self.x.clone()


def _clone_ctx(ctx: DiTContext) -> DiTContext:
    def clone(value: object) -> object:
        if dataclasses.is_dataclass(value):
            return dataclasses.replace(value, **{f.name: clone(getattr(value, f.name)) for f in dataclasses.fields(value)})
        return value.clone() if isinstance(value, Tensor) else value

    return clone(ctx)  # type: ignore[return-value]


# Compilations a block phase may hold. Dynamo compiles a phase again for each layout the graph path meets: padded
# audio, text or keys present or not, one row or several, the precision's module types. These multiply past
# dynamo's default of 8, and with ``fullgraph`` the ninth raises inside a job instead of falling back.
BLOCK_COMPILATIONS = 64


def compile_dit_blocks(dit: AuKDiT, dynamic: bool = True, backend: str = "inductor") -> None:
    """Regional ``torch.compile`` of the repeated blocks: each block phase (``BlockPhases``) is compiled once and
    serves every block. Dynamic shapes: one compilation serves every sequence length, so a new shape costs a
    capture, not a recompile."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, BLOCK_COMPILATIONS)
    dit.phases = PLAIN_PHASES.compiled(fullgraph=True, dynamic=dynamic, backend=backend)


class StepGraphs:
    """Per-shape CUDA graphs of a guided Euler step, at most ``max_graphs`` at a time."""

    def __init__(
        self, dit: AuKDiT, max_graphs: int, compile_blocks: bool = True, dynamic: bool = True, text_stream: bool = True
    ) -> None:
        self.dit = dit
        # The double blocks' text stream beside the audio stream, in every captured step.
        dit.text_stream = torch.cuda.Stream(dit.device) if text_stream else None
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _StepGraph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()
        self.table = ModulationTable(dit, MODULATION_STEPS)
        if compile_blocks:
            compile_dit_blocks(dit, dynamic=dynamic)

    def sample(
        self, ctx: DiTContext, x0: Tensor, grid: Tensor, guidance_scale: float, on_step: StepCallback | None = None
    ) -> Tensor:
        """The Euler solve over ``grid`` [steps + 1] (best on the host: the step graph reads it without a sync)
        from ``x0``, with this context's graph (captured first if new)."""
        key = _signature(ctx)
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= self.max_graphs:
                log.info("dit graphs: cache full (%d), retiring every graph", len(self.graphs))
                self.graphs.clear()
                self.pool = torch.cuda.graph_pool_handle()
            graph = _StepGraph(self.dit, ctx, x0.shape[0], self.table, self.pool)
            self.graphs[key] = graph
            log.info("dit graphs: captured %s (%d cached)", _describe(ctx, x0), len(self.graphs))
        return graph.run(ctx, x0, grid.to(dtype=torch.float32).cpu(), guidance_scale, on_step)


def _describe(ctx: DiTContext, x0: Tensor) -> str:
    ref = 0 if ctx.ref is None else ctx.ref.shape[1]
    return f"rows={x0.shape[0]} target={ctx.target_len} text={ctx.text.shape[1]} ref={ref} cfg={ctx.cfg}"


class DecodeGraphs:
    """VAE decodes replayed from one CUDA graph per latent length (LRU of ``max_graphs``)."""

    def __init__(self, vae: AuKVAE, max_graphs: int, branch_streams: bool = True) -> None:
        self.vae = vae
        self.max_graphs = max_graphs
        # A stage's AMP blocks side by side, in every captured decode.
        device = vae.global_mean.device
        vae.branch_streams = [torch.cuda.Stream(device) for _ in range(vae.blocks_per_stage - 1)] if branch_streams else None
        self.graphs: OrderedDict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()

    def decode(self, latents: Tensor) -> Tensor:  # [b, n, l] -> [b, n * 480]
        key = (latents.shape[0], latents.shape[1])
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(latents)
            while len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
            self.graphs[key] = entry
        else:
            self.graphs.move_to_end(key)
        graph, static_in, static_out = entry
        static_in.copy_(latents)
        graph.replay()
        return static_out.clone()

    def _capture(self, latents: Tensor) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor]:
        static_in = latents.clone()
        graph, static_out = capture_graph(lambda: self.vae.decode(static_in), latents.device, self.pool)
        return graph, static_in, static_out


class EncodeGraphs:
    """The VAE encoder (reference clips) replayed from one CUDA graph per padded clip length.

    A clip is zero-padded to the next multiple of ``bucket_samples`` and encoded with its true length, which cuts
    every conv output back to what the clip alone gives (see ``Encoder.forward``), so the frames kept equal an
    unpadded encode. The length rule bounds the buckets (30 at 1 s), so every graph is kept; ``capture_up_to``
    takes them at start-up. The posterior draw (``sample``) runs after the graph, on the kept frames.
    """

    def __init__(self, vae: AuKVAE, bucket_samples: int) -> None:
        self.vae = vae
        self.bucket_samples = bucket_samples
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture_up_to(self, samples: int) -> None:
        for bucket in range(self.bucket_samples, samples + self.bucket_samples, self.bucket_samples):
            self._graph(bucket)

    def encode(self, wav: Tensor, sample: bool = False, generator: torch.Generator | None = None) -> Tensor:
        """``AuKVAE.encode`` for one clip [1, t] -> [1, n, d]; anything else takes the eager encode."""
        t = wav.shape[-1]
        if wav.dim() != 2 or wav.shape[0] != 1 or t < self.vae.hop:
            return self.vae.encode(wav, sample=sample, generator=generator)  # which names what is wrong
        graph, static_wav, static_len, static_stats = self._graph(-(-t // self.bucket_samples) * self.bucket_samples)
        static_wav.zero_()
        static_wav[:, :t].copy_(wav)
        static_len.fill_(t)
        graph.replay()
        stats = static_stats[..., : self.vae.encoded_frames(t)].clone()  # [1, 2d, n]
        return self.vae.latents(stats, sample=sample, generator=generator)

    def _graph(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]:
        if bucket not in self.graphs:
            device = self.vae.global_mean.device
            static_wav = torch.zeros(1, bucket, device=device)
            static_len = torch.full((1,), bucket, dtype=torch.long, device=device)

            def run() -> Tensor:
                with torch.autocast(device_type="cuda", enabled=False):
                    # A clip in this bucket leaves fewer than bucket_samples of padding.
                    return self.vae.audio_encoder(
                        static_wav[:, None, :].to(self.vae.dtype), static_len, self.bucket_samples
                    )

            graph, static_stats = capture_graph(run, device, self.pool)  # [1, 2d, frames of the bucket]
            self.graphs[bucket] = (graph, static_wav, static_len, static_stats)
            log.info("vae encode graphs: captured %d samples (%d cached)", bucket, len(self.graphs))
        return self.graphs[bucket]


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
