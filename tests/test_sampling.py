"""The sampler functions: time grids, Euler steps, CFG, noise drawn from per-job generators."""

from __future__ import annotations

import math

import pytest
import torch

from auk_worker.errors import InputError, ModelError
from auk_worker.model.dit import AuKDiT, DiTConfig
from auk_worker.model.sampling import (
    FLASH_T_GRID,
    cfg_combine,
    euler_sample,
    guided_velocity,
    initial_noise,
    make_generator,
    needs_uncond,
    time_grid,
    validate_grid,
)

TINY = DiTConfig(
    dim=64, heads=4, dim_head=16, ff_mult=2.0, text_hidden_dim=32, latent_dim=64, num_layers=1, num_single_layers=1
)

# ---- time grids --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 4, 32])
def test_sway_minus_one_is_one_minus_cosine(steps: int) -> None:
    u = torch.arange(steps + 1, dtype=torch.float64) / steps
    grid = time_grid(steps, -1.0)
    assert grid.dtype == torch.float32 and grid.shape == (steps + 1,)
    torch.testing.assert_close(grid.double(), 1 - torch.cos(math.pi * u / 2), rtol=0, atol=1e-6)


def test_sway_zero_and_none_are_linspace() -> None:
    linspace = torch.linspace(0, 1, 33, dtype=torch.float32)
    assert torch.equal(time_grid(32, 0.0), linspace)
    assert torch.equal(time_grid(32, None), linspace)


def test_flash_grid_is_the_four_step_sway_grid() -> None:
    torch.testing.assert_close(time_grid(4, -1.0), torch.tensor(FLASH_T_GRID), rtol=0, atol=1e-7)
    assert torch.equal(validate_grid(FLASH_T_GRID), torch.tensor(FLASH_T_GRID, dtype=torch.float32))


@pytest.mark.parametrize(("steps", "sway", "field"), [
    (0, -1.0, "num_inference_steps"), (1001, -1.0, "num_inference_steps"), (True, -1.0, "num_inference_steps"),
    (4.0, -1.0, "num_inference_steps"), (4, 0.5, "sway"), (4, -1.5, "sway"), (4, float("nan"), "sway"),
])
def test_time_grid_rejects_out_of_range_knobs(steps, sway, field: str) -> None:
    with pytest.raises(InputError, match=field):
        time_grid(steps, sway)


@pytest.mark.parametrize(("grid", "problem"), [
    ([0.0], "at least 2"), ([0.0, 0.5, 0.5, 1.0], "increasing"), ([0.0, 0.7, 0.3, 1.0], "increasing"),
    ([0.1, 1.0], "start at 0"), ([0.0, 0.9], "end at 1"), ([0.0, float("nan"), 1.0], "finite"),
])
def test_validate_grid_rejects_bad_grids(grid: list[float], problem: str) -> None:
    with pytest.raises(InputError, match=problem):
        validate_grid(grid)


# ---- Euler and CFG -----------------------------------------------------------------------------------------------


def test_cfg_combine() -> None:
    cond, uncond = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])
    assert torch.equal(cfg_combine(cond, uncond, 2.0), torch.tensor([2.0, 0.0]))
    assert torch.equal(cfg_combine(cond, uncond, 0.0), cond)
    assert needs_uncond(2.0) and not needs_uncond(0.0) and not needs_uncond(5e-6)


def test_euler_with_constant_velocity_lands_on_x0_plus_v() -> None:
    x0 = torch.tensor([[[1.0, -2.0, 0.5]]])
    v = torch.tensor([[[0.25, 3.0, -1.0]]])
    calls: list[tuple[int, int]] = []
    seen: list[tuple[float, int, torch.dtype]] = []

    def velocity(x: torch.Tensor, t: torch.Tensor, step: int) -> torch.Tensor:
        seen.append((float(t), step, x.dtype))
        return v.to(torch.bfloat16)  # a low-precision model output is accumulated in fp32

    out = euler_sample(velocity, x0, time_grid(4, None), on_step=lambda k, n: calls.append((k, n)))
    assert torch.equal(out, x0 + v) and out.dtype == torch.float32
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert seen == [(0.0, 0, torch.float32), (0.25, 1, torch.float32), (0.5, 2, torch.float32),
                    (0.75, 3, torch.float32)]
    swayed = euler_sample(lambda x, t, i: v, x0, time_grid(32, -1.0))
    torch.testing.assert_close(swayed, x0 + v, rtol=0, atol=1e-6)


def test_euler_steps_are_the_grid_differences() -> None:
    grid = torch.tensor([0.0, 0.1, 0.5, 1.0])
    out = euler_sample(lambda x, t, i: x, torch.ones(1, 1, 1), grid)  # dx/dt = x
    assert out.item() == pytest.approx(1.1 * 1.4 * 1.5, rel=1e-6)


def test_raising_from_on_step_cancels() -> None:
    steps: list[int] = []

    class Stop(Exception):
        pass

    def on_step(k: int, total: int) -> None:
        if k == 2:
            raise Stop

    with pytest.raises(Stop):
        euler_sample(lambda x, t, i: steps.append(i) or x, torch.zeros(1, 2, 3), time_grid(8, -1.0), on_step)
    assert steps == [0, 1]


# ---- noise -------------------------------------------------------------------------------------------------------


def test_noise_is_reproducible_per_seed_and_leaves_the_global_rng_alone() -> None:
    before = torch.get_rng_state()
    a = initial_noise(50, 64, make_generator(1234, "cpu"), "cpu")
    b = initial_noise(50, 64, make_generator(1234, "cpu"), "cpu")
    c = initial_noise(50, 64, make_generator(1235, "cpu"), "cpu")
    assert torch.equal(torch.get_rng_state(), before)
    assert a.shape == (1, 50, 64) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_noise_matches_the_upstream_global_seed_draw() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(77)
        upstream = torch.randn(30, 64, dtype=torch.float32).unsqueeze(0)
    assert torch.equal(initial_noise(30, 64, make_generator(77, "cpu")), upstream)


def test_noise_needs_a_generator() -> None:
    with pytest.raises(TypeError):
        initial_noise(10, 64, None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="num_frames"):
        initial_noise(0, 64, make_generator(0, "cpu"))


# ---- guided velocity over a real (tiny) DiT ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dit() -> AuKDiT:
    torch.manual_seed(0)
    return AuKDiT(TINY).eval()


def _context(dit: AuKDiT, cfg: bool):
    gen = torch.Generator().manual_seed(5)
    text, ref = torch.randn(1, 4, 32, generator=gen), torch.randn(1, 3, 64, generator=gen)
    return dit.prepare(text, torch.tensor([4]), ref, None, None, 6, cfg=cfg)


def test_guided_velocity_combines_one_doubled_forward(dit: AuKDiT) -> None:
    x = initial_noise(6, 64, make_generator(3, "cpu"))
    with torch.no_grad():
        ctx = _context(dit, cfg=True)
        raw = dit(x, torch.tensor(0.2), ctx)
        v = guided_velocity(dit, ctx, 2.0)(x, torch.tensor(0.2), 0)
        plain_ctx = _context(dit, cfg=False)
        plain = guided_velocity(dit, plain_ctx, 0.0)(x, torch.tensor(0.2), 0)
    assert v.shape == (1, 6, 64) and v.dtype == torch.float32
    torch.testing.assert_close(v, raw[:1] + 2.0 * (raw[:1] - raw[1:]), rtol=0, atol=0)
    torch.testing.assert_close(plain, raw[:1], rtol=0, atol=1e-6)
    with pytest.raises(ModelError, match="cfg"):
        guided_velocity(dit, ctx, 0.0)
    with pytest.raises(ModelError, match="cfg"):
        guided_velocity(dit, plain_ctx, 2.0)


def test_a_short_render_runs_end_to_end(dit: AuKDiT) -> None:
    calls: list[tuple[int, int]] = []
    with torch.no_grad():
        ctx = _context(dit, cfg=needs_uncond(2.0))
        out = euler_sample(guided_velocity(dit, ctx, 2.0), initial_noise(6, 64, make_generator(9, "cpu")),
                           time_grid(4, -1.0), on_step=lambda k, n: calls.append((k, n)))
    assert out.shape == (1, 6, 64) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
