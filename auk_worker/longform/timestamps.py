"""A long job's segments as a timestamps file beside its audio: JSON, SRT or WebVTT (subtitles for free)."""

from __future__ import annotations

import json

FORMATS = {"json": ("json", "application/json"), "srt": ("srt", "application/x-subrip"),
           "vtt": ("vtt", "text/vtt")}  # fmt: skip


def _clock(seconds: float, separator: str) -> str:
    ms = int(round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"


def render(segments: list[dict], fmt: str) -> bytes:
    """``segments`` (``{"index", "text", "start", "end"}``, seconds) as ``fmt``."""
    if fmt == "json":
        return json.dumps({"segments": segments}, ensure_ascii=False, indent=1).encode()
    lines: list[str] = ["WEBVTT", ""] if fmt == "vtt" else []
    separator = "." if fmt == "vtt" else ","
    for number, segment in enumerate(segments, 1):
        lines.append(str(number))
        lines.append(f"{_clock(segment['start'], separator)} --> {_clock(segment['end'], separator)}")
        lines.append(segment.get("text") or "")
        lines.append("")
    return "\n".join(lines).encode()
