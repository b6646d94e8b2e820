"""Overlapping windows over a recording longer than one pass, for tasks that keep the source's length.

Such a task renders a target as long as its clip, and clip plus target fit 30 s, so one window holds at most 15 s
(750 latent frames). Windows start every ``window - overlap`` frames; the last is pinned to the recording's end
(so it overlaps its neighbour by more), and the join drops that extra from its start, so every boundary
cross-fades over exactly ``overlap`` frames and the joined file is exactly the recording's whole frames long.
"""

from __future__ import annotations

from dataclasses import dataclass

from auk_worker.rules import MAX_TOTAL_FRAMES

WINDOW_FRAMES = MAX_TOTAL_FRAMES // 2  # 750 frames, 15 s: the window is both the clip and the target
OVERLAP_FRAMES = 25  # 0.5 s cross-faded at each boundary


@dataclass(frozen=True)
class Window:
    """Frames ``[start, start + length)`` of the source; the join drops its first ``trim`` frames."""

    start: int
    length: int
    trim: int = 0

    def to_json(self) -> dict:
        return {"start": self.start, "length": self.length, "trim": self.trim}


def plan_windows(total: int, window: int = WINDOW_FRAMES, overlap: int = OVERLAP_FRAMES) -> list[Window]:
    """Windows covering ``total`` frames, each overlapping the previous by at least ``overlap``."""
    if total <= window:
        return [Window(0, total)]
    if not 0 <= overlap < window // 2:
        raise ValueError(f"overlap must be in [0, {window // 2}), got {overlap}")
    stride = window - overlap
    starts = list(range(0, total - window, stride))
    starts.append(total - window)
    windows = [Window(starts[0], window)]
    for previous, start in zip(starts, starts[1:]):
        windows.append(Window(start, window, trim=previous + window - start - overlap))
    return windows
