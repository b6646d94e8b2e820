"""``AUK_VOICES_FILE``: an operator's own catalogue of built-in voices replaces the shipped one everywhere the API
names voices: the listing, a job's voice, the default voice of a text given without one, and the names a caller's
own voice may not take."""

from __future__ import annotations

from pathlib import Path

import yaml
from fastapi.testclient import TestClient

from api.app import create_app
from auk_worker.service.connect.settings import Settings

KEY = "key-voices-file-0123456789"
VOICES = {"voices": [
    {"name": "default", "description": "A calm middle-aged woman speaking slowly in a low voice.", "seed": 11},
    {"name": "narrator", "description": "An old man with a deep, warm voice telling a story.", "seed": 22},
]}  # fmt: skip


def test_an_operators_voices_file_is_the_catalogue(service_env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "voices.yaml"
    path.write_text(yaml.safe_dump(VOICES))
    env = {**service_env, "AUK_API_KEYS": KEY, "AUK_VOICES_FILE": str(path), "AUK_VARIANT_CHECK": "off"}
    settings = Settings.from_env(env)
    assert settings.voices_file == path
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(create_app(settings)) as http:
        listed = http.get("/v1/voices", headers=auth)
        assert listed.status_code == 200, listed.text
        assert sorted(v["name"] for v in listed.json()["builtin"]) == ["default", "narrator"]

        named = http.post("/v1/jobs", json={"input": "Once upon a time.", "voice": "narrator"}, headers=auth)
        assert named.status_code == 202, named.text
        assert named.json()["request"]["seed"] == 22
        assert "An old man with a deep, warm voice" in named.json()["request"]["plan"]["instruction"]

        unnamed = http.post("/v1/jobs", json={"input": "Once upon a time."}, headers=auth)
        assert unnamed.status_code == 202, unnamed.text
        assert unnamed.json()["request"]["seed"] == 11
        assert "A calm middle-aged woman" in unnamed.json()["request"]["plan"]["instruction"]

        shipped = http.post("/v1/jobs", json={"input": "Hello.", "voice": "alloy"}, headers=auth)
        assert shipped.status_code == 422 and "narrator" in shipped.text, shipped.text

        taken = http.post("/v1/voices", json={"name": "narrator", "description": "Someone else."}, headers=auth)
        assert taken.status_code == 422 and "built-in voice" in taken.text, taken.text
