"""The documents stay a short README plus topic pages, and their links and lists stay true to the repository.

- The README is a reference of at most 15 KB that opens with the two commands, ``make run`` and ``make test``.
- Every relative link in the README and under ``docs/`` names a file that exists, and a ``#fragment`` names one of
  its headings (GitHub's anchors).
- The fast-path names listed in ``docs/config.md`` are the fields of ``FastPaths``, no more, no fewer.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_BYTES = 15_000
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_the_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.encode()) <= MAX_README_BYTES, f"README.md is {len(text.encode())} bytes"
    first_block = text.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in first_block[:2]] == [["make", "run"], ["make", "test"]]


def test_every_relative_link_resolves():
    broken = []
    for page in [README, *DOCS]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file_part, _, fragment = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_fast_path_names_are_the_seams_own():
    from auk_worker.pipeline.fastpaths import FastPaths

    text = (ROOT / "docs" / "config.md").read_text()
    listed = text.split("Names:", 1)[1].split("(`auk_worker/pipeline/fastpaths.py`", 1)[0]
    assert set(re.findall(r"`([a-z_0-9]+)`", listed)) == {field.name for field in dataclasses.fields(FastPaths)}

