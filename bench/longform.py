"""Long-text benchmark: time to the first segment's audio and to the whole file, for texts of 500, 4 096 and
20 000 characters, rendered as the worker renders a long job (``auk_worker/longform/render.py``: a described voice,
its first segment alone, the rest in groups of the deploy config's ``max_num_seqs``).

    python -m bench.longform --tiny              # the tiny checkpoint on the CPU (output is noise; a check it runs)
    python -m bench.longform                     # release-size random weights on the GPU

Also checked and reported, per text: the file's length against the plan (to the sample) and against the
unrounded estimate (within one frame per segment), the number of render_batch calls (GPU passes) and, with
``--repeat``, that a seeded render gives the same samples run to run. A 3 000-character Chinese text is included
(``--chinese``, on by default). Times are wall seconds from the call to the joined waveform on the host; the
first-audio time is when the first part of the file was final (what a stream could send).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from auk_worker.deploy import load_deploy_config
from auk_worker.longform import plan as plans
from auk_worker.longform.duration import Estimator
from auk_worker.longform.render import Hooks, render_plan
from auk_worker.types import FRAME_RATE, SAMPLE_RATE
from bench.common import write_result

REPO = Path(__file__).resolve().parent.parent
SENTENCES = [
    "The lighthouse keeper climbed the stairs each evening, counting every step.",
    "Storms came and went; the light never failed!",
    "Did anyone thank him?",
    "Ships passed in the dark, their crews asleep, trusting a lamp they would never see up close.",
]
CHINESE = "今天天气很好，我们一起去公园散步。孩子们在草地上奔跑，老人们坐在长椅上聊天！"


def english(chars: int) -> str:
    out, i = [], 0
    while sum(len(s) + 1 for s in out) < chars:
        out.append(f"Night {i}. " + SENTENCES[i % len(SENTENCES)])
        i += 1
    return " ".join(out)[:chars].rstrip(" ,;") + "."


def chinese(chars: int) -> str:
    return (CHINESE * (chars // len(CHINESE) + 1))[:chars]


def request(text: str) -> SimpleNamespace:
    return SimpleNamespace(text=text, task=None, instruction=None, description="A calm, warm narrator.", style=None,
                           language=None, speed=None, gen_seconds=None, ref_text=None)  # fmt: skip


def measure(pipe, name: str, text: str, steps: int | None, seed: int, repeat: int) -> dict:
    planned = plans.plan_request(request(text), None)
    est = Estimator()
    unrounded = sum(est(s["text"]) for s in planned["segments"])
    unrounded += sum(s["pause"] - plans.CROSSFADE_S for s in planned["segments"][:-1])
    group = pipe.deploy.dit.max_num_seqs
    runs, waves = [], []
    for _ in range(repeat):
        if pipe.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = render_plan(pipe, planned, None, {"seed": seed, "num_inference_steps": steps}, Hooks(), group)
        total_s = time.perf_counter() - started
        runs.append({"first_audio_s": round(result.first_audio_s, 4), "total_s": round(total_s, 4)})
        waves.append(result.waveform)
    samples = len(waves[0])
    segments = len(planned["segments"])
    out = {
        "text": name,
        "characters": len(text),
        "segments": segments,
        "passes": result.passes,
        "group_size": group,
        "seconds_of_audio": round(samples / SAMPLE_RATE, 3),
        "estimate_s": round(unrounded, 3),
        "samples": samples,
        "planned_samples": planned["samples"],
        "length_as_planned": samples == planned["samples"],
        "frames_off_estimate": round(abs(samples / SAMPLE_RATE - unrounded) * FRAME_RATE, 2),
        "within_one_frame_per_segment": abs(samples / SAMPLE_RATE - unrounded) * FRAME_RATE <= segments,
        "identical_run_to_run": all(np.array_equal(w, waves[0]) for w in waves[1:]) if repeat > 1 else None,
        "runs": runs,
        "first_audio_s": min(r["first_audio_s"] for r in runs),
        "total_s": min(r["total_s"] for r in runs),
        "real_time_factor": round(min(r["total_s"] for r in runs) / (samples / SAMPLE_RATE), 5),
    }
    print(f"{name:>16}: {len(text):6d} chars, {segments:3d} segments, {result.passes:3d} passes, "
          f"{samples / SAMPLE_RATE:8.1f} s audio; first audio {out['first_audio_s']:.3f} s, "
          f"whole {out['total_s']:.2f} s; "
          f"as planned {out['length_as_planned']}, {out['frames_off_estimate']} frames off the estimate, "
          f"identical {out['identical_run_to_run']}", flush=True)  # fmt: skip
    return out


def seam(seconds: float = 60.0, hz: float = 440.0) -> dict:
    """The windows' seam on a test tone (``--seam``; no model): a pass-through render of each window of a
    ``seconds`` tone, joined as a long recording is (equal-amplitude curves over ``OVERLAP_FRAMES``), against the
    tone itself; then the same with equal-power curves, and with unrelated noise in each window (what a render
    that does not repeat itself in the overlap gives), to show what each curve does to the level at a seam."""
    from auk_worker.longform.join import join
    from auk_worker.longform.windows import OVERLAP_FRAMES, plan_windows
    from auk_worker.types import HOP

    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    tone = (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    windows = plan_windows(len(tone) // HOP)
    block = SAMPLE_RATE // 100  # 10 ms

    def envelope_db(x: np.ndarray, ref: np.ndarray) -> float:
        n = len(ref) // block * block
        rx = np.sqrt(np.mean(np.square(x[:n].reshape(-1, block)), axis=1))
        rr = np.sqrt(np.mean(np.square(ref[:n].reshape(-1, block)), axis=1))
        return float(np.max(np.abs(20 * np.log10((rx + 1e-12) / (rr + 1e-12)))))

    def joined(parts: list[np.ndarray], curve: str) -> np.ndarray:
        return join(parts, [0] * len(parts), SAMPLE_RATE, crossfade=OVERLAP_FRAMES * HOP, curve=curve, loudness=False)

    cut = [tone[w.start * HOP : (w.start + w.length) * HOP][w.trim * HOP :] for w in windows]
    out = {"tone_hz": hz, "seconds": seconds, "windows": len(windows), "overlap_s": OVERLAP_FRAMES / FRAME_RATE}
    for curve in ("amplitude", "power"):
        y = joined(cut, curve)
        error = float(np.max(np.abs(y - tone[: len(y)])))
        out[f"tone_{curve}"] = {"max_error_dbfs": round(20 * np.log10(error + 1e-12), 1),
                                "envelope_max_dev_db": round(envelope_db(y, tone[: len(y)]), 3)}  # fmt: skip
    rng = np.random.default_rng(0)
    noise = [0.1 * rng.standard_normal(len(part)).astype(np.float32) for part in cut]
    for curve in ("amplitude", "power"):
        y = joined(noise, curve)
        level = np.sqrt(np.mean(np.square(np.concatenate(noise))))
        n = len(y) // block * block
        rms = np.sqrt(np.mean(np.square(y[:n].reshape(-1, block)), axis=1))
        out[f"unrelated_{curve}"] = {"seam_min_db": round(float(20 * np.log10(rms.min() / level)), 2),
                                     "seam_max_db": round(float(20 * np.log10(rms.max() / level)), 2)}  # fmt: skip
    print(json.dumps(out, indent=1))
    return out


def load(args: argparse.Namespace):
    deploy = load_deploy_config(Path(args.deploy_config))
    if args.tiny:
        from auk_worker.tiny.checkpoint import make_tiny_checkpoint
        from auk_worker.pipeline import AuKPipeline

        root = tempfile.mkdtemp(prefix="auk-tiny-")
        return AuKPipeline.load(make_tiny_checkpoint(f"{root}/base"), deploy, device=args.device)
    from auk_worker.pipeline import resolve_precision
    from bench.models import random_pipeline

    device = torch.device(args.device)
    return random_pipeline("base", device, resolve_precision(deploy.dit.dtype, device), deploy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.longform", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint instead of release-size weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--deploy-config", default=str(REPO / "config" / "auk-bulk.yaml"),
                        help="deploy config (default auk-bulk.yaml: groups of 8)")  # fmt: skip
    parser.add_argument("--chars", type=int, nargs="+", default=[500, 4096, 20_000])
    parser.add_argument("--no-chinese", action="store_true", help="leave out the 3 000-character Chinese text")
    parser.add_argument("--steps", type=int, default=None, help="Euler steps (default: the deploy config's)")
    parser.add_argument("--repeat", type=int, default=2, help="renders per text (identity checked across them)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    parser.add_argument("--tag", default="", help="appended to the results file's name")
    parser.add_argument("--seam", action="store_true", help="only the windows' seam on a test tone (no model)")
    args = parser.parse_args(argv)
    if args.seam:
        path = write_result("longform-seam", {"benchmark": "longform seam", "results": seam()},
                            Path(args.out) if args.out else None)  # fmt: skip
        print(f"written {path}")
        return 0
    started = time.perf_counter()
    pipe = load(args)
    load_s = time.perf_counter() - started
    texts = [(f"english-{n}", english(n)) for n in args.chars]
    if not args.no_chinese:
        texts.insert(2 if len(texts) > 2 else len(texts), ("chinese-3000", chinese(3000)))
    rows = [measure(pipe, name, text, args.steps, args.seed, args.repeat) for name, text in texts]
    payload = {
        "benchmark": "longform",
        "mode": "tiny" if args.tiny else "release-size random weights",
        "deploy_config": Path(args.deploy_config).name,
        "steps": args.steps or pipe.deploy.defaults.num_inference_steps,
        "load_s": round(load_s, 2),
        "results": rows,
    }
    name = ("longform-tiny" if args.tiny else "longform") + (f"-{args.tag}" if args.tag else "")
    path = write_result(name, payload, Path(args.out) if args.out else None)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
