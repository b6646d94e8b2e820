"""Texts into segments that each fit one pass beside their clip: cut at paragraph ends, then sentence ends, then
clauses, then words, never inside a word.

``split_text`` packs greedily at the coarsest boundary that fits: whole paragraphs while they fit, else the
paragraph's sentences, else a sentence's clauses, else a clause's words. Scripts without spaces (Chinese,
Japanese) count each CJK character as a word, so a Chinese sentence without punctuation still splits between
characters; a run of Latin letters inside it stays whole. A single word that does not fit is the caller's error.

Each segment carries the pause that follows it, chosen from the punctuation it ends with (``join.py`` adds it).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from auk_worker.errors import InputError

MAX_JOB_TEXT_CHARS = 100_000  # POST /v1/jobs and batch lines
MAX_SPEECH_TEXT_CHARS = 4_096  # POST /v1/audio/speech (OpenAI's limit)

# Seconds of silence after a segment, by how it ends (the cross-fade, join.py, takes its length back from each).
PAUSE_PARAGRAPH = 0.6
PAUSE_SENTENCE = 0.35
PAUSE_CLAUSE = 0.15
PAUSE_NONE = 0.0

_CJK = "\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_CLOSERS = "\"'\u201d\u2019)\\]\u300d\u300f\uff09"
_PARAGRAPH = re.compile(r"\n+")
_SENTENCE = re.compile(rf"[.!?\u2026]+[{_CLOSERS}]*\s+|[\u3002\uff01\uff1f]+[{_CLOSERS}]*\s*")
_CLAUSE = re.compile(rf"[,;:\u2014\u2013]+[{_CLOSERS}]*\s+|[\uff0c\u3001\uff1b\uff1a]+\s*")
_WORD = re.compile(rf"[{_CJK}]\s*|[^\s{_CJK}]+\s*|\s+")
_SENTENCE_MARKS = ".!?\u2026\u3002\uff01\uff1f"
_CLAUSE_MARKS = ",;:\u2014\u2013\uff0c\u3001\uff1b\uff1a"


@dataclass(frozen=True)
class Piece:
    """One segment's text and the pause after it (seconds)."""

    text: str
    pause_after: float


def clean_text(text: object, field: str = "text", limit: int = MAX_JOB_TEXT_CHARS) -> str:
    """``text`` in NFC with control characters dropped, spaces collapsed and lines trimmed (a line break is a
    paragraph end); InputError naming ``field`` when it is not a string, too long, or empty once cleaned."""
    if not isinstance(text, str):
        raise InputError(f"{field} must be a string")
    if len(text) > limit:
        raise InputError(f"{field} is {len(text)} characters long; at most {limit} are accepted")
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = "".join(ch for ch in text if ch == "\n" or unicodedata.category(ch)[0] != "C")
    lines = (re.sub(r"\s+", " ", line).strip() for line in text.split("\n"))
    text = "\n".join(line for line in lines if line)
    if not text:
        raise InputError(f"{field} is empty once cleaned (spaces and control characters only)")
    return text


def _cut(text: str, pattern: re.Pattern[str]) -> list[str]:
    """``text`` cut after each match of ``pattern``; the pieces join back to ``text``."""
    pieces, start = [], 0
    for match in pattern.finditer(text):
        if match.end() < len(text) and match.end() > start:
            pieces.append(text[start : match.end()])
            start = match.end()
    pieces.append(text[start:])
    return [piece for piece in pieces if piece]


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


_LEVELS: list[Callable[[str], list[str]]] = [
    lambda t: _cut(t, _PARAGRAPH),
    lambda t: _cut(t, _SENTENCE),
    lambda t: _cut(t, _CLAUSE),
    _words,
]


def pause_after(raw: str) -> float:
    """The pause after a segment, from how its raw text ends."""
    if raw.rstrip(" ").endswith("\n"):
        return PAUSE_PARAGRAPH
    stripped = raw.strip().rstrip(_CLOSERS)
    if stripped and stripped[-1] in _SENTENCE_MARKS:
        return PAUSE_SENTENCE
    if stripped and stripped[-1] in _CLAUSE_MARKS:
        return PAUSE_CLAUSE
    return PAUSE_NONE


def split_text(text: str, seconds: Callable[[str], float], max_seconds: float, field: str = "text") -> list[Piece]:
    """``text`` (cleaned) cut into pieces whose ``seconds(piece)`` is at most ``max_seconds``, at the coarsest
    boundaries that allow it. InputError naming ``field`` for a word that does not fit on its own."""

    def fits(candidate: str) -> bool:
        return seconds(candidate.strip()) <= max_seconds

    def split(part: str, level: int) -> list[str]:
        if fits(part):
            return [part]
        if level == len(_LEVELS):
            word = part.strip()
            shown = word if len(word) <= 40 else word[:40] + "..."
            raise InputError(f"{field}: the word {shown!r} ({len(word)} characters, about {seconds(word):.1f} s) is "
                             f"longer than one segment can speak ({max_seconds:.1f} s); a segment never cuts a "
                             "word: add spaces or shorten it")  # fmt: skip
        out: list[str] = []
        current = ""
        for unit in _LEVELS[level](part):
            if fits(current + unit):
                current += unit
                continue
            if current:
                out.append(current)
                current = ""
            if fits(unit):
                current = unit
            else:
                pieces = split(unit, level + 1)
                out.extend(pieces[:-1])
                current = pieces[-1]
        if current:
            out.append(current)
        return out

    raws = split(text, 0)
    return [Piece(raw.strip(), pause_after(raw)) for raw in raws if raw.strip()]
