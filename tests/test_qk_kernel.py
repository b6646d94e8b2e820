"""The q/k kernel (per-head RMSNorm and rotary positions from the qkv projection) against its torch reference,
and the reference against the DiT's own modules. The kernel runs in Triton's CPU interpreter here (a process of
its own: the interpreter is chosen when the kernels are defined) and compiled in tests/test_gpu.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from auk_worker.model.dit import Attention, Rope, RotaryEmbedding
from auk_worker.model.qk_kernel import norm_rope_reference

HEADS, DIM_HEAD = 3, 16
EPS = torch.finfo(torch.float32).eps


def stream(rows: int, m: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """(qkv, q weight, k weight, cos, sin) with rotary tables of real positions."""
    generator = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(rows, m, 3 * HEADS * DIM_HEAD, generator=generator)).to(dtype)
    q_weight, k_weight = (1 + 0.2 * torch.randn(2, DIM_HEAD, generator=generator)).to(dtype).unbind(0)
    rope = RotaryEmbedding(DIM_HEAD).tables(torch.randint(0, 2000, (rows, m), generator=generator))
    return qkv, q_weight, k_weight, rope.cos, rope.sin


def test_reference_is_the_attention_modules_norms_and_rotary() -> None:
    attention = Attention(HEADS * DIM_HEAD, HEADS, DIM_HEAD).requires_grad_(False)
    qkv, q_weight, k_weight, cos, sin = stream(2, 9, torch.float32, seed=1)
    attention.q_norm.weight.copy_(q_weight)
    attention.k_norm.weight.copy_(k_weight)
    rope = Rope(positions=torch.zeros(2, 9, dtype=torch.long), cos=cos, sin=sin)  # only the tables are read
    q, k, _ = attention._project(qkv, attention.q_norm, attention.k_norm, rope)
    ref_q, ref_k = norm_rope_reference([(qkv, q_weight, k_weight, cos, sin)], HEADS, EPS)
    torch.testing.assert_close(ref_q, q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref_k, k, rtol=1e-6, atol=1e-6)


def check_kernel() -> None:
    """The kernel against the reference: one stream and two (joined along the sequence), row counts that do not
    fill a program, fp32 (tight) and bf16 (the interpreter rounds bf16 by truncation: one unit in the last place).
    Run with TRITON_INTERPRET=1 (see below)."""
    from auk_worker.model.qk_kernel import norm_rope

    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
        for shapes in ([(2, 7)], [(2, 5), (2, 11)], [(1, 40), (1, 3)], [(3, 1)]):
            streams = [stream(rows, m, dtype, seed=10 * i + m) for i, (rows, m) in enumerate(shapes)]
            q, k = norm_rope(streams, HEADS, EPS)
            ref_q, ref_k = norm_rope_reference(streams, HEADS, EPS)
            seq = sum(m for _, m in shapes)
            assert q.shape == k.shape == (shapes[0][0], seq, HEADS, DIM_HEAD) and q.dtype == dtype
            for out, ref in ((q, ref_q), (k, ref_k)):
                error = ((out.float() - ref.float()).abs() / ref.float().abs().clamp_min(1.0)).max().item()
                assert error <= tolerance, (dtype, shapes, error)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on the CPU)")
def test_kernel_equals_the_reference_in_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.test_qk_kernel import check_kernel; check_kernel()"
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
