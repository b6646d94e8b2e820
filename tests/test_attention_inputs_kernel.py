"""The attention-inputs kernel (q and k through per-head RMSNorm and rotary positions, v copied, from the qkv
projection; k and v optionally in a visible-first key order) against its torch reference, and the reference
against the DiT's own modules. The kernel runs in Triton's CPU interpreter here (a process of
its own: the interpreter is chosen when the kernels are defined) and compiled in tests/test_gpu.py."""

from __future__ import annotations

import torch

from auk_worker.model.dit.attention import Attention
from auk_worker.model.dit.config import Rope
from auk_worker.model.dit.kernels.attention_inputs import attention_inputs_reference
from auk_worker.model.dit.layers import RotaryEmbedding
from tests.triton_interpreter import needs_triton, run_in_interpreter

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
    expected = attention._project(qkv, attention.q_norm, attention.k_norm, rope)
    for ref, exp in zip(attention_inputs_reference([(qkv, q_weight, k_weight, cos, sin)], HEADS, EPS), expected):
        torch.testing.assert_close(ref, exp, rtol=1e-6, atol=1e-6)


def test_reference_puts_keys_and_values_in_their_slots() -> None:
    streams = [stream(2, 4, torch.float32, seed=2), stream(2, 3, torch.float32, seed=3)]
    q, k, v = attention_inputs_reference(streams, HEADS, EPS)
    slot = torch.tensor([[6, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]], dtype=torch.int32)  # row 0: key 0 goes last
    q2, k2, v2 = attention_inputs_reference(streams, HEADS, EPS, slot)
    assert torch.equal(q2, q) and torch.equal(k2[1], k[1]) and torch.equal(v2[1], v[1])
    assert torch.equal(k2[0, 6], k[0, 0]) and torch.equal(k2[0, :6], k[0, 1:]) and torch.equal(v2[0, :6], v[0, 1:])


def check_kernel() -> None:
    """The kernel against the reference: one stream and two (joined along the sequence), row counts that do not
    fill a program, keys in order and moved to slots, fp32 (tight) and bf16 (the interpreter rounds bf16 by
    truncation: one unit in the last place). Run with TRITON_INTERPRET=1 (see below)."""
    from auk_worker.model.dit.kernels.attention_inputs import attention_inputs

    generator = torch.Generator().manual_seed(5)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
        for shapes in ([(2, 7)], [(2, 5), (2, 11)], [(1, 40), (1, 3)], [(3, 1)]):
            rows, seq = shapes[0][0], sum(m for _, m in shapes)
            streams = [stream(rows, m, dtype, seed=10 * i + m) for i, (rows, m) in enumerate(shapes)]
            shuffled = torch.stack([torch.randperm(seq, generator=generator) for _ in range(rows)]).to(torch.int32)
            for slot in (None, shuffled):
                out = attention_inputs(streams, HEADS, EPS, slot)
                ref = attention_inputs_reference(streams, HEADS, EPS, slot)
                assert all(t.shape == (rows, seq, HEADS, DIM_HEAD) and t.dtype == dtype for t in out)
                assert torch.equal(out[2], ref[2])  # v is copied
                for fast, exact in zip(out[:2], ref[:2]):
                    error = ((fast.float() - exact.float()).abs() / exact.float().abs().clamp_min(1.0)).max().item()
                    assert error <= tolerance, (dtype, shapes, slot is not None, error)


@needs_triton
def test_kernel_equals_the_reference_in_the_triton_interpreter() -> None:
    run_in_interpreter("tests.test_attention_inputs_kernel", "check_kernel")
