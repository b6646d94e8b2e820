"""What the benchmarks share: what each records beside its numbers (the machine, the versions, the commit), how a
GPU call is timed, and the kinds of kernel a profile is sorted into."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# The bulk benchmarks' job: a 6 s instruct-TTS line (bench.throughput through the service, bench.pipeline
# --throughput on the pipeline alone), the same prompt so the two compare.
BULK_INSTRUCTION = (
    'Generate speech based on the following description: "A calm, clear adult voice, close to the microphone." '
    'The content to speak is: "Tonight the whole archive is read aloud, one line after another, until morning."'
)


def environment() -> dict:
    import torch

    info = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def commit(checkout: Path = Path(__file__).resolve().parent) -> str:
    """``AUK_COMMIT`` when set, else the checkout's HEAD, marked ``-dirty`` when tracked files differ from it (a
    copied working tree whose HEAD is an older commit says so instead of naming that commit)."""
    if os.environ.get("AUK_COMMIT"):
        return os.environ["AUK_COMMIT"]
    git = lambda *args: subprocess.run(  # noqa: E731
        ["git", *args], capture_output=True, text=True, cwd=checkout, timeout=30
    )
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "unknown"
        changed = git("diff", "--quiet", "HEAD", "--").returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if changed else "")


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_result(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    env = payload.setdefault("environment", environment())
    tag = env["device"].replace(" ", "-").lower()
    path = out_dir / f"{name}-{tag}-{env['date'][:10]}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# Kernel names by kind, first match wins: inductor's generated kernels (named after the ops they fuse, so before
# the rest), the hand-written Triton kernels, attention, matrix products and convolutions; then
# everything else (ATen's own kernels, copies, memsets).
KINDS = (
    ("inductor", ("triton_",)),
    ("hand-written", ("_attention_inputs_kernel", "_modulated_norm_kernel", "_alias_free_kernel",
                      "_position_conv_kernel", "_causal_conv_kernel", "_overlap_add_kernel", "alias_free_activation")),
    ("attention", ("sdpa", "flash", "fmha", "_varlen_attention_kernel")),
    ("matrix products and convolutions", ("nvjet", "gemm", "xmma", "cutlass", "conv", "dgrad")),
)


def kind(kernel: str) -> str:
    """Which of KINDS a kernel name belongs to ("other" for none)."""
    lowered = kernel.lower()
    return next((name for name, marks in KINDS if any(mark in lowered for mark in marks)), "other")


def durations(fn, repeats: int = 20) -> list[float]:
    """Seconds of each of ``repeats`` calls, each from a drained GPU to a drained GPU."""
    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times


def timed(fn, repeats: int = 20) -> float:
    return statistics.median(durations(fn, repeats))
