"""``make run`` end to end: ``python -m auk_worker.demo --once`` in a temporary directory on a free API port.

The demo starts its own redis-server, SeaweedFS, worker (tiny checkpoint) and API, renders its batch through the
REST API and stops everything. The test checks the exit status, that every WAV the demo reports exists locally
with the length its request asked for, that the same keys are in the summary it writes, and that no child
process outlives it (found by the API port in their inherited environment).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import soundfile as sf

from auk_worker.service.local import REPO, free_port

REPORTED = re.compile(r"^\s+(demo-\d+): (\S+\.wav) \(([\d.]+) s\) = s3://(\S+?)/(\S+\.wav)$", re.MULTILINE)


def _processes_with_env(marker: str) -> list[int]:
    """PIDs whose environment holds ``marker`` (every child of the demo inherits the test's AUK_API_PORT)."""
    needle = marker.encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ:
            found.append(int(entry.name))
    return found


def test_demo_once_renders_the_batch_and_stops_everything(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUK_")}  # tiny checkpoint, demo settings
    port_marker = f"AUK_API_PORT={free_port()}"
    env.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    env["AUK_API_PORT"] = port_marker.split("=")[1]
    proc = subprocess.Popen([sys.executable, "-m", "auk_worker.demo", "--once", "--workdir", str(tmp_path / "run")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-4000:]
    assert _processes_with_env(port_marker) == []  # redis-server, weed, the worker and the API all stopped

    reported = REPORTED.findall(output)
    assert [r[0] for r in reported] == ["demo-1", "demo-2", "demo-3", "demo-4"], output[-4000:]
    assert "noise" in output  # the tiny checkpoint says what its audio is

    summary = json.loads((tmp_path / "run" / "out" / "demo-results.json").read_text())
    by_id = {entry["custom_id"]: entry for entry in summary if "custom_id" in entry}
    for custom_id, path, seconds, bucket, key in reported:
        wav = Path(path)
        assert wav.parent == tmp_path / "run" / "out"
        info = sf.info(str(wav))
        gen_seconds = by_id[custom_id]["gen_seconds"]
        assert math.isclose(float(seconds), gen_seconds)
        assert info.samplerate == 24_000 and info.channels == 1
        assert info.frames == math.ceil(50 * gen_seconds) * 480
        assert (bucket, key) == (by_id[custom_id]["bucket"], by_id[custom_id]["key"])
        assert key.startswith("demo/jobs/")

    manifest = [entry for entry in summary if "manifest" in entry]
    assert len(manifest) == 1
    lines = [json.loads(line) for line in Path(manifest[0]["manifest"]).read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["demo-1", "demo-2", "demo-3", "demo-4"]
    assert all(line["status"] == "succeeded" for line in lines)
    assert {line["key"] for line in lines} == {r[4] for r in reported}

    credentials = (tmp_path / "run" / "demo.env").read_text()
    assert "AUK_API_KEY=auk-demo-" in credentials
    assert oct((tmp_path / "run" / "demo.env").stat().st_mode & 0o777) == "0o600"
