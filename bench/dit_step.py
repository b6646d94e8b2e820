"""One guided DiT step at release size, in its variants: eager or graph, padded (masked) or exact, compiled or not.

    python -m bench.dit_step [--compile] [--profile] [--rows 8] [--fp8] [--variants exact padded ...]

Reports milliseconds per CFG step (median of 20 replays) and the DiT compute utilisation; ``--profile`` prints the
top GPU kernels of one eager step. Used to choose the fast path; the pipeline benchmark measures the whole render.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import sys
import time

import torch

from auk_worker.deploy import load_deploy_config
from auk_worker.model.dit import AuKDiT, DiTConfig, DiTKernels
from auk_worker.model.fp8 import use_fp8_block_linears
from auk_worker.model.sampling import guided_velocity, time_grid
from auk_worker.pipeline import FastPaths
from auk_worker.pipeline.graphs import StepGraphs
from auk_worker.pipeline.wiring import compile_dit_blocks, dit_kernels
from bench.common import timed
from bench.models import PEAK_FLOPS, RELEASE_ARCH, make_ctx, position_weights


def apply_settings(model: AuKDiT, kernels: DiTKernels, text_stream: bool) -> None:
    """A variant's kernel table, and the double blocks' text stream on a second CUDA stream or not."""
    model.kernels = kernels
    model.text_stream = torch.cuda.Stream(model.device) if text_stream else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dit_step")
    parser.add_argument("--text", type=int, default=100)
    parser.add_argument("--ref", type=int, default=0)
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--dynamic", choices=("yes", "no", "both"), default="both")
    parser.add_argument("--rows", type=int, default=1, help="jobs in the step (a bulk pass: 8)")
    parser.add_argument("--fp8", action="store_true", help="also time the padded step with FP8 block linears")
    parser.add_argument("--variants", nargs="+", help="time only these variants (exact, padded, ...)")
    parser.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                        help="torch._inductor.config settings for the compiled runs, e.g. coordinate_descent_tuning=True")
    args = parser.parse_args(argv)
    for setting in args.inductor:
        key, value = setting.split("=", 1)
        setattr(torch._inductor.config, key, ast.literal_eval(value))
    torch.manual_seed(0)
    with torch.device("cuda"):
        dit = AuKDiT(DiTConfig.from_arch(RELEASE_ARCH, latent_dim=64)).to(torch.bfloat16).eval().requires_grad_(False)
    positions = args.text + args.ref + args.frames
    blocks = 30
    flops = 2 * args.rows * (positions * 2 * position_weights(dit) + 4 * positions**2 * 1536 * blocks)
    grid = time_grid(32, -1.0).cuda()
    # (name, model, padding, kernel table, text stream): without padding nothing is masked; padded, the masked keys
    # go through the hand-written variable-length kernel, FlashAttention's, or masked SDPA. q, k, v come from the
    # attention-inputs kernel and the adaptive norms from the modulated-norm kernel, or from torch ops (inductor's
    # fusion when compiled). "one stream": the double blocks' text stream after the audio stream on one CUDA stream,
    # not beside it. The kernels are those the pipeline resolves for this GPU.
    kernels = dit_kernels(FastPaths.resolve(load_deploy_config(), dit.device, "fast", dit.config.dim_head))
    without = lambda *names: dataclasses.replace(kernels, **dict.fromkeys(names))  # noqa: E731
    variants = [
        ("exact", dit, 0, kernels, True),
        ("padded", dit, 7, kernels, True),
        ("padded, FlashAttention", dit, 7, without("attention_kernel"), True),
        ("padded, masked SDPA", dit, 7, without("varlen_attention", "attention_kernel"), True),
        ("padded, torch inputs", dit, 7, without("attention_inputs"), True),
        ("padded, torch norms", dit, 7, without("modulated_norm", "gated_residual_norm"), True),
        ("padded, one stream", dit, 7, kernels, False),
    ]
    if args.fp8:
        fp8_dit = copy.deepcopy(dit)
        use_fp8_block_linears(fp8_dit)
        variants.append(("padded, fp8", fp8_dit, 7, kernels, True))
    if args.variants:
        variants = [variant for variant in variants if variant[0] in args.variants]
    with torch.inference_mode():
        for name, model, pad, table, text_stream in variants:
            apply_settings(model, table, text_stream)
            ctx, x = make_ctx(model, args.rows, args.text, args.ref, args.frames, pad)
            graphs = StepGraphs(model, 4)
            velocity = guided_velocity(model, ctx, 2.0)
            eager_s = timed(lambda: velocity(x, grid[3], 3))
            graphs.sample(ctx, x, grid, 2.0)
            graph_s = timed(lambda: graphs.sample(ctx, x, grid, 2.0), 5) / 32
            print(f"{name:20s} eager {eager_s * 1e3:7.2f} ms/step  graph {graph_s * 1e3:7.2f} ms/step  "
                  f"mfu {flops / graph_s / PEAK_FLOPS:.1%}", flush=True)
            if args.profile:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    velocity(x, grid[3], 3)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
        dynamics = {"yes": [True], "no": [False], "both": [False, True]}[args.dynamic] if args.compile else []
        for dynamic in dynamics:
            torch._dynamo.reset()
            for name, model, pad, table, text_stream in variants:
                apply_settings(model, table, text_stream)
                ctx, x = make_ctx(model, args.rows, args.text, args.ref, args.frames, pad)
                compile_dit_blocks(model, dynamic=dynamic)
                graphs = StepGraphs(model, 4)
                started = time.perf_counter()
                graphs.sample(ctx, x, grid, 2.0)
                compile_s = time.perf_counter() - started
                graph_s = timed(lambda: graphs.sample(ctx, x, grid, 2.0), 5) / 32
                print(f"{name:20s} compiled (dynamic={dynamic}) graph {graph_s * 1e3:7.2f} ms/step (first call {compile_s:.1f} s)  "
                      f"mfu {flops / graph_s / PEAK_FLOPS:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
