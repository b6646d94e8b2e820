"""The ``auk`` command: render locally, make the tiny checkpoint, download weights, run a worker, talk to the API.

    auk render --checkpoint DIR --instruction TEXT [--audio FILE] [--gen-seconds S] [--format flac] --out FILE
    auk make-tiny-checkpoint OUT [--variant base|flash]
    auk download DEST [--variant base|flash]
    auk worker ...            (Celery worker; see `auk worker --help`)
    auk submit|status|wait|fetch ...   (REST API client)
    auk page BATCH_ID | cancel ID      (a batch's listening-page link; cancel a job or batch)

Heavy imports (torch, the model) happen inside the subcommands, so `auk submit` starts fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from auk_worker.errors import AuKError

CLIENT_COMMANDS = ("submit", "status", "wait", "fetch")
BATCH_COMMANDS = ("page", "cancel")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        from auk_worker.service.worker.main import main_worker

        return main_worker(argv[1:])
    if argv and argv[0] in BATCH_COMMANDS:
        from auk_client.cli_batches import main_batches

        return main_batches(argv[0], argv[1:])
    if argv and argv[0] in CLIENT_COMMANDS:
        from auk_client.cli import main_client

        return main_client(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except AuKError as exc:
        print(f"auk: error: {exc.message}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="auk", description="AuK speech rendering.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress of loading and rendering")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    render = sub.add_parser("render", help="render one clip on this machine")
    render.add_argument("--checkpoint", required=True, type=Path, help="release directory (config.yaml, weights)")
    render.add_argument("--instruction", required=True, help="what to do, e.g. a zero-shot or instruct TTS instruction")
    render.add_argument("--audio", help="optional clip: reference voice or source to edit")
    render.add_argument("--gen-seconds", type=float, help="target length (default: the clip's length)")
    render.add_argument("--seed", type=int, help="seed (default: the deploy config's)")
    render.add_argument("--steps", type=int, help="Euler steps (base; Flash pins 4)")
    render.add_argument("--cfg", type=float, help="guidance scale (base; Flash uses none)")
    render.add_argument("--sway", type=float, help="sway of the time grid, in [-1, 0]")
    render.add_argument("--vae-sample", action="store_true", help="sample the clip's VAE posterior instead of its mean")
    render.add_argument("--precision", choices=("exact", "fast", "fp8"),
                        help="fp32 everywhere; bf16 DiT and thinker; or bf16 with the DiT's block linears in FP8")
    render.add_argument("--device", help="torch device (default: from the deploy config, CPU without CUDA)")
    render.add_argument("--qwen-path", type=Path, help="Qwen2.5-Omni-3B snapshot, if not where config.yaml says")
    render.add_argument("--deploy-config", type=Path, help="deploy config (default: config/auk.yaml)")
    render.add_argument("--format", default="wav",
                        help="output format: wav, wav_float, flac, mp3, opus or pcm (default wav, 16-bit)")
    render.add_argument("--out", required=True, type=Path, help="output file path")
    render.set_defaults(run=_render)

    tiny = sub.add_parser("make-tiny-checkpoint", help="write a tiny random checkpoint in the release layout")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--variant", choices=("base", "flash"), default="base")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_make_tiny)

    download = sub.add_parser("download", help="download the released weights from the Hugging Face hub")
    download.add_argument("dest", type=Path, help="folder for AuK[-Flash]/ and Qwen2.5-Omni-3B/")
    download.add_argument("--variant", choices=("base", "flash"), default="base")
    download.add_argument("--revision", help="a hub revision (default: main)")
    download.set_defaults(run=_download)

    for name in ("worker", *CLIENT_COMMANDS, *BATCH_COMMANDS):
        sub.add_parser(name, help=f"see `auk {name} --help`", add_help=False)
    return parser


def _render(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from auk_worker.audio import read_audio_file
    from auk_worker.deploy import load_deploy_config
    from auk_worker.pipeline import AuKPipeline
    from auk_worker.formats import encode, get_format
    from auk_worker.types import RenderRequest

    spec = get_format(args.format)  # an unknown format is refused before the model loads
    deploy = load_deploy_config(args.deploy_config)
    request = RenderRequest(
        instruction=args.instruction,
        audio=read_audio_file(args.audio) if args.audio else None,
        gen_seconds=args.gen_seconds,
        num_inference_steps=args.steps,
        guidance_scale=args.cfg,
        sway=args.sway,
        seed=args.seed,
        vae_sample=args.vae_sample,
    )
    pipe = AuKPipeline.load(args.checkpoint, deploy, precision=args.precision, device=args.device, qwen_path=args.qwen_path)
    bars: list[tqdm] = []

    def on_step(step: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, desc="denoising", unit="step", leave=False))
        bars[0].update(step - bars[0].n)

    try:
        result = pipe.render(request, on_step=on_step)
    finally:
        for bar in bars:
            bar.close()
    args.out.write_bytes(encode(result.waveform, spec, result.sample_rate))
    stages = ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in result.timings.items())
    print(
        f"{args.out}: {result.duration_s:.2f} s at {result.sample_rate} Hz ({len(result.waveform)} samples), "
        f"seed {result.seed}, {result.num_inference_steps} steps, cfg {result.guidance_scale:g}; {stages}"
    )
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from auk_worker.tiny.checkpoint import make_tiny_checkpoint

    out = make_tiny_checkpoint(args.out, variant=args.variant, seed=args.seed)
    print(f"{out}: tiny {args.variant} checkpoint (random weights: its audio is noise)")
    return 0


def _download(args: argparse.Namespace) -> int:
    from auk_worker.checkpoint import download_release

    release = download_release(args.dest, variant=args.variant, revision=args.revision)
    print(f"{release}: downloaded; render with `auk render --checkpoint {release} ...`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
