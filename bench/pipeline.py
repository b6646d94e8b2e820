"""Pipeline benchmark: latency per request kind and length, DiT compute utilisation, memory, start-up.

    python -m bench.pipeline                      # release-size random weights on the GPU (the targets' table)
    python -m bench.pipeline --tiny --device cpu  # the tiny checkpoint on the CPU: a quick check that it runs

Latency is the wall time of ``AuKPipeline.render`` (from the call to the finished float32 waveform on the host),
median of ``--runs`` warm runs after ``--warmup`` runs. DiT utilisation counts the useful work of the Euler loop:
2 FLOP per block-linear weight a position passes (708 M at release size, :func:`position_weights`), plus
4 L^2 d FLOP of attention per block and row, over the time the loop took, against 790 TFLOP/s (the H200's dense
bf16 rate measured on random data).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time

import numpy as np
import torch

from auk_worker.audio import THINKER_SAMPLE_RATE, resample
from auk_worker.deploy import load_deploy_config
from auk_worker.pipeline import FastPaths
from auk_worker.types import FRAME_RATE, SAMPLE_RATE, AudioClip, RenderRequest
from bench.common import BULK_INSTRUCTION, environment, kind, median, write_result
from bench.models import PEAK_FLOPS, position_weights

# The random-weight pipelines tokenize with the tiny byte-level tokenizer: about three times the tokens Qwen's
# vocabulary gives for the same text (the text-only chat template 61 against 25; the zero-shot prompt below 92
# against 35 around the clip's audio tokens, the instruct prompt 155 against 50). For zero-shot the surplus is about
# what a 12 s utterance's words would add to this short sentence (the same 224-token text bucket), so that prompt is
# realistic at 12 s and long at 3 and 6 s; the instruct prompt is long at every length. `text_tokens` in the
# results is what ran.
INSTRUCT = 'Generate speech based on the following description: "A calm voice." The content to speak is: "Your order ships today."'
ZERO_SHOT = 'Say the following with the same voice: "Your order ships today."'
# (name, variant, instruction, reference seconds)
KINDS = [
    ("base zero-shot", "base", ZERO_SHOT, 5.0),
    ("base instruct", "base", INSTRUCT, 0.0),
    ("flash zero-shot", "flash", ZERO_SHOT, 5.0),
]
TARGETS_S = {  # the targets, seconds
    "base zero-shot": {3: 0.17, 6: 0.21, 12: 0.27},
    "base instruct": {3: 0.11, 6: 0.15, 12: 0.21},
    "flash zero-shot": {3: 0.05, 6: 0.07, 12: 0.09},
}
VLLM_OMNI_S = {  # published for vLLM-Omni's deployment on an H200-class GPU
    "base zero-shot": {3: 0.25, 6: 0.31, 12: 0.40},
    "base instruct": {3: 0.17, 6: 0.23, 12: 0.32},
    "flash zero-shot": {3: 0.08, 6: 0.10, 12: 0.14},
}


def dit_flops(pipe, positions: int, text: int, frames: int, rows: int, steps: int) -> float:
    per_position = 2 * position_weights(pipe.dit)
    config = pipe.dit.config
    blocks = config.num_layers + config.num_single_layers
    attention = 4 * positions**2 * config.heads * config.dim_head * blocks
    return steps * rows * (positions * per_position + attention)


def clip(seconds: float) -> AudioClip:
    rng = np.random.default_rng(0)
    return AudioClip(samples=(0.1 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32), sample_rate=SAMPLE_RATE)


def measure(pipe, request: RenderRequest, runs: int, warmup: int) -> dict:
    for _ in range(warmup):
        pipe.render(request)
    walls, stages = [], []
    for _ in range(runs):
        if pipe.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = pipe.render(request)
        walls.append(time.perf_counter() - started)
        stages.append(result.timings)
    return {
        "wall_s": median(walls),
        "wall_runs_s": walls,
        "stages_ms": {k: 1000 * median([s[k] for s in stages]) for k in stages[0]},
        "stages_runs_ms": [{k: round(1000 * v, 2) for k, v in s.items()} for s in stages],  # which stage a slow run lost
        "samples": len(result.waveform),
    }


def gpu_timeline(pipe, request: RenderRequest, rows: int = 12) -> dict:
    """One render under the profiler: the span of its GPU work, how much of it some stream was busy, the longest
    idle gaps (with the kernels either side, to place them), and the busy time by kind of kernel
    (``bench.common.KINDS``; concurrent streams make these add up to more than the busy time)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        pipe.render(request)
        torch.cuda.synchronize()
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not spans:
        return {}
    busy, gaps, (start, end, last) = 0.0, [], spans[0]
    for s, e, name in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, last, name))
            start = s
        if e > end:
            end, last = e, name
    busy += end - start
    by_kind: dict[str, float] = {}
    for s, e, name in spans:
        label = kind(name)
        by_kind[label] = by_kind.get(label, 0.0) + (e - s) / 1e3
    gaps.sort(reverse=True)
    span_ms = (end - spans[0][0]) / 1e3
    return {
        "span_ms": span_ms,
        "busy_ms": busy / 1e3,
        "idle_ms": span_ms - busy / 1e3,
        "kernels": len(spans),
        "kernel_ms_by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
        "longest_gaps": [{"us": round(gap, 1), "after": a[:80], "before": b[:80]} for gap, a, b in gaps[:rows]],
    }


def throughput(pipe, jobs: int, seconds: float, batch: int, budget: int) -> dict:
    """Pipeline-level bulk throughput: ``jobs`` base instruct jobs (the service benchmark's prompt), one
    ``render_batch`` call per group of ``batch`` as the worker makes them; audio seconds rendered per wall second
    and the median call (the queue adds its own, measured by bench.throughput)."""
    dit = dataclasses.replace(
        pipe.deploy.dit,
        max_num_seqs=batch,
        model_config=dataclasses.replace(pipe.deploy.dit.model_config, auk_dit_batch_position_budget=budget),
    )
    pipe.deploy = dataclasses.replace(pipe.deploy, stages=(pipe.deploy.encoder, dit))
    requests = [RenderRequest(BULK_INSTRUCTION, gen_seconds=seconds, seed=i) for i in range(jobs)]
    pipe.render_batch(requests[:batch])  # capture the group's shapes
    calls, results = [], []
    started = time.perf_counter()
    for first in range(0, jobs, batch):
        call_started = time.perf_counter()
        results += pipe.render_batch(requests[first : first + batch])
        calls.append(time.perf_counter() - call_started)
    wall = time.perf_counter() - started
    done = [r for r in results if not isinstance(r, Exception)]
    stage_ms = {k: 1000 * median([r.timings[k] for r in done]) for k in done[0].timings} if done else {}
    return {
        "jobs": jobs,
        "seconds_per_job": seconds,
        "batch": batch,
        "position_budget": budget,
        "wall_s": wall,
        "jobs_per_s": jobs / wall,
        "audio_s_per_s": jobs * seconds / wall,
        "render_batch_call_ms_median": 1000 * median(calls),
        "stage_ms_per_job_median": stage_ms,
        "failures": jobs - len(done),
    }


def padded_attention(fast: FastPaths) -> str:
    if not fast.varlen_attention:
        return "masked SDPA"
    return "variable-length, " + ("hand-written kernel" if fast.attention_kernel else "FlashAttention")


# The fast paths each attention option turns off (the deploy config's disabled_fast_paths).
DISABLED_BY = {"masked_attention": ("varlen_attention",), "flash_attention": ("attention_kernel",)}


def run(args: argparse.Namespace) -> dict:
    if args.tiny:
        from auk_worker.pipeline import AuKPipeline
        from auk_worker.tiny.checkpoint import make_tiny_checkpoint

        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="auk-tiny-") as root:  # loading reads everything it needs
            base = AuKPipeline.load(make_tiny_checkpoint(f"{root}/base"), device=args.device)
            flash = AuKPipeline.load(make_tiny_checkpoint(f"{root}/flash", variant="flash"), device=args.device)
        startup = {"make_and_load_s": time.perf_counter() - started}
    else:
        from bench.models import random_pipeline

        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        deploy = load_deploy_config()
        if args.thinker_mode is not None:
            encoder = dataclasses.replace(deploy.encoder, compilation_config=dataclasses.replace(
                deploy.encoder.compilation_config, mode=args.thinker_mode))
            deploy = dataclasses.replace(deploy, stages=(encoder, deploy.dit))
        disabled = [name for option, names in DISABLED_BY.items() if getattr(args, option) for name in names]
        deploy = dataclasses.replace(deploy, disabled_fast_paths=(*deploy.disabled_fast_paths, *disabled))
        base = random_pipeline("base", args.device, args.precision, deploy=deploy, compile_blocks=not args.no_compile,
                               vae_fast_paths=not args.plain_vae)
        flash = dataclasses.replace(base.release, variant="flash", name="AuK-Flash")
        flash = base.sharing_weights(release=flash)
        startup = {"build_s": base.startup["load"], "warm_up_s": base.startup["warm_up"]}
    pipes = {"base": base, "flash": flash}
    if args.throughput:
        rows = []
        for batch in args.batch:
            row = throughput(base, args.throughput, 6.0, batch, args.budget)
            print(f"bulk 6 s instruct, batch {batch}: {row['audio_s_per_s']:.1f} s of audio per s "
                  f"({row['jobs_per_s']:.2f} jobs/s), median render_batch call {row['render_batch_call_ms_median']:.1f} ms, "
                  f"stages per job {row['stage_ms_per_job_median']}", flush=True)
            rows.append(row)
        return {"benchmark": "pipeline-throughput", "precision": base.precision, "throughput": rows,
                "environment": environment()}
    seconds = args.seconds
    table: dict[str, dict] = {}
    for name, variant, instruction, ref_s in KINDS:
        if args.kinds and name.split()[-1] not in args.kinds and name.replace(" ", "-") not in args.kinds:
            continue
        pipe = pipes[variant]
        for target in seconds:
            request = RenderRequest(
                instruction, audio=clip(ref_s) if ref_s else None, gen_seconds=float(target), seed=1234,
                num_inference_steps=args.steps if variant == "base" else None,
            )
            if pipe.device.type == "cuda" and name == "base zero-shot" and target == max(seconds):
                torch.cuda.reset_peak_memory_stats()
            row = measure(pipe, request, args.runs, args.warmup)
            if pipe.device.type == "cuda" and name == "base zero-shot" and target == max(seconds):
                row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            audio_16k = resample(clip(ref_s).samples, SAMPLE_RATE, THINKER_SAMPLE_RATE) if ref_s else None
            text = pipe.encoder.processor(instruction, audio_16k)["input_ids"].shape[1]
            ref_frames = int(ref_s * FRAME_RATE)
            frames = int(target * FRAME_RATE)
            schedule = pipe.schedule(request)
            rows = 2 if schedule.guidance_scale >= 1e-5 else 1
            flops = dit_flops(pipe, text + ref_frames + frames, text, frames, rows, schedule.num_steps)
            row.update(
                text_tokens=text,
                positions=text + ref_frames + frames,
                dit_tflop=flops / 1e12,
                rtf=row["wall_s"] / target,
            )
            if pipe.device.type == "cuda":
                row["dit_mfu"] = flops / (row["stages_ms"]["dit"] / 1000) / PEAK_FLOPS
            target_s = TARGETS_S[name].get(target)
            if target_s is not None and not args.tiny:
                row["target_s"], row["vllm_omni_s"] = target_s, VLLM_OMNI_S[name][target]
            if args.profile and pipe.device.type == "cuda":
                row["gpu_timeline"] = gpu_timeline(pipe, request)
                print(f"   one render's GPU work: {json.dumps(row['gpu_timeline'])}", flush=True)
            table.setdefault(name, {})[f"{target}s"] = row
            print(f"{name:16s} {target:>3}s  {row['wall_s'] * 1000:8.1f} ms  " + "  ".join(
                f"{k} {v:.1f}" for k, v in row["stages_ms"].items()) + (
                f"  mfu {row['dit_mfu']:.1%}" if "dit_mfu" in row else ""), flush=True)
    return {
        "benchmark": "pipeline",
        "mode": "tiny" if args.tiny else "release-size random weights",
        "precision": base.precision,
        "graphs": base.fast_paths.step_graphs,
        "compiled_blocks": base.fast_paths.compiled_blocks,
        "vae_fast_paths": base.fast_paths.encode_graphs,
        "padded_attention": padded_attention(base.fast_paths),
        "fast_paths": list(base.fast_paths.names_on),
        "thinker_compilation_mode": base.deploy.encoder.compilation_config.mode,
        "runs": args.runs,
        "startup_s": startup,
        "latency": table,
        "environment": environment(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint instead of release-size weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=("exact", "fast", "fp8"), default="fast")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per case (default 10, tiny 2)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="base Euler steps (default: the deploy config's)")
    parser.add_argument("--kinds", nargs="+", default=None, help="which request kinds (default all)")
    parser.add_argument("--seconds", type=int, nargs="+", default=None, help="target lengths (default 3 6 12)")
    parser.add_argument("--no-compile", action="store_true", help="graphs of eager kernels (no compiled DiT blocks)")
    parser.add_argument("--plain-vae", action="store_true",
                        help="the VAE's convolution activations and eager reference encode (no VAE fast paths)")
    parser.add_argument("--masked-attention", action="store_true",
                        help="masked SDPA for padded sequences (no variable-length FlashAttention)")
    parser.add_argument("--flash-attention", action="store_true",
                        help="FlashAttention's variable-length kernel for padded sequences (not the hand-written one)")
    parser.add_argument("--thinker-mode", type=int, choices=(0, 1, 2, 3), default=None,
                        help="stage 0's compilation mode (default: the deploy config's; 1-3 compile the thinker)")
    parser.add_argument("--throughput", type=int, default=0, metavar="JOBS",
                        help="measure bulk throughput over JOBS 6 s instruct jobs instead of latency")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8], help="jobs per DiT pass (throughput)")
    parser.add_argument("--budget", type=int, default=8192, help="rows x positions per DiT pass (throughput)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more render of each case: GPU span, busy and idle time, longest gaps")
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    if args.runs is None:
        args.runs = 2 if args.tiny else 10
    if args.seconds is None:
        args.seconds = [1, 2] if args.tiny else [3, 6, 12]
    if args.tiny:
        args.warmup = min(args.warmup, 1)
        args.steps = args.steps or 4
    result = run(args)
    from pathlib import Path

    # One file per kind of run, so that a fp8 or masked-attention run never overwrites the default one.
    name = "-".join(
        ["pipeline"]
        + ["tiny"] * args.tiny
        + ["throughput"] * bool(args.throughput)
        + [args.precision] * (args.precision != "fast")
        + ["masked-attention"] * args.masked_attention
        + ["flash-attention"] * args.flash_attention
        + [f"thinker-mode-{args.thinker_mode}"] * (args.thinker_mode is not None)
        + ["eager-kernels"] * args.no_compile
        + ["plain-vae"] * args.plain_vae
    )
    path = write_result(name, result, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
