"""The built-in voice catalogue and the speech wording: strict loading, OpenAI's names, AuK's sentences, the length
estimate and the speed rule."""

from __future__ import annotations

import pytest

from auk_worker import rules, wording
from auk_worker.errors import InputError
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


def test_the_sentences_are_the_cookbooks() -> None:
    assert wording.instruct("A calm voice.", 'Say "hi".') == (
        'Generate speech based on the following description: "A calm voice.". The content to speak is: '
        '"Say \\"hi\\".".'
    )
    assert wording.instruct("温柔的女声", "你好") == '请基于下面的描述: "温柔的女声",生成语音内容"你好".'
    assert wording.zero_shot("Hello.") == 'Say the following with the same voice: "Hello."'
    assert wording.describe("A calm voice", "whisper") == "A calm voice. Speaking style: whisper"
    assert wording.describe("A calm voice.", None) == "A calm voice."


def test_the_estimate_follows_speed_language_and_transcript() -> None:
    text = "x" * 140
    assert wording.estimate_seconds(text) == round(140 / 14 + 0.3, 2)
    assert wording.estimate_seconds(text, speed=2.0) == round((140 / 14 + 0.3) / 2, 2)
    assert wording.estimate_seconds("今天天气真好") == wording.estimate_seconds("今天天气真好", lang=wording.language("zh"))
    assert wording.estimate_seconds("abcd", ref_text="ab", ref_seconds=1.5) == 3.0  # upstream's byte ratio
    assert wording.estimate_seconds("a", speed=4.0) == wording.MIN_ESTIMATE_S
    with pytest.raises(InputError, match="language: unknown language 'Klingon'.*English"):
        wording.language("Klingon")


def test_speed_and_duration_are_refused_only_when_they_disagree() -> None:
    wording.check_agreement(5.0, 5.0, 1.0)  # speed 1 never disagrees
    wording.check_agreement(2.6, 5.0, 2.0)  # 5 s of text in 2.6 s: about speed 2
    with pytest.raises(InputError, match="speed 2 and duration_seconds 10 disagree"):
        wording.check_agreement(10.0, 5.0, 2.0)
    with pytest.raises(InputError, match="gen_seconds"):
        wording.check_agreement(1.0, 5.0, 0.5, "gen_seconds")
