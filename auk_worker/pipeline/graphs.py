"""Stage 1's CUDA graph runners: DiT steps replayed from per-shape graphs, VAE decodes and reference encodes from
per-length graphs.

Nothing here changes what is computed; it changes how the kernels are launched:

- ``StepGraphs`` captures one whole guided Euler step (DiT forward over the cond and uncond rows, the CFG
  combine, the fp32 state update) as a CUDA graph per shape (rows, target, text, reference, which masks exist,
  which kernels the context runs). The time grid, the step index and the guidance scale live in device buffers
  that the graph reads, and the step index advances inside the graph, so one graph serves every step and every
  schedule: a render copies its context in once and replays the graph ``num_steps`` times. The adaLN modulation
  rows of the whole grid are computed once per render (``ModulationTable``) and the graph reads its step's row.
  At most ``max_dit_graphs`` are kept; a full cache is retired whole before a new capture (the deploy config's
  rule). The graphs replay whatever the DiT's slots hold when captured: its compiled blocks and its text stream
  (set by the wiring).
- ``DecodeGraphs`` replays the VAE decoder per latent length (LRU of ``auk_vae_max_graphs``); the configured
  buckets are captured at start-up, and the pipeline tiles longer clips with the largest bucket.
- ``EncodeGraphs`` replays the VAE encoder over reference clips zero-padded to whole seconds, exactly (the
  encoder cuts each conv output back to the clip's own length).

Eager and graph paths use the same modules and the same fp32 state arithmetic; the remaining difference comes
from compiled kernels (fused reductions round differently) and is measured by the GPU tests.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from auk_worker.model.dit import AuKDiT, DiTContext
from auk_worker.model.sampling import cfg_combine
from auk_worker.model.vae import AuKVAE
from auk_worker.pipeline.cuda_graph import capture_graph
from auk_worker.rules import MAX_STEPS

log = logging.getLogger(__name__)

StepCallback = Callable[[int, int], None]
MODULATION_STEPS = 64  # steps of adaLN rows held at once (about 48 MB in bf16 at release size)


def _leaves(obj: object) -> Iterator[Tensor | None]:
    """Every tensor (or None) of a nested dataclass, in field order."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value)
        elif isinstance(value, Tensor) or value is None:
            yield value


def _settings(obj: object) -> Iterator[object]:
    """Every value of a nested dataclass that is neither a tensor nor None (the cfg flag, the kernels a layout
    runs, the target length)."""
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


class StepGraphs:
    """Per-shape CUDA graphs of a guided Euler step, at most ``max_graphs`` at a time."""

    def __init__(self, dit: AuKDiT, max_graphs: int) -> None:
        self.dit = dit
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _StepGraph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()
        self.table = ModulationTable(dit, MODULATION_STEPS)

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

    def __init__(self, vae: AuKVAE, max_graphs: int) -> None:
        self.vae = vae
        self.max_graphs = max_graphs
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
