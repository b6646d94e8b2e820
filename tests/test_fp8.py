"""The opt-in ``fp8`` precision on the CPU: the FP8 linear against its definition, which linears it replaces, how
far it moves the DiT's velocity, and a render on the tiny checkpoint."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from auk_worker.deploy import load_deploy_config
from auk_worker.model.dit import AuKDiT, DiTConfig
from auk_worker.model.fp8 import E4M3, Fp8Linear, block_linears, fp8_supported, use_fp8_block_linears
from auk_worker.pipeline import AuKPipeline, resolve_precision
from auk_worker.tiny.checkpoint import make_tiny_checkpoint
from auk_worker.types import SAMPLE_RATE, RenderRequest

TINY = DiTConfig(
    dim=64, heads=4, dim_head=16, ff_mult=2.0, text_hidden_dim=32, latent_dim=64, num_layers=2, num_single_layers=3
)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bf16_dit(seed: int = 0) -> AuKDiT:
    torch.manual_seed(seed)
    model = AuKDiT(TINY).eval().requires_grad_(False)
    for param in model.parameters():  # the zero-initialised modulation would make every block an identity
        if not param.any():
            param.normal_(0.0, 0.02)
    return model.to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 16, 37])  # fewer rows than the kernel's multiple, exactly one, a remainder
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_computes_its_definition(rows: int, bias: bool) -> None:
    linear = nn.Linear(64, 96, bias=bias).to(torch.bfloat16).requires_grad_(False)
    fp8 = Fp8Linear(linear)
    assert fp8.weight.dtype == E4M3 and fp8.weight.shape == (96, 64)
    assert float(fp8.weight.float().abs().max()) == 448.0  # the largest weight takes the top of the range
    x = rand(2, rows, 64, seed=rows).to(torch.bfloat16)
    # E4M3 input (unit scale) times the E4M3 weight, rescaled, accumulated in fp32, then bias
    reference = x.to(E4M3).float() @ (fp8.weight.float() * fp8.weight_scale).T
    if bias:
        reference = reference + linear.bias.float()
    out = fp8(x)
    assert out.shape == (2, rows, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)  # bf16 output rounding
    error = float((out.float() - linear(x).float()).norm() / linear(x).float().norm())
    print(f"fp8 linear against bf16, {rows} rows: relative L2 difference {error:.3f}")
    assert 0.0 < error < 0.08


def test_inputs_saturate_at_the_e4m3_limit_instead_of_overflowing() -> None:
    fp8 = Fp8Linear(nn.Linear(16, 16, bias=False).to(torch.bfloat16))
    out = fp8(torch.full((1, 16), 1e4, dtype=torch.bfloat16))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, fp8(torch.full((1, 16), 448.0, dtype=torch.bfloat16)))


def test_widths_off_the_kernels_multiple_are_refused() -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Linear(nn.Linear(64, 40))


def test_exactly_the_block_linears_are_replaced() -> None:
    dit = bf16_dit()
    before = {name for name, m in dit.named_modules() if isinstance(m, nn.Linear)}
    assert use_fp8_block_linears(dit) == 8 * TINY.num_layers + 4 * TINY.num_single_layers
    assert use_fp8_block_linears(dit) == 0  # already done
    converted = {name for name, m in dit.named_modules() if isinstance(m, Fp8Linear)}
    kept = {name for name, m in dit.named_modules() if isinstance(m, nn.Linear)}
    assert converted | kept == before and not converted & kept
    assert all(".attn." in name or ".ff" in name for name in converted)
    # adaLN, time and text embeddings, the audio embedding and the output stay bf16
    assert {"proj_out", "txt_proj", "audio_embed.linear", "norm_out.linear", "time_embed.time_mlp.0"} <= kept
    in_blocks = {name for name in kept if name.startswith(("transformer_blocks", "single_transformer_blocks"))}
    assert in_blocks and all(name.rsplit(".", 2)[-2].startswith("attn_norm") for name in in_blocks)  # adaLN only
    assert len(list(block_linears(dit))) == len(converted)


def test_fp8_velocity_stays_close_to_bf16() -> None:
    dit = bf16_dit(seed=1)
    fp8 = copy.deepcopy(dit)
    use_fp8_block_linears(fp8)
    text, ref, x = rand(1, 9, 32, seed=2), rand(1, 6, 64, seed=3), rand(1, 12, 64, seed=4)
    with torch.no_grad():
        velocity = {}
        for name, model in (("bf16", dit), ("fp8", fp8)):
            ctx = model.prepare(text, torch.tensor([9]), ref, None, None, 12, cfg=True)
            velocity[name] = model(x, torch.tensor(0.4), ctx).float()
    error = float((velocity["fp8"] - velocity["bf16"]).norm() / velocity["bf16"].norm())
    print(f"fp8 against bf16 DiT velocity (tiny, CFG rows): relative L2 difference {error:.3f}")
    assert 0.0 < error < 0.15


def test_fp8_precision_renders_the_tiny_checkpoint(tmp_path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "base")
    pipe = AuKPipeline.load(checkpoint, device="cpu", precision="fp8")
    assert pipe.precision == "fp8" and pipe.dit.dtype == torch.bfloat16
    assert sum(isinstance(m, Fp8Linear) for m in pipe.dit.modules()) == len(list(block_linears(pipe.dit)))
    result = pipe.render(RenderRequest("Say hello.", gen_seconds=0.5, seed=3, num_inference_steps=2))
    assert result.waveform.shape == (SAMPLE_RATE // 2,) and np.isfinite(result.waveform).all()


def test_deploy_dtype_float8_selects_fp8(tmp_path) -> None:
    config = tmp_path / "fp8.yaml"
    config.write_text("stages:\n  - stage_id: 0\n  - stage_id: 1\n    dtype: float8\n"
                      "    default_sampling_params: {seed: 0, num_inference_steps: 32, guidance_scale: 2.0}\n")
    assert load_deploy_config(config).dit.dtype == "float8"
    assert resolve_precision("float8", torch.device("cpu")) == "fp8"
    assert fp8_supported(torch.device("cpu"))
