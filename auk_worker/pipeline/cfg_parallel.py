"""Two devices for one guided render: the conditional rows of every DiT step on one, the unconditional rows on the
other (``cfg_parallel_size: 2`` in the deploy config's DiT stage, whose ``devices`` then name two GPUs).

A base render spends almost all its time in guided DiT steps, each a pass over the conditional rows and the
unconditional rows of the same latent. Here the worker's own process (rank 0, the leader: thinker, VAE, DiT) runs
the conditional rows on the first device and a follower process (rank 1: the DiT alone) runs the unconditional rows
on the second. After each step's forward the two exchange their velocities (one ``all_gather`` of [b, n, l]: NCCL
between GPUs, gloo on the CPU), both combine them with the CFG formula and both take the same Euler step, so the
latent itself never travels and the two stay in step without further messages.

Protocol, per DiT pass: the leader broadcasts a header (shapes, lengths, grid, scale) and the pass's tensors (fused
text condition, reference latents, noise), then both ranks solve. A pass has a fixed number of exchanges (its
steps), so a cancel never leaves the follower waiting: the leader that is told to stop keeps answering the
remaining exchanges without running its half, then raises. A rank whose forward fails (out of memory, say) answers
the rest of the pass's exchanges with non-finite velocities: the leader then raises its own error, or its result
check turns the follower's into a ``ModelError`` for those jobs.
``close`` sends an empty header, on which the follower returns.

The conditional half is exactly the doubled context's conditional rows (``AuKDiT.prepare(branch=...)``); what can
differ from a one-device render is only the matrix kernels' choice for b rows against 2b.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from auk_worker.checkpoint import read_release
from auk_worker.deploy import DeployConfig
from auk_worker.model.dit import AuKDiT
from auk_worker.checkpoint import load_dit
from auk_worker.model.sampling import StepCallback, cfg_combine, euler_sample
from auk_worker.pipeline.fastpaths import FastPaths, Precision, precision_dtype
from auk_worker.pipeline.wiring import wire_dit

log = logging.getLogger(__name__)

LEADER, FOLLOWER = 0, 1


@dataclass(frozen=True)
class PassHeader:
    """What the follower needs to build its half of a pass's context, besides the tensors that follow."""

    rows: int
    text_tokens: int
    text_dim: int
    ref_frames: int  # 0: no reference
    target_len: int
    text_lens: list[int]
    ref_lens: list[int] | None
    ref_valid_lens: list[int] | None
    target_lens: list[int] | None
    grid: list[float]
    guidance_scale: float


class CfgPair:
    """This process's side of a two-rank CFG group (``torch.distributed``'s default group, world size 2)."""

    def __init__(self, device: torch.device) -> None:
        if not dist.is_initialized() or dist.get_world_size() != 2:
            raise RuntimeError("a CFG pair needs torch.distributed initialised with world size 2")
        self.rank = dist.get_rank()
        self.device = device
        self.process = None  # the follower's process, on the leader that started it

    @classmethod
    def join(cls, rank: int, address: str, device: torch.device, timeout_s: float = 120.0) -> CfgPair:
        """Initialise the group (``address`` is ``host:port`` of the leader's rendezvous) and return this side."""
        from datetime import timedelta

        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s),
                                init_method=f"tcp://{address}")  # fmt: skip
        return cls(device)

    def exchange(self, mine: Tensor) -> tuple[Tensor, Tensor]:
        """Both ranks' velocities, (conditional, unconditional), on every rank."""
        parts = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(parts, mine.contiguous())
        return parts[LEADER], parts[FOLLOWER]

    def velocity(self, dit: AuKDiT, ctx, guidance_scale: float) -> Callable[[Tensor, Tensor, int], Tensor]:
        """The guided velocity with this rank's half computed here and the other half received."""
        state: dict = {"stopped": False, "error": None}

        def velocity(x: Tensor, t: Tensor, step: int) -> Tensor:
            mine = None
            if not state["stopped"] and state["error"] is None:
                try:
                    mine = dit(x, t, ctx)
                except Exception as exc:  # noqa: BLE001 - the peer waits on this step: answer it, report at the end
                    log.exception("cfg pair: rank %d's forward failed; its half of the pass ends non-finite", self.rank)
                    state["error"] = exc
            if mine is None:
                mine = torch.full_like(x, math.nan if state["error"] is not None else 0.0, dtype=dit.dtype)
            v_cond, v_uncond = self.exchange(mine)
            return cfg_combine(v_cond, v_uncond, guidance_scale).to(torch.float32)

        velocity.state = state  # type: ignore[attr-defined]
        return velocity

    # ------------------------------------------------------------------ the leader's side

    def lead(
        self, dit: AuKDiT, prepare_args: dict, x0: Tensor, grid: Tensor, guidance_scale: float,
        on_step: StepCallback | None,
    ) -> Tensor:
        """Send the pass to the follower, then solve the conditional half. ``prepare_args`` are the keyword
        arguments of ``AuKDiT.prepare`` (host length tensors); returns the latents [b, n, l] fp32."""
        text, ref = prepare_args["text"], prepare_args["ref"]

        def listed(name: str) -> list[int] | None:
            value = prepare_args.get(name)
            return None if value is None else [int(v) for v in value]

        header = PassHeader(
            rows=text.shape[0], text_tokens=text.shape[1], text_dim=text.shape[2],
            ref_frames=0 if ref is None else ref.shape[1], target_len=prepare_args["target_len"],
            text_lens=listed("text_lens"), ref_lens=listed("ref_lens"), ref_valid_lens=listed("ref_valid_lens"),
            target_lens=listed("target_lens"), grid=[float(v) for v in grid], guidance_scale=guidance_scale,
        )  # fmt: skip
        dist.broadcast_object_list([asdict(header)], src=LEADER)
        dist.broadcast(text.to(self.device, torch.float32).contiguous(), src=LEADER)
        dist.broadcast(x0.to(self.device, torch.float32).contiguous(), src=LEADER)
        if ref is not None:
            dist.broadcast(ref.to(self.device, torch.float32).contiguous(), src=LEADER)
        ctx = dit.prepare(**prepare_args, cfg=True, branch="cond")
        velocity = self.velocity(dit, ctx, guidance_scale)
        stop: list[BaseException] = []

        def on_step_kept_in_step(done: int, total: int) -> None:
            if on_step is None or stop:
                return
            try:
                on_step(done, total)
            except BaseException as exc:  # noqa: BLE001 - re-raised once the follower has finished the pass
                stop.append(exc)
                velocity.state["stopped"] = True  # type: ignore[attr-defined]

        latents = euler_sample(velocity, x0, grid, on_step=on_step_kept_in_step)
        if velocity.state["error"] is not None:  # type: ignore[attr-defined]
            raise velocity.state["error"]  # type: ignore[attr-defined]
        if stop:
            raise stop[0]
        return latents

    def close(self) -> None:
        """Tell the follower to return and leave the group (leader only); waits for the follower's process."""
        dist.broadcast_object_list([None], src=LEADER)
        dist.destroy_process_group()
        if self.process is not None:
            self.process.join(timeout=30)

    # ------------------------------------------------------------------ the follower's side

    def follow(self, dit: AuKDiT) -> int:
        """Solve the unconditional half of every pass the leader sends until it closes; returns the passes run."""
        passes = 0
        while True:
            box: list[dict | None] = [None]
            dist.broadcast_object_list(box, src=LEADER)
            if box[0] is None:
                return passes
            header = PassHeader(**box[0])
            text = torch.empty(header.rows, header.text_tokens, header.text_dim, device=self.device)
            x0 = torch.empty(header.rows, header.target_len, dit.config.latent_dim, device=self.device)
            dist.broadcast(text, src=LEADER)
            dist.broadcast(x0, src=LEADER)
            ref = None
            if header.ref_frames:
                ref = torch.empty(header.rows, header.ref_frames, dit.config.latent_dim, device=self.device)
                dist.broadcast(ref, src=LEADER)

            def lengths(values: list[int] | None) -> Tensor | None:
                return None if values is None else torch.tensor(values)

            with torch.inference_mode():
                ctx = dit.prepare(
                    text=text, text_lens=lengths(header.text_lens), ref=ref, ref_lens=lengths(header.ref_lens),
                    ref_valid_lens=lengths(header.ref_valid_lens), target_len=header.target_len,
                    target_lens=lengths(header.target_lens), cfg=True, branch="uncond",
                )  # fmt: skip
                grid = torch.tensor(header.grid, dtype=torch.float32)
                euler_sample(self.velocity(dit, ctx, header.guidance_scale), x0, grid)
            passes += 1


# ------------------------------------------------------------------ starting a pair


def follower_device(deploy: DeployConfig, leader: torch.device) -> torch.device:
    """The second of the DiT stage's ``devices`` (the CPU when the leader runs there, as in tests)."""
    indices = [part.strip() for part in deploy.dit.devices.split(",")]
    if leader.type != "cuda":
        return torch.device("cpu")
    return torch.device(f"cuda:{indices[1]}")


def start_pair(
    checkpoint: Path, deploy: DeployConfig, device: torch.device, precision: Precision,
    qwen_path: Path | str | None = None, timeout_s: float = 300.0,
) -> CfgPair:
    """Start the follower process (the DiT alone, on the second device), join it as the leader and return the
    leader's side. The follower exits when the leader closes the pair or its process ends."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    context = torch.multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
    process = context.Process(
        target=_follower_main, name="auk-cfg-follower", daemon=True,
        args=(str(checkpoint), deploy, str(follower_device(deploy, device)), precision, qwen_path, address),
    )  # fmt: skip
    process.start()
    pair = CfgPair.join(LEADER, address, device, timeout_s=timeout_s)
    pair.process = process
    log.info("cfg pair: follower pid %d on %s", process.pid, follower_device(deploy, device))
    return pair


def _follower_main(checkpoint: str, deploy: DeployConfig, device: str, precision: Precision,
                   qwen_path: Path | str | None, address: str) -> None:  # fmt: skip
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    target = torch.device(device)
    release = read_release(checkpoint, qwen_path=qwen_path)
    dit, _ = load_dit(release, target, precision_dtype(precision))
    fast = FastPaths.resolve(deploy, target, precision, release.dit.dim_head)
    wire_dit(dataclasses.replace(fast, step_graphs=False), deploy, dit, target)
    pair = CfgPair.join(FOLLOWER, address, target)
    try:
        passes = pair.follow(dit)
        log.info("cfg pair: the leader closed the pair after %d passes", passes)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
