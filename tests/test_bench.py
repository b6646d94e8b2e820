"""The CPU benchmark stays runnable: `python -m bench.pipeline --tiny --device cpu` writes a complete result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_tiny_pipeline_benchmark_runs(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.pipeline", "--tiny", "--device", "cpu", "--runs", "1", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = tmp_path.glob("pipeline-tiny-cpu-*.json")
    result = json.loads(path.read_text())
    assert set(result["latency"]) == {"base zero-shot", "base instruct", "flash zero-shot"}
    for kind in result["latency"].values():
        for seconds, row in kind.items():
            assert row["samples"] == int(seconds.rstrip("s")) * 24_000
            assert row["wall_s"] > 0 and row["stages_ms"]["dit"] > 0
    assert result["environment"]["torch"]
