"""The built-in voices: names that stand for a written description and a fixed seed (``config/voices.yaml``).

AuK makes a voice from a description (instruct TTS), so a named voice needs no clip: ``nova`` is a sentence in
AuK's instruct wording and a seed. The same name, text and knobs render the same bytes, run to run and worker to
worker, because nothing else goes into the render (the seed seeds the job's own generator, never a global one).

The file is read strictly, once per process: a missing or unknown key, a blank description, a seed outside
[0, 2^63) or a repeated name is a ``CatalogueError`` naming the entry, raised where the catalogue is first used
(the API loads it at start-up). ``AUK_VOICES_FILE`` (``Settings.voices_file``) names another file in place of the
shipped one.

Torch-free: the API, the worker and the CLI all import it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from auk_worker import rules

DEFAULT_FILE = Path(__file__).resolve().parent.parent / "config" / "voices.yaml"
DEFAULT_VOICE = "default"
NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
MAX_DESCRIPTION_CHARS = 1000


class CatalogueError(ValueError):
    """The voices file is not what the service can serve (an operator's error, raised at start-up)."""


@dataclass(frozen=True)
class NamedVoice:
    """One built-in voice: its name, its description in AuK's instruct wording and its seed."""

    name: str
    description: str
    seed: int

    def public(self) -> dict:
        """The API's JSON shape of a built-in voice."""
        return {"voice_id": self.name, "object": "voice", "name": self.name, "source": "builtin",
                "description": self.description, "seed": self.seed}  # fmt: skip


@dataclass(frozen=True)
class VoiceCatalogue:
    voices: Mapping[str, NamedVoice]

    def get(self, name: str) -> NamedVoice | None:
        """The voice called ``name`` (case-insensitive, as OpenAI's SDKs send ``Alloy`` or ``alloy``)."""
        return self.voices.get(name.strip().lower()) if isinstance(name, str) else None

    @property
    def names(self) -> list[str]:
        return list(self.voices)

    @property
    def default(self) -> NamedVoice:
        return self.voices[DEFAULT_VOICE]


def parse_catalogue(raw: object, source: str = "voices file") -> VoiceCatalogue:
    """The catalogue in ``raw`` (the YAML document), checked entry by entry."""
    if not isinstance(raw, dict) or set(raw) != {"voices"} or not isinstance(raw["voices"], list):
        raise CatalogueError(f"{source}: expected one key, 'voices', holding a list")
    voices: dict[str, NamedVoice] = {}
    for index, entry in enumerate(raw["voices"]):
        where = f"{source}: voices[{index}]"
        if not isinstance(entry, dict) or set(entry) != {"name", "description", "seed"}:
            raise CatalogueError(f"{where}: expected exactly the keys name, description, seed")
        name, description, seed = entry["name"], entry["description"], entry["seed"]
        if not isinstance(name, str) or not NAME.match(name):
            raise CatalogueError(f"{where}: name {name!r} must match {NAME.pattern}")
        if name in voices:
            raise CatalogueError(f"{where}: the name {name!r} is given twice")
        if not isinstance(description, str) or not description.strip() or len(description) > MAX_DESCRIPTION_CHARS:
            raise CatalogueError(f"{where} ({name}): the description must be 1 to {MAX_DESCRIPTION_CHARS} characters")
        if rules.SEED.problem(seed) is not None:
            raise CatalogueError(f"{where} ({name}): seed {rules.SEED.problem(seed)}, got {seed!r}")
        voices[name] = NamedVoice(name, description.strip(), int(seed))
    if DEFAULT_VOICE not in voices:
        raise CatalogueError(f"{source}: there must be a voice named {DEFAULT_VOICE!r}")
    return VoiceCatalogue(voices)


@cache
def load_catalogue(path: Path | str | None = None) -> VoiceCatalogue:
    """The catalogue at ``path``, else the shipped ``config/voices.yaml`` (read once per path)."""
    file = Path(path or DEFAULT_FILE)
    try:
        raw = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise CatalogueError(f"cannot read the voices file {file}: {exc}") from None
    except yaml.YAMLError as exc:
        raise CatalogueError(f"{file}: not valid YAML: {exc}") from None
    return parse_catalogue(raw, str(file))
