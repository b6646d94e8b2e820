"""Stage 1 sampler: small pure functions for AuK's rectified-flow Euler solver (auk-model.md section 4).

t = 0 is noise and t = 1 is data. The ODE state is the target latents only, kept in fp32; the velocity comes from
the DiT (see :mod:`auk_worker.model.dit`) and is cast to fp32 before each step:
``x_{i+1} = x_i + (t_{i+1} - t_i) * v(x_i, t_i)``. Base AuK uses the sway grid with CFG; Flash uses
:data:`FLASH_T_GRID` without guidance.

Shapes: b requests, n target frames, l latent channels (64).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from auk_worker.errors import InputError, ModelError
from auk_worker.rules import STEPS, SWAY

if TYPE_CHECKING:
    from auk_worker.model.dit import AuKDiT, DiTContext

# AuK-Flash's fixed 4-step grid (equal to the sway -1 grid for 4 steps: 1 - cos(k * pi / 8)).
FLASH_T_GRID = (0.0, 0.07612049579620361, 0.2928932309150696, 0.6173166036605835, 1.0)

# Below this guidance scale the unconditional branch is skipped entirely (as upstream does).
MIN_GUIDANCE = 1e-5

VelocityFn = Callable[[Tensor, Tensor, int], Tensor]  # (x [b, n, l] fp32, t 0-d fp32, step index) -> v
StepCallback = Callable[[int, int], None]  # (steps done, total steps)


def time_grid(num_steps: int, sway: float | None, device: torch.device | str | None = None) -> Tensor:
    """fp32 grid [num_steps + 1]: u = linspace(0, 1), bent by sway s as u + s * (cos(pi u / 2) - 1 + u)."""
    STEPS.check(num_steps)
    if sway is not None:
        SWAY.check(sway)
    u = torch.linspace(0, 1, num_steps + 1, dtype=torch.float32, device=device)
    if sway is None:
        return u
    return u + sway * (torch.cos(torch.pi / 2 * u) - 1 + u)


def validate_grid(grid: Sequence[float] | Tensor) -> Tensor:
    """Check an explicit time grid (>= 2 points, strictly increasing, from 0 to 1); return it as fp32."""
    values = torch.as_tensor(grid, dtype=torch.float32).flatten().cpu()
    if values.numel() < 2:
        raise InputError(f"t_grid needs at least 2 points, got {values.numel()}")
    if not bool(torch.isfinite(values).all()):
        raise InputError("t_grid must be finite")
    if not bool((values[1:] > values[:-1]).all()):
        raise InputError("t_grid must be strictly increasing")
    if values[0].item() != 0.0 or values[-1].item() != 1.0:
        raise InputError(f"t_grid must start at 0 and end at 1, got {values[0].item()} .. {values[-1].item()}")
    return torch.as_tensor(grid, dtype=torch.float32).flatten()


def cfg_combine(v_cond: Tensor, v_uncond: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance: v_cond + scale * (v_cond - v_uncond)."""
    return v_cond + scale * (v_cond - v_uncond)


def needs_uncond(guidance_scale: float) -> bool:
    """Whether the context must carry the unconditional rows (``cfg=`` of ``AuKDiT.prepare``)."""
    return guidance_scale >= MIN_GUIDANCE


def euler_sample(velocity_fn: VelocityFn, x0: Tensor, grid: Tensor, on_step: StepCallback | None = None) -> Tensor:
    """Integrate from x0 (noise at grid[0]) to grid[-1]; the state stays fp32.

    ``on_step(k, total)`` runs after step k (1-based); raising from it cancels the solve."""
    grid = grid.to(device=x0.device, dtype=torch.float32)
    total = grid.numel() - 1
    x = x0.to(torch.float32)
    for i in range(total):
        v = velocity_fn(x, grid[i], i).to(torch.float32)
        x = x + (grid[i + 1] - grid[i]) * v
        if on_step is not None:
            on_step(i + 1, total)
    return x


def guided_velocity(dit: AuKDiT, ctx: DiTContext, guidance_scale: float) -> VelocityFn:
    """Velocity function for :func:`euler_sample`: one DiT forward over the context's rows, combined with CFG
    in the DiT dtype when the context carries unconditional rows, then cast to fp32."""
    if not math.isfinite(guidance_scale) or guidance_scale < 0:
        raise InputError(f"guidance_scale must be a finite number >= 0, got {guidance_scale!r}")
    if ctx.cfg != needs_uncond(guidance_scale):
        raise ModelError(
            f"context built with cfg={ctx.cfg} does not match guidance_scale {guidance_scale}; "
            "prepare it with cfg=needs_uncond(guidance_scale)"
        )

    def velocity(x: Tensor, t: Tensor, step: int) -> Tensor:
        v = dit(x, t, ctx)  # [bc, n, l]
        if ctx.cfg:
            v_cond, v_uncond = v.chunk(2, dim=0)
            v = cfg_combine(v_cond, v_uncond, guidance_scale)
        return v.to(torch.float32)

    return velocity


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A per-job generator on ``device``; drawing from it matches upstream's ``torch.manual_seed(seed)`` draw."""
    return torch.Generator(device=device).manual_seed(seed)


def initial_noise(
    num_frames: int, latent_dim: int, generator: torch.Generator, device: torch.device | str | None = None
) -> Tensor:
    """fp32 noise [1, n, l], drawn as upstream does (randn(n, l) then unsqueeze); never from the global RNG."""
    if not isinstance(generator, torch.Generator):
        raise TypeError("initial_noise needs a torch.Generator; the global RNG is never used")
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise InputError(f"num_frames must be a positive integer, got {num_frames!r}")
    device = generator.device if device is None else device
    noise = torch.randn((num_frames, latent_dim), generator=generator, dtype=torch.float32, device=device)
    return noise.unsqueeze(0)  # [n, l] -> [1, n, l]
