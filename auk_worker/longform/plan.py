"""A request's parts into the plan its record stores (the API's side; the worker renders it, ``render.py``).

Kinds of plan (``record.request["plan"]``):

- ``single``: one pass, with the instruction the service wrote and the length it estimated (``gen_seconds``).
- ``text``: a text longer than one pass, as segments (``text.py``) that each fit beside their clip, in one voice:
  a clip is every segment's clip; a described voice is rendered as an ``anchor``: the first segment (at most
  ``ANCHOR_MAX_S``) renders alone with the description, the others clone its audio with the zero-shot template.
  Rendering every segment from the description instead draws a new voice each time (instruct TTS samples a
  timbre per render, seed or not); cloning the anchor keeps one timbre for the price of one pass run ahead of the
  others, which is also the first audio a stream can send.
- ``windows``: a recording longer than 15 s for a task that keeps its length (``windows.py``).
- None: a raw instruction with its length given (or a clip of at most 15 s): the request as it is.

The plan's ``duration`` says how long the output will be and how that was decided (``duration.py``); for a text
plan the sum of the segments' frames plus the pauses less the cross-fades, so the file is that long to the sample.
"""

from __future__ import annotations

from typing import Any

from auk_worker import rules
from auk_worker.errors import InputError
from auk_worker.longform import instructions, text as texts
from auk_worker.longform.duration import Estimator, check_speed, estimate, language_code, rate_seconds
from auk_worker.longform.join import CROSSFADE_S
from auk_worker.longform.windows import OVERLAP_FRAMES, WINDOW_FRAMES, plan_windows
from auk_worker.types import FRAME_RATE, SAMPLE_RATE

SEGMENT_MAX_S = 20.0  # a segment's target at most; with a clip, also at most what the clip leaves of 30 s
ANCHOR_MAX_S = 10.0  # a described voice's first segment, which the others clone
MIN_ROOM_S = 3.0  # a clip that leaves less than this of its pass for each segment is refused for a long text
REF_RATE_RANGE = (0.25, 4.0)  # a transcript read faster or slower than this against the usual rates does not fit
CROSSFADE = round(CROSSFADE_S * SAMPLE_RATE)  # samples


def _frames(seconds: float) -> int:
    return rules.frames_for_seconds(seconds)


def _check_ref_text(ref_text: str, clip_seconds: float) -> None:
    """A transcript that could not be what the clip says (read over four times faster or slower than the usual
    rates) is refused: its rate would give nonsense lengths."""
    usual, _ = rate_seconds(ref_text)
    ratio = clip_seconds / max(usual, 1e-9)
    low, high = REF_RATE_RANGE
    if not low <= ratio <= high:
        raise InputError(f"ref_text: the transcript ({len(ref_text)} characters, about {usual:.1f} s at usual "
                         f"speaking rates) does not fit its clip ({clip_seconds:.2f} s); give the clip's own "
                         "transcript")  # fmt: skip


def _segments(text: str, est: Estimator, room_s: float, anchored: bool) -> list[texts.Piece]:
    pieces = texts.split_text(text, est, room_s)
    if anchored and len(pieces) > 1 and est(pieces[0].text) > ANCHOR_MAX_S:
        head = texts.split_text(pieces[0].text, est, ANCHOR_MAX_S)
        last = head[-1]
        head[-1] = texts.Piece(last.text, pieces[0].pause_after)
        pieces = head + pieces[1:]
    return pieces


def plan_text(text: str, *, description: str | None, style: str | None, language: str | None,
              speed: float | None, gen_seconds: float | None, clip_frames: int | None,
              ref_text: str | None) -> dict[str, Any]:  # fmt: skip
    """The plan that speaks ``text`` (already cleaned) in the clip's voice (``clip_frames``) or a described one."""
    has_clip = clip_frames is not None
    clip_s = (clip_frames or 0) / FRAME_RATE
    ref_text = None if ref_text is None else texts.clean_text(ref_text, "ref_text")
    description = None if description is None else texts.clean_text(description, "description")
    style = None if style is None else texts.clean_text(style, "style")
    if ref_text is not None and has_clip:
        _check_ref_text(ref_text.strip(), clip_s)
    est = Estimator(speed=speed, language=language, clip_seconds=clip_s if has_clip else None, ref_text=ref_text)
    source = "given" if gen_seconds is not None else est.source(text)
    one_pass_frames = rules.MAX_TOTAL_FRAMES - (clip_frames or 0)
    whole = gen_seconds if gen_seconds is not None else est(text)
    if _frames(whole) <= one_pass_frames:
        instruction = instructions.write_instruction(instructions.SPEAK, text, description=description,
                                                     has_clip=has_clip, style=style, language=language)  # fmt: skip
        seconds = _frames(whole) / FRAME_RATE
        return {"kind": "single", "instruction": instruction, "gen_seconds": whole,
                "duration": {"seconds": seconds, "source": source, "segments": 1}}  # fmt: skip
    # Long: segments sized to fit beside the clip (or beside the anchor, which is at most ANCHOR_MAX_S).
    room_s = min(SEGMENT_MAX_S, (one_pass_frames - 1) / FRAME_RATE)
    if room_s < MIN_ROOM_S:
        raise InputError(f"audio: the clip ({clip_s:.2f} s) leaves {max(room_s, 0):.2f} s of its "
                         f"{rules.MAX_TOTAL_SECONDS:g} s pass for each segment of a long text; give a clip of at "
                         f"most {rules.MAX_TOTAL_SECONDS - MIN_ROOM_S:g} s")  # fmt: skip
    anchored = not has_clip
    instructions.write_instruction(instructions.SPEAK, "x", description=description, has_clip=has_clip,
                                   style=style, language=language)  # the parts' own errors, before splitting
    scale = 1.0
    for _ in range(6):  # a given length scales the estimates; rescaled pieces may need cutting again
        scaled = est.scaled(scale)
        pieces = _segments(text, scaled, room_s, anchored)
        seconds = [scaled(p.text) for p in pieces]
        if gen_seconds is None:
            break
        boundaries = sum(p.pause_after - CROSSFADE_S for p in pieces[:-1])
        speech = gen_seconds - boundaries
        if speech <= 0.05 * len(pieces):
            raise InputError(f"gen_seconds: {gen_seconds:g} s leaves no time to speak {len(pieces)} segments "
                             f"with their pauses ({boundaries:.1f} s)")  # fmt: skip
        factor = speech / sum(seconds)
        if abs(factor - 1.0) < 1e-9:
            break
        scale *= factor
    seconds = [scaled(p.text) for p in pieces]
    if any(_frames(s) > _frames(room_s) for s in seconds):
        raise InputError(f"gen_seconds: {gen_seconds:g} s is too long for the text: a segment would exceed one pass; "
                         "give a shorter length or a longer text")  # fmt: skip
    segments = []
    for index, (piece, secs) in enumerate(zip(pieces, seconds)):
        anchor_first = anchored and index == 0
        instruction = instructions.write_instruction(
            instructions.SPEAK, piece.text, description=description if anchor_first or has_clip else None,
            has_clip=has_clip or not anchor_first, style=style if anchor_first else None, language=language,
        )
        segments.append({"text": piece.text, "instruction": instruction, "frames": _frames(secs),
                         "pause": piece.pause_after})  # fmt: skip
    if anchored and segments[0]["frames"] + max(s["frames"] for s in segments[1:]) > rules.MAX_TOTAL_FRAMES:
        raise InputError("text: the first segment and the longest other one do not fit one pass together")
    total = sum(s["frames"] for s in segments) * (SAMPLE_RATE // FRAME_RATE)
    total += sum(round(s["pause"] * SAMPLE_RATE) - CROSSFADE for s in segments[:-1])
    return {"kind": "text", "voice": "anchor" if anchored else "clip", "segments": segments,
            "duration": {"seconds": round(total / SAMPLE_RATE, 6), "source": source, "segments": len(segments)},
            "samples": total}  # fmt: skip


def plan_windows_for(instruction: str, clip_frames: int) -> dict[str, Any]:
    windows = plan_windows(clip_frames)
    return {"kind": "windows", "instruction": instruction, "overlap": OVERLAP_FRAMES,
            "windows": [w.to_json() for w in windows],
            "duration": {"seconds": clip_frames / FRAME_RATE, "source": "clip", "segments": len(windows)}}  # fmt: skip


def plan_request(request: Any, clip: dict[str, Any] | None) -> dict[str, Any] | None:
    """The plan of a validated ``JobRequest`` whose clip (``{"samples", "sample_rate", ...}`` or None) is resolved;
    None for a request that renders as given. InputError names the field at fault."""
    clip_frames = None if clip is None else rules.clip_frames(clip["samples"], clip["sample_rate"])
    check_speed(request.speed)
    language_code(request.language)  # a language that is not one is refused by name
    task = request.task or (instructions.SPEAK if request.text is not None else None)
    if task == instructions.SPEAK:
        text = texts.clean_text(request.text, "text", texts.MAX_JOB_TEXT_CHARS)
        return plan_text(text, description=request.description, style=request.style, language=request.language,
                         speed=request.speed, gen_seconds=request.gen_seconds, clip_frames=clip_frames,
                         ref_text=request.ref_text)  # fmt: skip
    if task is not None:  # a recording task: its sentence, at the source's length
        if clip_frames is None:
            raise InputError(f"audio: task {task!r} works on a recording; give audio")
        if request.gen_seconds is not None:
            raise InputError(f"gen_seconds: task {task!r} keeps the recording's length; leave gen_seconds out")
        instruction = instructions.write_instruction(task, request.text, has_clip=True, description=request.description,
                                                     style=request.style)  # fmt: skip
        if clip_frames > WINDOW_FRAMES:
            return plan_windows_for(instruction, clip_frames)
        return {"kind": "single", "instruction": instruction, "gen_seconds": None,
                "duration": {"seconds": clip_frames / FRAME_RATE, "source": "clip", "segments": 1}}  # fmt: skip
    # A raw instruction.
    if request.gen_seconds is not None:
        return None
    spoken = instructions.spoken_text(request.instruction)
    if clip_frames is not None:  # the source's length; a spoken template over a long clip stays one pass (refused)
        long_source = clip_frames > WINDOW_FRAMES and not instructions.speaks(request.instruction)
        return plan_windows_for(request.instruction, clip_frames) if long_source else None
    guess = estimate(spoken, speed=request.speed, language=request.language)
    if _frames(guess.seconds) > rules.MAX_TOTAL_FRAMES:
        raise InputError(f"gen_seconds: the instruction's words take about {guess.seconds:.1f} s, over one "
                         f"{rules.MAX_TOTAL_SECONDS:g} s pass; send them as text (the service splits it) or give "
                         "gen_seconds")  # fmt: skip
    return {"kind": "single", "instruction": request.instruction, "gen_seconds": guess.seconds,
            "duration": {"seconds": _frames(guess.seconds) / FRAME_RATE, "source": guess.source,
                         "segments": 1}}  # fmt: skip


def target_seconds(plan: dict[str, Any] | None) -> float | None:
    return None if plan is None else float(plan["duration"]["seconds"])


def segment_seconds(frames: int) -> float:
    """A ``gen_seconds`` that renders exactly ``frames`` (``ceil(50 * s)``; ``frames / 50`` can round up a frame)."""
    return (frames - 0.5) / FRAME_RATE


def is_long(plan: dict[str, Any] | None) -> bool:
    return plan is not None and plan.get("kind") in ("text", "windows")

