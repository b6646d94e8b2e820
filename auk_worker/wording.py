"""Speech text into AuK's terms: the instruction wording, the languages a request may name, and the length estimate.

A speech request gives text (``input``), a voice and perhaps a speaking style, a language, a speed and the
transcript of its clip (``ref_text``); AuK takes one instruction and a target length. This module turns the one
into the other, with the upstream cookbook's sentences (auk-model.md 6.2):

- a described voice (instruct TTS): ``Generate speech based on the following description: "<description>". The
  content to speak is: "<text>".``, or its Chinese form ``请基于下面的描述: "<描述>",生成语音内容"<文本>".``
  for Chinese text; a style (OpenAI's ``instructions``) is added to the description;
- a clip (zero-shot TTS): ``Say the following with the same voice: "<text>"``.

The length, when the caller gives none, is estimated as the upstream CLI estimates it: from the clip's transcript,
``ref_seconds * utf8_bytes(text) / utf8_bytes(ref_text) / speed``; otherwise from the text at the language's
speaking rate, divided by ``speed``. ``speed`` acts through the length alone: AuK follows the time it is given.

The long-text work (issue 42) owns a fuller version of these rules (``auk_worker/longform/``); this module is the
minimal form the speech API needs, with the same entry points (``estimate_seconds``, ``instruct``, ``zero_shot``)
so that one can replace the other.

Torch-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from auk_worker.errors import InputError

MIN_SPEED, MAX_SPEED = 0.25, 4.0
MIN_ESTIMATE_S = 0.5  # a word or two still gets time to be said
# How far a given duration may be from the speed's estimate before the two are said to disagree (either way).
SPEED_TOLERANCE = 1.5


@dataclass(frozen=True)
class Language:
    """A language a request may name: its speaking rate (characters a second at speed 1) and its wording."""

    name: str
    chars_per_second: float
    chinese_wording: bool = False


_LANGUAGES = (
    Language("auto", 14.0),
    Language("english", 14.0),
    Language("chinese", 4.5, chinese_wording=True),
    Language("japanese", 7.0),
    Language("korean", 6.5),
    Language("german", 13.0),
    Language("french", 14.0),
    Language("spanish", 14.5),
    Language("italian", 14.0),
    Language("portuguese", 14.0),
    Language("russian", 12.5),
)
# The names and codes a request may give (case-insensitive): vLLM-Omni's names ("English", "Auto") and ISO codes.
LANGUAGES: Mapping[str, Language] = {
    **{lang.name: lang for lang in _LANGUAGES},
    "en": _LANGUAGES[1], "zh": _LANGUAGES[2], "cn": _LANGUAGES[2], "ja": _LANGUAGES[3], "ko": _LANGUAGES[4],
    "de": _LANGUAGES[5], "fr": _LANGUAGES[6], "es": _LANGUAGES[7], "it": _LANGUAGES[8], "pt": _LANGUAGES[9],
    "ru": _LANGUAGES[10], "mandarin": _LANGUAGES[2],
}  # fmt: skip
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")


def language(name: str | None) -> Language:
    """The language ``name`` stands for (None: ``auto``); an ``InputError`` listing the names otherwise."""
    if name is None:
        return LANGUAGES["auto"]
    found = LANGUAGES.get(name.strip().lower()) if isinstance(name, str) else None
    if found is None:
        known = ", ".join(lang.name.capitalize() for lang in _LANGUAGES)
        raise InputError(f"language: unknown language {name!r}; use one of {known} (or their ISO codes)")
    return found


def read_as(lang: Language | None, text: str) -> Language:
    """The language ``text`` is read in: the one named, or for ``auto`` Chinese when the text is mostly CJK
    (characters the Chinese rate fits better than the English one), else ``auto`` itself."""
    lang = lang or LANGUAGES["auto"]
    if lang.name == "auto" and len(_CJK.findall(text)) > len(text.strip()) / 2:
        return LANGUAGES["chinese"]
    return lang


def check_speed(speed: float | None) -> float:
    """``speed`` (default 1.0) when in [0.25, 4.0]."""
    if speed is None:
        return 1.0
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise InputError(f"speed must be a number in [{MIN_SPEED:g}, {MAX_SPEED:g}], got {speed!r}")
    return float(speed)


def estimate_seconds(text: str, *, speed: float = 1.0, lang: Language | None = None, ref_text: str | None = None,
                     ref_seconds: float | None = None) -> float:
    """How long ``text`` takes to say at ``speed``: from the clip's transcript and length when both are known,
    else from the language's rate (``auto`` reads a text that is mostly CJK at the Chinese rate)."""
    text = text.strip()
    if ref_text and ref_text.strip() and ref_seconds:
        seconds = ref_seconds * len(text.encode()) / len(ref_text.strip().encode())
    else:
        seconds = len(text) / read_as(lang, text).chars_per_second + 0.3  # a breath of lead-in and trail
    return round(max(MIN_ESTIMATE_S, seconds / speed), 2)


def check_agreement(duration_s: float, natural_s: float, speed: float,
                    duration_field: str = "duration_seconds") -> None:
    """A given duration with a speed other than 1.0: refused only when the two disagree, i.e. the speed the duration
    implies (``natural_s / duration_s``) is more than ``SPEED_TOLERANCE`` times away from ``speed``."""
    if speed == 1.0:
        return
    implied = natural_s / duration_s
    if speed / SPEED_TOLERANCE <= implied <= speed * SPEED_TOLERANCE:
        return
    raise InputError(f"speed {speed:g} and {duration_field} {duration_s:g} disagree: the text takes about "
                     f"{natural_s:g} s at speed 1, so speed {speed:g} means about {natural_s / speed:.2f} s, and "
                     f"{duration_s:g} s means speed {implied:.2f}; give one of the two, or values that agree")


def quoted(text: str) -> str:
    """``text`` in double quotes, its own quotes escaped (the cookbook's quoting)."""
    return json.dumps(text.strip(), ensure_ascii=False)


def describe(description: str, style: str | None = None) -> str:
    """A voice's description with a speaking style added (OpenAI's ``instructions``)."""
    description = description.strip()
    if not style or not style.strip():
        return description
    if description and description[-1] not in ".!?。！？":
        description += "."
    return f"{description} Speaking style: {style.strip()}"


def instruct(description: str, text: str, lang: Language | None = None) -> str:
    """Instruct TTS: speak ``text`` in the voice ``description`` gives (the Chinese sentence for Chinese text)."""
    if read_as(lang, text).chinese_wording:
        return f"请基于下面的描述: {quoted(description)},生成语音内容{quoted(text)}."
    return (f"Generate speech based on the following description: {quoted(description)}. "
            f"The content to speak is: {quoted(text)}.")


def zero_shot(text: str) -> str:
    """Zero-shot TTS: speak ``text`` in the voice of the clip."""
    return f"Say the following with the same voice: {quoted(text)}"
