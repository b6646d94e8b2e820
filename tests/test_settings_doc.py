"""docs/settings.md's table lists exactly the AUK_* variables the settings object reads: recorded while
``Settings.from_env`` reads an empty environment, and named in the settings module's source (a name read only on
some path still appears there)."""

from __future__ import annotations

import re
from pathlib import Path

from auk_worker.service.connect import settings as settings_module
from auk_worker.service.connect.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


class _Recorder(dict):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def get(self, key, default=None):
        self.seen.add(key)
        return default


def variables_read() -> set[str]:
    env = _Recorder()
    Settings.from_env(env)
    named = set(re.findall(r'"(AUK_[A-Z0-9_]+)"', Path(settings_module.__file__).read_text()))
    return {name for name in env.seen if name.startswith("AUK_")} | named


def variables_documented() -> list[str]:
    rows = re.findall(r"^\| `(AUK_[A-Z0-9_]+)` \|", (ROOT / "docs" / "settings.md").read_text(), flags=re.M)
    return rows


def test_the_settings_page_lists_every_variable_the_settings_read():
    documented = variables_documented()
    assert len(documented) == len(set(documented)), "a variable is listed twice in docs/settings.md"
    read = variables_read()
    assert not read - set(documented), f"read but not in docs/settings.md: {sorted(read - set(documented))}"
    assert not set(documented) - read, f"in docs/settings.md but not read: {sorted(set(documented) - read)}"


def test_no_service_module_reads_an_auk_variable_outside_the_settings():
    """Every ``AUK_*`` the service reads goes through ``Settings``; the user CLI (auk_client) reads its own two."""
    offenders = []
    for path in sorted([*(ROOT / "auk_worker").rglob("*.py"), *(ROOT / "api").rglob("*.py")]):
        if path == Path(settings_module.__file__):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""(environ|getenv)\b.*["']AUK_""", line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
