"""The ``fp8`` precision: the DiT's block linears in FP8 (E4M3), opt-in.

What auk-model.md records of the published FP8 recipe: the 160 token-wise block linears (per double block
``to_qkv``, ``to_qkv_c``, ``to_out.0``, ``to_out_c`` and both feed-forwards' ``linear_in`` and ``linear_out``; per
single block ``to_qkv``, ``to_out.0`` and the feed-forward's two) hold E4M3 weights under one per-tensor scale,
their inputs are cast to E4M3 with unit scale, and ``torch._scaled_mm`` multiplies into the activations' dtype.
Embeddings, adaLN, the text projection and ``proj_out`` stay bf16. The published cost: the guided velocity moves
about 7 % against bf16 (seed-tts WER 0.0189 -> 0.0211 for the base model), for 8-10 % of latency on an
H200-class GPU and about 30 % on an H20.

FP8 matrix products need an Ada or Hopper GPU (compute capability 8.9 or later); the CPU runs them too (slowly),
which is what the tests use.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448; casting saturates there
WIDTH_MULTIPLE = 16  # the FP8 GEMM wants the inner and output widths in multiples of 16 (any number of rows)


class Fp8Linear(nn.Module):
    """``linear`` with its weight in E4M3: y = (x as E4M3) @ (W / s as E4M3)^T * s + b, in x's dtype.

    ``s`` is the weight's absolute maximum over 448, so the largest weight keeps full E4M3 precision. Inputs are
    cast without a scale and saturate at +-448 (the recipe's unit activation scale)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.in_features % WIDTH_MULTIPLE or linear.out_features % WIDTH_MULTIPLE:
            raise ValueError(f"FP8 linears need widths in multiples of {WIDTH_MULTIPLE}, got {linear.weight.shape}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = weight.abs().amax().clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX
        self.register_buffer("weight", (weight / scale).to(E4M3))  # [out, in]
        self.register_buffer("weight_scale", scale)  # 0-d fp32
        self.register_buffer("input_scale", torch.ones((), device=weight.device))  # unit scale
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # [m, in]
        out = torch._scaled_mm(
            rows.to(E4M3),
            self.weight.t(),  # column-major [in, out], as the kernel wants its second operand
            scale_a=self.input_scale,
            scale_b=self.weight_scale,
            bias=None if self.bias is None else self.bias.to(x.dtype),
            out_dtype=x.dtype,
        )
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, e4m3"


def block_linears(dit: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(parent, attribute) of each token-wise block linear of an ``AuKDiT``: 8 per double block, 4 per single."""
    for block in dit.transformer_blocks:
        yield from ((block.attn, name) for name in ("to_qkv", "to_qkv_c", "to_out_c"))
        yield block.attn.to_out, "0"
        for ff in (block.ff_x, block.ff_c):
            yield from ((ff, name) for name in ("linear_in", "linear_out"))
    for block in dit.single_transformer_blocks:
        yield block.attn, "to_qkv"
        yield block.attn.to_out, "0"
        yield from ((block.ff, name) for name in ("linear_in", "linear_out"))


def use_fp8_block_linears(dit: nn.Module) -> int:
    """Replace the DiT's block linears by :class:`Fp8Linear` in place (after loading); returns how many."""
    count = 0
    for parent, name in block_linears(dit):
        linear = getattr(parent, name)
        if not isinstance(linear, Fp8Linear):
            setattr(parent, name, Fp8Linear(linear))
            count += 1
    return count


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` multiplies E4M3 matrices: the CPU, or a CUDA GPU of compute capability 8.9 or later."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"
