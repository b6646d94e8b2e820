"""How long a text takes to say, for a target length the caller did not give.

Priority, as the upstream CLI has it (``auk-model.md`` 4.4): a given length wins; with a clip and its transcript
(``ref_text``), the clip's own speaking rate, ``clip_seconds * utf8_bytes(text) / utf8_bytes(ref_text) / speed``;
otherwise a speaking rate per writing system, divided by ``speed`` (OpenAI's, 0.25-4.0).

The rates count characters as written, spaces and punctuation included, so that a text's estimate is the sum of
its pieces' (what splitting needs), and come from published speaking rates:

- Latin: 15.0 characters a second. Audiobook narration runs at 150-160 words a minute (Williams, "Guidelines for
  the use of multimedia in instruction", Proc. HFES 42nd Annual Meeting, 1998, pp. 1447-1451), and an English word
  averages 4.79 letters (Norvig, "English Letter Frequency Counts: Mayzner Revisited", 2013, over Google Books),
  5.79 characters with its space: 155 * 5.79 / 60 = 14.96.
- CJK (Han, kana, Hangul): 4.5 characters a second for Chinese, 5.0 for Japanese and Korean. One Han character is one
  syllable; read Mandarin runs at 5.18 syllables a second with pauses left out (Pellegrino, Coupé & Marsico, "A
  cross-language perspective on speech information rate", Language 87(3), 2011), and Chinese news reading is taught
  at 240-300 characters a minute (4-5 a second). NHK's news reading guide is 300 characters a minute (5.0 a second)
  for Japanese; Korean takes Japanese's rate (Pellegrino et al. have no Korean; its syllable blocks are read at about
  the same syllable rate).
- Other scripts (Cyrillic, Greek, Arabic, Hebrew, Devanagari, Thai...): the Latin rate. Alphabets and abugidas write
  about as many characters per syllable as Latin scripts do, and Pellegrino et al.'s syllable rates span only 5.2 to
  7.8 a second across their eight languages; the record says ``rate:other`` so that the caller knows it is coarse.
"""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass

from auk_worker.errors import InputError

SPEED_MIN, SPEED_MAX = 0.25, 4.0  # OpenAI's bounds for ``speed``

LATIN_RATE = 15.0  # characters a second (see the module docstring for the sources)
CJK_RATE = {"zh": 4.5, "ja": 5.0, "ko": 5.0}
CJK_DEFAULT_RATE = CJK_RATE["zh"]
OTHER_RATE = LATIN_RATE


# vLLM-Omni's and Qwen3-TTS's language names, besides ISO 639 codes ("en", "zh-CN", "ja").
LANGUAGE_NAMES = {"english": "en", "chinese": "zh", "mandarin": "zh", "japanese": "ja", "korean": "ko",
                  "german": "de", "french": "fr", "spanish": "es", "italian": "it", "portuguese": "pt",
                  "russian": "ru"}  # fmt: skip
# How far a given length may be from the speed's estimate before the two are said to disagree (either way).
SPEED_TOLERANCE = 1.5


def language_code(language: str | None) -> str | None:
    """The ISO 639 code of ``language`` (a code, a code with a region, or a name above); None for none or
    ``auto``. InputError naming the field for anything else."""
    if language is None or language.strip().lower() in ("", "auto"):
        return None
    value = language.strip().lower()
    if value in LANGUAGE_NAMES:
        return LANGUAGE_NAMES[value]
    primary = value.replace("_", "-").split("-")[0]
    if 2 <= len(primary) <= 3 and primary.isascii() and primary.isalpha():
        return primary
    raise InputError(f"language: {language!r} is neither an ISO 639 code (en, zh-CN...) nor one of "
                     f"{', '.join(name.capitalize() for name in LANGUAGE_NAMES)}, Auto")  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """A target length and how it was made: ``given``, ``ref_text``, ``rate:latin``, ``rate:cjk``, ``rate:other``
    or ``rate:mixed``."""

    seconds: float
    source: str

    def to_json(self) -> dict:
        return {"seconds": round(self.seconds, 3), "source": self.source}


def script_of(char: str) -> str | None:
    """``"cjk"``, ``"latin"`` or ``"other"`` for a character that is spoken; None for spaces and punctuation, which
    count at the rate of the text around them."""
    code = ord(char)
    if (0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0xF900 <= code <= 0xFAFF or 0x20000 <= code <= 0x2FFFF
            or 0x3040 <= code <= 0x30FF or 0x31F0 <= code <= 0x31FF  # kana
            or 0xAC00 <= code <= 0xD7AF or 0x1100 <= code <= 0x11FF or 0x3130 <= code <= 0x318F):  # Hangul
        return "cjk"
    if not char.isalnum():
        return None
    if char.isascii() or "LATIN" in unicodedata.name(char, ""):
        return "latin"
    if unicodedata.category(char) == "Nd":
        return "latin"  # digits of any script are read out like Latin digits
    return "other"


def is_cjk(char: str) -> bool:
    return script_of(char) == "cjk"


def script_counts(text: str) -> dict[str, float]:
    """Characters by script; each space or punctuation mark counts for the script of the spoken character before it
    (the first spoken character's, at the start)."""
    counts = {"latin": 0.0, "cjk": 0.0, "other": 0.0}
    pending = 0  # spaces and punctuation before the first spoken character
    current: str | None = None
    for char in text:
        script = script_of(char)
        if script is None:
            if current is None:
                pending += 1
            else:
                counts[current] += 1
            continue
        if current is None:
            counts[script] += pending
        current = script
        counts[script] += 1
    if current is None:
        counts["latin"] += pending
    return counts


def rate_seconds(text: str, language: str | None = None) -> tuple[float, str]:
    """Seconds to say ``text`` at the rates above (speed 1), and the source label."""
    counts = script_counts(text)
    cjk_rate = CJK_RATE.get(language_code(language) or "", CJK_DEFAULT_RATE)
    seconds = counts["latin"] / LATIN_RATE + counts["cjk"] / cjk_rate + counts["other"] / OTHER_RATE
    spoken = {name: n for name, n in counts.items() if n > 0}
    if not spoken:
        return seconds, "rate:latin"
    top = max(spoken, key=spoken.get)
    source = f"rate:{top}" if spoken[top] >= 0.9 * sum(spoken.values()) else "rate:mixed"
    return seconds, source


def check_speed(speed: float | None) -> float:
    if speed is None:
        return 1.0
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not math.isfinite(speed) or not (
        SPEED_MIN <= speed <= SPEED_MAX
    ):
        raise InputError(f"speed must be in [{SPEED_MIN:g}, {SPEED_MAX:g}], got {speed!r}")
    return float(speed)


def check_agreement(given_s: float, natural_s: float, speed: float, field: str = "gen_seconds") -> None:
    """A given length with a speed other than 1: refused only when the two disagree, i.e. when the speed the length
    implies (``natural_s / given_s``) is more than ``SPEED_TOLERANCE`` times away from ``speed``."""
    if speed == 1.0:
        return
    implied = natural_s / given_s
    if speed / SPEED_TOLERANCE <= implied <= speed * SPEED_TOLERANCE:
        return
    raise InputError(f"speed {speed:g} and {field} {given_s:g} disagree: the text takes about {natural_s:.2f} s at "
                     f"speed 1, so speed {speed:g} means about {natural_s / speed:.2f} s, and {given_s:g} s means "
                     f"speed {implied:.2f}; give one of the two, or values that agree")


def utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


class Estimator:
    """Seconds for a text, the same way for a whole text and each of its pieces: from the clip's transcript when
    there is one, else the speaking rates; divided by ``speed``, times ``scale`` (a given length's correction)."""

    def __init__(self, *, speed: float | None = None, language: str | None = None, clip_seconds: float | None = None,
                 ref_text: str | None = None, scale: float = 1.0) -> None:  # fmt: skip
        self.speed = check_speed(speed)
        self.language = language
        self.scale = scale
        self.per_byte: float | None = None
        if ref_text is not None:
            if clip_seconds is None:
                raise InputError("ref_text: a transcript needs its clip (audio or voice)")
            if not ref_text.strip():
                raise InputError("ref_text: the transcript is blank")
            self.per_byte = clip_seconds / utf8_bytes(ref_text.strip())

    def source(self, text: str) -> str:
        return "ref_text" if self.per_byte is not None else rate_seconds(text, self.language)[1]

    def __call__(self, text: str) -> float:
        if self.per_byte is not None:
            seconds = self.per_byte * utf8_bytes(text)
        else:
            seconds = rate_seconds(text, self.language)[0]
        return seconds / self.speed * self.scale

    def scaled(self, factor: float) -> Estimator:
        twin = object.__new__(Estimator)
        vars(twin).update(vars(self), scale=self.scale * factor)
        return twin


def estimate(text: str, *, gen_seconds: float | None = None, speed: float | None = None, language: str | None = None,
             clip_seconds: float | None = None, ref_text: str | None = None) -> Estimate:  # fmt: skip
    """The target length of ``text`` spoken in one piece: a given ``gen_seconds`` wins; then the transcript's rule;
    then the speaking rates."""
    if gen_seconds is not None:
        return Estimate(float(gen_seconds), "given")
    estimator = Estimator(speed=speed, language=language, clip_seconds=clip_seconds, ref_text=ref_text)
    return Estimate(estimator(text), estimator.source(text))
