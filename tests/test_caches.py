"""AUK_CACHE_DIR points torch's and Triton's compile caches at one directory, leaving what the operator set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from auk_worker.service.worker.caches import CACHE_VARIABLES, use_compile_caches
from auk_worker.service.connect.settings import Settings


def test_the_caches_go_under_the_directory_and_operator_settings_win(tmp_path: Path) -> None:
    env = {"TRITON_CACHE_DIR": "/elsewhere/triton"}
    chosen = use_compile_caches(tmp_path / "cache", env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert (tmp_path / "cache" / "inductor").is_dir()
    assert env["TRITON_CACHE_DIR"] == "/elsewhere/triton" and "TRITON_CACHE_DIR" not in chosen
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    assert use_compile_caches(None, env) == {}
    assert Settings.from_env({"AUK_CACHE_DIR": str(tmp_path)}).cache_dir == tmp_path
    assert Settings.from_env({}).cache_dir is None


def test_torch_reads_the_directory_it_was_given(tmp_path: Path) -> None:
    """In a fresh process, set before torch is imported, Inductor's cache directory is the one chosen."""
    code = (
        "import sys; from pathlib import Path; from auk_worker.service.worker.caches import use_compile_caches\n"
        "use_compile_caches(Path(sys.argv[1]))\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "print(cache_dir())\n"
    )
    # A torch that ran in this process has put its default into our environment: the child starts without it.
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                         env=env)  # fmt: skip
    assert out.stdout.strip() == str(tmp_path / "inductor")
