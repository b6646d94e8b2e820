"""docker-compose.yml: it validates with ``docker-compose config``, refuses to run without its secrets, and holds
the parts the deployment relies on (persistence, health checks, start order, a GPU per worker)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
REQUIRED = {
    "AUK_API_KEYS": "test-key-1,test-key-2",
    "AUK_S3_ACCESS_KEY": "test-access",
    "AUK_S3_SECRET_KEY": "test-secret-0123456789",
    "AUK_CHECKPOINT_DIR": "/srv/auk/checkpoints",
    "AUK_CHECKPOINT_NAME": "auk-base",
    "AUK_VARIANT": "base",
    "AUK_FLOWER_BASIC_AUTH": "ops:test-flower-password",
}


def _compose(env_overrides: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose); config not validated")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUK_")}
    env.update(env_overrides)
    # An empty project directory copy: no stray .env file can fill in what the test leaves out.
    (tmp_path / "docker-compose.yml").write_text(COMPOSE.read_text())
    return subprocess.run([binary, "-f", str(tmp_path / "docker-compose.yml"), "config", "-q"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_compose_config_validates(tmp_path: Path) -> None:
    proc = _compose(REQUIRED, tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("missing", ["AUK_API_KEYS", "AUK_S3_SECRET_KEY", "AUK_CHECKPOINT_DIR", "AUK_FLOWER_BASIC_AUTH"])
def test_compose_refuses_missing_secrets(tmp_path: Path, missing: str) -> None:
    proc = _compose({k: v for k, v in REQUIRED.items() if k != missing}, tmp_path)
    assert proc.returncode != 0
    assert missing in proc.stderr


def test_compose_structure() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"redis", "seaweedfs", "api", "worker-gpu0"} <= set(services)
    assert "--appendonly" in services["redis"]["command"]
    assert services["seaweedfs"]["image"].startswith("chrislusf/seaweedfs")
    for name in ("redis", "seaweedfs", "api", "worker-gpu0"):
        assert "healthcheck" in services[name], name
    worker = services["worker-gpu0"]
    assert worker["command"][:2] == ["auk", "worker"]
    # Identity from the environment (default "<container host name>-gpu<index>"), never a fixed name that two hosts
    # or two restarts would share; the health check reads the worker's own heartbeat.
    assert "--hostname" not in worker["command"] and "--worker-id" not in worker["command"] and "hostname" not in worker
    assert worker["environment"]["AUK_WORKER_ID"] == "${AUK_WORKER_ID_GPU0:-}"
    assert worker["healthcheck"]["test"] == ["CMD", "python", "-m", "auk_worker.service.ops.probe"]
    assert worker["depends_on"] == {"redis": {"condition": "service_healthy"},
                                    "seaweedfs": {"condition": "service_healthy"}}  # fmt: skip
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["device_ids"] == ["0"]
    assert any(str(v).endswith(":/checkpoints") for v in worker["volumes"])
    # SeaweedFS: only S3 takes requests from the network; the rest is off, signed or mutual TLS (security.toml from
    # the init service, the same settings as the tests' S3Server).
    seaweedfs = services["seaweedfs"]
    assert all(flag in seaweedfs["command"][0] for flag in ("-disableHttp", "-ip.bind=127.0.0.1", "-s3.ip.bind=0.0.0.0"))
    assert "seaweedfs-security:/etc/seaweedfs:ro" in seaweedfs["volumes"]
    assert seaweedfs["depends_on"] == {"seaweedfs-security": {"condition": "service_completed_successfully"}}
    assert services["seaweedfs-security"]["command"][-2:] == ["auk_worker.service.ops.seaweed_security", "/etc/seaweedfs"]
    assert [port.split(":")[0] for port in seaweedfs["ports"]] == ["127.0.0.1"]
    # Flower: the Celery app's own module, loopback only, basic auth from .env.
    flower = services["flower"]
    assert flower["command"][:4] == ["celery", "-A", "auk_worker.service.queues.celery_app", "flower"]
    assert flower["ports"] == ["127.0.0.1:${AUK_FLOWER_PORT:-5555}:5555"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${AUK_FLOWER_BASIC_AUTH:?")
    # No secret has a default: each is written ${VAR:?message}.
    text = COMPOSE.read_text()
    for secret in ("AUK_API_KEYS", "AUK_S3_ACCESS_KEY", "AUK_S3_SECRET_KEY", "AUK_FLOWER_BASIC_AUTH"):
        assert f"${{{secret}:?" in text and f"${{{secret}:-" not in text, secret
