"""Hand-written Triton kernels run by Triton's CPU interpreter. The interpreter is chosen when the kernels are
defined, so each check runs in a Python process of its own with TRITON_INTERPRET=1; tests/test_gpu.py runs the
compiled kernels on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on the CPU)"
)


def run_in_interpreter(module: str, check: str) -> None:
    """Call ``module.check()`` in a fresh interpreter-mode process; its failure fails the calling test."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"from {module} import {check}; {check}()"
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
