"""The built-in voice catalogue and the speech wording: strict loading, OpenAI's names, AuK's sentences, the length
estimate and the speed rule."""

from __future__ import annotations

import pytest

from auk_worker import rules
from auk_worker.errors import InputError
from auk_worker.longform.duration import check_agreement, language_code
from auk_worker.voice_catalogue import CatalogueError, load_catalogue, parse_catalogue

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")  # fmt: skip


def test_the_shipped_catalogue_holds_openais_names_and_default_each_distinct() -> None:
    catalogue = load_catalogue()
    assert set(OPENAI_VOICES) | {"default"} <= set(catalogue.names)
    voices = list(catalogue.voices.values())
    assert len({v.description for v in voices}) == len(voices) and len({v.seed for v in voices}) == len(voices)
    assert all(rules.SEED.problem(v.seed) is None for v in voices)
    assert catalogue.get("Alloy") is catalogue.get("alloy") and catalogue.get("nobody") is None


@pytest.mark.parametrize(("raw", "named"), [
    ({"voices": [{"name": "default", "description": "x", "seed": 1}], "extra": 1}, "one key"),
    ({"voices": [{"name": "default", "description": "x"}]}, "voices[0]"),
    ({"voices": [{"name": "Bad Name", "description": "x", "seed": 1}]}, "Bad Name"),
    ({"voices": [{"name": "default", "description": " ", "seed": 1}]}, "description"),
    ({"voices": [{"name": "default", "description": "x", "seed": -1}]}, "seed must be in"),
    ({"voices": [{"name": "default", "description": "x", "seed": 1}, {"name": "default", "description": "y",
                                                                        "seed": 2}]}, "twice"),
    ({"voices": [{"name": "alloy", "description": "x", "seed": 1}]}, "'default'"),
])  # fmt: skip
def test_a_bad_catalogue_is_refused_naming_the_entry(raw: dict, named: str) -> None:
    with pytest.raises(CatalogueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_catalogue(raw)


def test_languages_are_codes_or_the_names_clients_send() -> None:
    assert [language_code(name) for name in ("English", "zh-CN", "German", "auto", None, "pt_BR")] == [
        "en", "zh", "de", None, None, "pt"]
    with pytest.raises(InputError, match="language: 'Klingon' is neither an ISO 639 code"):
        language_code("Klingon")


def test_speed_and_duration_are_refused_only_when_they_disagree() -> None:
    check_agreement(5.0, 5.0, 1.0)  # speed 1 never disagrees
    check_agreement(2.6, 5.0, 2.0)  # 5 s of text in 2.6 s: about speed 2
    with pytest.raises(InputError, match="speed 2 and duration_seconds 10 disagree"):
        check_agreement(10.0, 5.0, 2.0, "duration_seconds")
    with pytest.raises(InputError, match="speed 0.5 and gen_seconds 1 disagree"):
        check_agreement(1.0, 5.0, 0.5)
