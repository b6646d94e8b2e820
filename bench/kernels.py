"""Where the GPU time of each stage goes: the top kernels of one DiT step, one VAE decode and one audio-tower pass.

    python -m bench.kernels [--text 155] [--ref 0] [--frames 150] [--batch 1] [--fp8] [--decode-frames 300]
                            [--mel-frames 500] [--stages dit gemm norms attention position decode audio encode]

Release-size random weights, fast precision. The DiT step runs its compiled blocks eagerly (no CUDA graph) so the
profiler sees each kernel; the decode runs with the convolution activations, then as the pipeline runs it; the
audio tower runs as the pipeline runs it. Prints one table per stage, after the stage's GPU time by kind of kernel
(``KINDS``); used to choose what to optimise next, not to report latency (``bench.pipeline`` does that).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from auk_worker.deploy import load_deploy_config
from auk_worker.model.dit import AuKDiT, DiTConfig
from auk_worker.model.fp8 import Fp8Linear, use_fp8_block_linears
from auk_worker.model.sampling import guided_velocity
from auk_worker.model.thinker import PromptProcessor, ThinkerEncoder, ThinkerTrunk
from auk_worker.model.thinker.audio_tower import AudioTowerRunner
from auk_worker.tiny.qwen import write_tiny_qwen
from auk_worker.model.vae import AuKVAE, VAEConfig
from auk_worker.pipeline import FastPaths
from auk_worker.pipeline.graphs import DecodeGraphs, EncodeGraphs
from auk_worker.pipeline.thinker_graphs import AudioTowerGraphs, EncoderGraphs
from auk_worker.pipeline.wiring import compile_dit_blocks, dit_kernels, wire_vae_kernels
from bench.common import durations, kind, timed
from bench.models import RELEASE_ARCH, make_ctx, release_thinker_config


def fast_paths(**disabled: bool) -> FastPaths:
    """The fast paths the pipeline resolves for this GPU in fast precision, less those named True."""
    deploy = load_deploy_config()
    off = tuple(name for name, is_off in disabled.items() if is_off)
    deploy = dataclasses.replace(deploy, disabled_fast_paths=(*deploy.disabled_fast_paths, *off))
    return FastPaths.resolve(deploy, torch.device("cuda"), "fast", RELEASE_ARCH["dim_head"])


def profile(name: str, fn, rows: int) -> None:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    busy_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    print(f"\n== {name}: {timed(fn, 10) * 1e3:.2f} ms wall (eager launch), GPU busy {busy_us / 1e3:.2f} ms "
          f"in {launches} kernels", flush=True)
    totals: dict[str, list[float]] = {}
    for e in kernels:
        total = totals.setdefault(kind(e.key), [0.0, 0])
        total[0] += e.self_device_time_total
        total[1] += e.count
    print("   by kind: " + ", ".join(f"{name} {us / 1e3:.2f} ms ({count} calls)"
                                    for name, (us, count) in sorted(totals.items(), key=lambda item: -item[1][0])))
    for e in kernels[:rows]:
        share = e.self_device_time_total / busy_us
        print(f"   {e.self_device_time_total / 1e3:7.3f} ms {share:6.1%} {e.count:5d} x  {e.key[:90]}", flush=True)


def replayed(fn, calls: int = 50) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (median of 10 replays), so host
    launch time is not what is measured."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return timed(graph.replay, 10) / calls


def block_gemms(tokens: int) -> None:
    """The block linears' matrix products at ``tokens`` rows (a step's positions over its CFG rows), alone, in
    bf16 and in FP8: how close each shape gets to the GPU's limit, the ceiling for the DiT step."""
    d, inner = RELEASE_ARCH["dim"], int(RELEASE_ARCH["dim"] * RELEASE_ARCH["ff_mult"])
    shapes = {"to_qkv": (d, 3 * d), "to_out": (d, d), "linear_in": (d, 2 * inner), "linear_out": (inner, d)}
    print(f"\n== block linears at {tokens} rows, microseconds per call (TFLOP/s):", flush=True)
    for name, (k, n) in shapes.items():
        linear = torch.nn.Linear(k, n, bias=name == "to_qkv", device="cuda", dtype=torch.bfloat16)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        line = f"   {name:10s} [{tokens}, {k}] x [{k}, {n}]"
        for precision, layer in (("bf16", linear), ("fp8", Fp8Linear(linear))):
            elapsed = replayed(lambda: layer(x))
            line += f"   {precision} {elapsed * 1e6:6.1f} ({2 * tokens * k * n / elapsed / 1e12:5.0f})"
        print(line, flush=True)


def position_convs(frames: int, rows: int) -> None:
    """The audio embedding of a step's target (its linear, two position convolutions with Mish and the residual)
    in the torch form (im2col and a batched product per convolution) and through the position-conv kernel, each
    replayed from a graph of 50 calls, at ``frames`` frames for one job and for ``rows`` jobs (a bulk pass)."""
    from auk_worker.model.dit.kernels.position_conv import position_conv
    from auk_worker.model.dit.layers import AudioEmbedding

    embed = AudioEmbedding(64, RELEASE_ARCH["dim"]).to("cuda", torch.bfloat16)
    embed.conv_pos_embed.packed_weights()
    print(f"\n== target embedding at {frames} frames, microseconds per call:", flush=True)
    for batch in (1, rows):
        z = torch.randn(batch, frames, 64, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(batch, frames, dtype=torch.bool, device="cuda")
        mask[:, frames - 7 :] = False  # a bucket's padded tail
        line = f"   {batch} job(s), padded tail"
        for name, kernel in (("torch form", None), ("kernel", position_conv)):
            line += f"   {name} {replayed(lambda kernel=kernel: embed(z, mask, kernel)) * 1e6:7.1f}"
        print(line, flush=True)


def norm_kernels(positions: int) -> None:
    """A block's two adaptive norms at ``positions`` rows (a step's positions over its CFG rows): the
    modulated-norm kernel against inductor's compile of the torch form (as the blocks are compiled), each replayed
    from a graph of 50 calls; then the kernel's rows per program and warps, swept."""
    from auk_worker.model.dit import layers
    from auk_worker.model.dit.kernels import modulated_norm as kernel

    d, eps = RELEASE_ARCH["dim"], layers.LAYER_NORM_EPS
    x, y = (torch.randn(2, positions // 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    modulation = torch.randn(1, 6 * d, device="cuda", dtype=torch.bfloat16)
    shift, scale, gate = (chunk[:, None] for chunk in modulation.chunk(6, dim=1)[:3])
    keep = torch.ones(2, positions // 2, 1, dtype=torch.bool, device="cuda")
    keep[:, -7:] = False
    tensor_bytes = x.numel() * x.element_size()
    forms = {  # name: (torch form, kernel, tensors read and written)
        "norm": (lambda: layers._modulate(x, shift, scale),
                 lambda: kernel.modulated_norm(x, shift, scale, eps), 2),
        "gated residual + norm": (
            lambda: layers.gated_residual_norm(x, y, gate, keep, shift, scale, kernel=None),
            lambda: kernel.gated_residual_norm(x, y, gate, keep, shift, scale, eps), 4),
    }

    print(f"\n== adaptive norms at {positions} rows of {d}, microseconds per call (GB/s):", flush=True)
    for name, (torch_form, fused, tensors) in forms.items():
        line = f"   {name:24s}"
        for label, fn in (("inductor", torch.compile(torch_form, dynamic=True)), ("kernel", fused)):
            elapsed = replayed(fn)
            line += f"   {label} {elapsed * 1e6:6.1f} ({tensors * tensor_bytes / elapsed / 1e9:5.0f})"
        print(line, flush=True)
    chosen = kernel.ROWS, kernel.WARPS
    try:
        for rows in (1, 2, 4):
            line = f"   rows per program {rows}, warps 2 / 4 / 8:"
            for warps in (2, 4, 8):
                kernel.ROWS, kernel.WARPS = rows, warps
                line += "  " + "/".join(f"{replayed(fused) * 1e6:.1f}" for _, fused, _ in forms.values())
            print(line, flush=True)
    finally:
        kernel.ROWS, kernel.WARPS = chosen


def attention_backends(length: int, padding: int = 5) -> None:
    """One block's joint attention (CFG rows, 24 heads of 64) per SDPA backend, with and without a key mask, and
    the padding-free forms a captured graph can use (the visible count read on the device); microseconds a call
    replayed from a graph of 50 calls."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, 24, length, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    visible = torch.ones(2, length, dtype=torch.bool, device="cuda")
    visible[:, -padding:] = False
    mask = visible[:, None, None, :]
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def report(name: str, call, masked: bool = True) -> None:
        try:
            elapsed = replayed(call)
        except RuntimeError as exc:
            print(f"   {name:40s} unsupported ({str(exc)[:60]})", flush=True)
            return
        line = f"   {name:40s} {elapsed * 1e6:8.1f}"
        if masked:
            line += f"   max |diff| vs masked SDPA {float((call().float() - reference.float()).abs().max()):.2e}"
        print(line, flush=True)

    print(f"\n== attention [2, 24, {length}, 64] bf16, {padding} keys masked, microseconds per call:", flush=True)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for masked in (False, True):
            def call():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask if masked else None)
            report(f"{backend.name} mask={masked}", call, masked)

    # FlashAttention over [rows * length, h, dh], each row reading only its first `seqused_k` keys (the padding
    # moved to the end of the row). Inputs are packed beforehand: only the kernel is timed.
    packed_q, packed_k, packed_v = (t.transpose(1, 2).reshape(-1, 24, 64).contiguous() for t in (q, k, v))
    starts = torch.arange(0, 3 * length, length, dtype=torch.int32, device="cuda")
    used = visible.sum(dim=1, dtype=torch.int32)

    def flash(seqused):
        out = torch.ops.aten._flash_attention_forward(
            packed_q, packed_k, packed_v, starts, starts, length, length, 0.0, False, False, seqused_k=seqused
        )[0]
        return out.view(2, length, 24, 64).transpose(1, 2)

    report("flash varlen, no seqused_k", lambda: flash(None), masked=False)
    report("flash varlen, seqused_k", lambda: flash(used))

    # The hand-written Triton kernel on the same packed inputs: at its launch settings, then a sweep of them.
    from auk_worker.model.dit.kernels import varlen_attention as varlen

    def triton_varlen(launch=None):
        try:
            out = varlen.varlen_attention(packed_q, packed_k, packed_v, starts, used, length, launch=launch)
        except Exception as exc:  # a setting Triton cannot compile (shared memory, registers): reported, not fatal
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
        return out.view(2, length, 24, 64).transpose(1, 2)

    if varlen.available(q.device, q.dtype, 64):
        report(f"triton varlen {varlen.launch_settings()}", triton_varlen)
        print("   (BLOCK_M, BLOCK_N, warps, stages) swept:", flush=True)
        for launch in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 3), (64, 128, 4, 2),
                       (128, 32, 4, 3), (64, 32, 4, 4), (128, 128, 4, 3), (128, 64, 4, 4), (64, 64, 2, 3)):
            report(f"triton varlen {launch}", lambda launch=launch: triton_varlen(launch))
    else:
        print("   triton varlen                           unavailable (no Triton)", flush=True)

    # Exact masking without a mask: one more head channel, 1 on every query and -30000 on a hidden key (0 on a
    # visible one), so a hidden key scores -30000 / sqrt(64) and its softmax weight underflows to exactly 0.
    for width in (72, 80, 128):
        extra = width - 64
        q_flag = torch.zeros(2, 24, length, extra, device="cuda", dtype=torch.bfloat16)
        q_flag[..., 0] = 1.0
        k_flag = torch.zeros_like(q_flag)
        k_flag[..., 0] = torch.where(visible, 0.0, -30000.0)[:, None, :]
        q_wide, k_wide, v_wide = (torch.cat(pair, dim=-1) for pair in ((q, q_flag), (k, k_flag), (v, torch.zeros_like(q_flag))))

        def widened():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q_wide, k_wide, v_wide, scale=0.125)[..., :64]
        report(f"cuDNN unmasked, key-flag channel, dh {width}", widened)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels")
    parser.add_argument("--text", type=int, default=155)
    parser.add_argument("--ref", type=int, default=0, help="reference frames in the DiT step (zero-shot)")
    parser.add_argument("--frames", type=int, default=150)
    parser.add_argument("--fp8", action="store_true", help="profile the DiT step with FP8 block linears as well")
    parser.add_argument("--masked-attention", action="store_true",
                        help="masked SDPA for padded sequences (no variable-length FlashAttention)")
    parser.add_argument("--torch-inputs", action="store_true",
                        help="q, k, v as torch ops (inductor's fusion), not the attention-inputs kernel")
    parser.add_argument("--torch-norms", action="store_true",
                        help="adaptive norms as torch ops (inductor's fusion), not the modulated-norm kernel")
    parser.add_argument("--batch", type=int, default=1, help="jobs in the DiT step (a bulk pass: 8)")
    parser.add_argument("--decode-frames", type=int, default=300)
    parser.add_argument("--mel-frames", type=int, default=500, help="reference clip length in 10 ms mel frames")
    parser.add_argument("--masked", type=int, default=5, help="keys masked in the attention stage")
    parser.add_argument("--pad", type=int, default=0, help="extra masked text and target positions (bucket padding)")
    parser.add_argument("--rows", type=int, default=15, help="kernels listed per stage")
    parser.add_argument("--stages", nargs="+", default=["dit", "decode", "audio", "encode"])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with torch.inference_mode():
        if "dit" in args.stages:
            with torch.device("cuda"):
                dit = AuKDiT(DiTConfig.from_arch(RELEASE_ARCH, latent_dim=64)).to(torch.bfloat16)
            dit.eval().requires_grad_(False)
            compile_dit_blocks(dit)  # as the worker compiles them
            dit.kernels = dit_kernels(fast_paths(varlen_attention=args.masked_attention,
                                                 attention_inputs=args.torch_inputs, modulated_norm=args.torch_norms))
            ctx, x = make_ctx(dit, args.batch, args.text, args.ref, args.frames, args.pad)
            velocity = guided_velocity(dit, ctx, 2.0)
            t = torch.tensor(0.5, device="cuda")
            shape = (f"{args.batch} job(s), text {args.text}, ref {args.ref}, frames {args.frames}, pad {args.pad}, "
                     f"{'masked SDPA' if ctx.single.visible_keys is None else 'variable-length'} attention, "
                     f"{'inputs kernel' if ctx.single.attention_inputs else 'torch inputs'}, "
                     f"{'norm kernel' if ctx.single.modulated_norm else 'torch norms'}")
            profile(f"DiT CFG step, {shape}", lambda: velocity(x, t, 3), args.rows)
            if args.fp8:
                use_fp8_block_linears(dit)
                profile(f"DiT CFG step, FP8 block linears, {shape}", lambda: velocity(x, t, 3), args.rows)
            del dit, ctx
        positions = args.text + args.ref + args.frames + args.pad  # of one row
        if "gemm" in args.stages:
            block_gemms(2 * args.batch * positions)
        if "position" in args.stages:
            position_convs(args.frames, 8)
        if "norms" in args.stages:
            norm_kernels(2 * args.batch * positions)
        if "attention" in args.stages:
            attention_backends(positions, args.masked)
        if "decode" in args.stages:
            vae = AuKVAE(VAEConfig()).cuda().eval().requires_grad_(False)
            latents = torch.randn(1, args.decode_frames, 64, device="cuda")
            profile(f"VAE decode, {args.decode_frames} frames, convolution activations",
                    lambda: vae.decode(latents), args.rows)
            path = wire_vae_kernels(vae, fast_paths())
            profile(f"VAE decode, {args.decode_frames} frames, {path} (the pipeline's)",
                    lambda: vae.decode(latents), args.rows)
            vae.branch_streams = [torch.cuda.Stream() for _ in range(vae.blocks_per_stage - 1)]  # as the wiring does
            decode_graphs = DecodeGraphs(vae, max_graphs=1)
            replay_s = timed(lambda: decode_graphs.decode(latents), 10)
            print(f"   replayed from its length's graph: {replay_s * 1e3:.2f} ms", flush=True)
            wav = torch.randn(1, args.mel_frames * 240, device="cuda")  # the reference clip at 24 kHz
            profile(f"VAE encode, {wav.shape[1] / 24000:.1f} s clip", lambda: vae.encode(wav), args.rows)
            graphs = EncodeGraphs(vae, 24_000)
            print(f"   replayed from its bucket's graph: {timed(lambda: graphs.encode(wav), 10) * 1e3:.2f} ms", flush=True)
            del vae
        if "audio" in args.stages or "encode" in args.stages:
            qwen_dir = Path(tempfile.mkdtemp(prefix="auk-qwen-")) / "qwen"
            write_tiny_qwen(qwen_dir)
            config = release_thinker_config(qwen_dir)
            if "encode" not in args.stages:
                config.text_config.num_hidden_layers = 1  # only the audio tower is timed
            with torch.device("cuda"):
                trunk = ThinkerTrunk(config).to(torch.bfloat16).eval().requires_grad_(False)
        if "audio" in args.stages:
            features = torch.randn(1, 128, args.mel_frames, device="cuda")
            mask = torch.ones(1, args.mel_frames, dtype=torch.long, device="cuda")
            profile(f"audio tower, {args.mel_frames} mel frames", lambda: trunk.embed_audio(features, mask), args.rows)
            trunk.audio_runner = AudioTowerGraphs(AudioTowerRunner(trunk.audio_tower))
            replay_s = timed(lambda: trunk.embed_audio(features, mask), 10)
            print(f"   replayed from its chunk count's graph: {replay_s * 1e3:.2f} ms", flush=True)
            trunk.audio_runner = None
        if "encode" in args.stages:
            encoder = ThinkerEncoder(PromptProcessor.from_pretrained(qwen_dir), trunk, torch.randn(36), torch.ones(1))
            encoder.graphs = EncoderGraphs(encoder, (64, 128, 192, 256, 384, 512))
            encoder.graphs.capture_all()
            instruction = "Speak slowly and warmly. " * 4
            batch = encoder.processor(instruction, None)
            ids = batch["input_ids"].cuda()
            embeds = trunk.embed(ids)
            print(f"\n== thinker encode, {ids.shape[1]} prompt tokens (text only):", flush=True)
            for name, fn in (
                ("processor (CPU)", lambda: encoder.processor(instruction, None)),
                ("embedding lookup", lambda: trunk.embed(ids)),
                ("text model + fusion, graph", lambda: encoder.graphs.fuse(embeds)),
                ("text model + fusion, eager", lambda: encoder.fuse(embeds)),
                ("whole encode", lambda: encoder.encode(instruction, None)),
            ):
                print(f"   {name:28s} {timed(fn, 10) * 1e3:7.2f} ms", flush=True)
            # The zero-shot form, many times: where a slow render's extra thinker time goes (the CPU's features and
            # tokens, or the GPU's audio tower and text model), read from the spread rather than the median.
            clip_16k = (0.1 * np.random.default_rng(0).standard_normal(5 * 16_000)).astype(np.float32)
            trunk.audio_runner = AudioTowerGraphs(AudioTowerRunner(trunk.audio_tower))
            print("\n== thinker encode with a 5 s clip, 50 runs each: median / 90th percentile / max", flush=True)
            for name, fn in (
                ("processor (CPU)", lambda: encoder.processor(instruction, clip_16k)),
                ("whole encode", lambda: encoder.encode(instruction, clip_16k)),
            ):
                fn()  # untimed first call
                runs = sorted(durations(fn, 50))
                median, p90, worst = (runs[i] * 1e3 for i in (25, 44, -1))
                print(f"   {name:28s} {median:7.2f} / {p90:7.2f} / {worst:7.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
