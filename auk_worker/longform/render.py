"""A long job's plan rendered on one worker: segments in GPU groups (``render_batch``), joined as they finish.

``render_plan`` takes the pipeline, the stored plan, the decoded clip and ``Hooks`` (the service's storage, record
and stream), and returns the joined waveform. Per group of at most ``group_size`` segments:

- segments already stored (an earlier attempt's, or a worker's that was killed) are loaded, not rendered again;
- the rest render in one ``render_batch`` call; a segment that fails there is tried again alone, once; a second
  failure ends the job (the finished segments stay stored for the next attempt);
- each finished segment is stored (``hooks.save``), the progress counts it (``hooks.progress``, which raises
  ``Canceled`` once the job is canceled: a cancel stops at the next group, or within one at its next step through
  ``hooks.on_step``), and the part of the file that no later segment can change goes to ``hooks.on_segment``.

Seeds: segment ``i`` renders with the job's seed plus ``i``, so a seeded long job renders identically run to run.
A described voice's plan (``voice: anchor``) renders its first segment alone; its audio is every later segment's clip.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from auk_worker.errors import AuKError
from auk_worker.longform.join import Joiner
from auk_worker.longform.plan import CROSSFADE, segment_seconds
from auk_worker.rules import MAX_SEED
from auk_worker.types import HOP, SAMPLE_RATE, AudioClip, RenderRequest, RenderResult

log = logging.getLogger(__name__)


class Pipeline(Protocol):
    deploy: Any

    def render_batch(self, requests: list[RenderRequest], on_step: Any = None) -> list[RenderResult | AuKError]: ...


# on_segment(index, samples, is_last): the next part of the output file, final (the parts concatenated are the file).
SegmentHook = Callable[[int, np.ndarray, bool], None]


@dataclass
class Hooks:
    load: Callable[[int], np.ndarray | None] = lambda index: None  # a stored segment's audio
    save: Callable[[int, np.ndarray], None] = lambda index, samples: None
    progress: Callable[[int, int], None] = lambda done, total: None  # raises Canceled to stop
    on_step: Callable[[int, int], None] | None = None  # inside a group's render (raises Canceled to stop)
    on_segment: SegmentHook | None = None


@dataclass
class LongResult:
    waveform: np.ndarray
    spans: list[tuple[float, float]]  # each segment's (start, end) in the file, seconds
    passes: int  # render_batch calls made by this attempt
    rendered: int  # segments rendered by this attempt (the rest were loaded)
    seed: int
    num_inference_steps: int
    guidance_scale: float
    first_audio_s: float | None = None  # perf_counter seconds from the start to the first on_segment
    extra: dict[str, Any] = field(default_factory=dict)


class SegmentStore:
    """Finished segments as raw float32 objects under the job's prefix (``<prefix>/jobs/<id>/segments/``), so that a
    later attempt picks them up; removed once the job's file is stored."""

    def __init__(self, storage: Any, key_prefix: str) -> None:
        self.storage = storage
        self.prefix = key_prefix.rstrip("/") + "/"
        self._present: set[str] | None = None

    def key(self, index: int) -> str:
        return f"{self.prefix}{index:05d}.f32"

    def load(self, index: int) -> np.ndarray | None:
        if self._present is None:
            self._present = set(self.storage.list_keys(self.prefix))
        key = self.key(index)
        if key not in self._present:
            return None
        data = self.storage.get_bytes(self.storage.bucket, key)
        return np.frombuffer(data, dtype="<f4").astype(np.float32)

    def save(self, index: int, samples: np.ndarray) -> None:
        data = np.asarray(samples, dtype="<f4").tobytes()
        self.storage.put_bytes(self.key(index), data, "application/octet-stream", {"segment": str(index)})

    def clear(self) -> None:
        for key in self.storage.list_keys(self.prefix):
            self.storage.delete(key)


def _requests(plan: dict[str, Any], clip: AudioClip | None, knobs: dict[str, Any], seed: int) -> list[RenderRequest]:
    """Every segment's engine request (an anchored plan's later ones get their clip once the anchor is rendered)."""
    out = []
    if plan["kind"] == "text":
        for index, segment in enumerate(plan["segments"]):
            out.append(RenderRequest(instruction=segment["instruction"], audio=clip,
                                     gen_seconds=segment_seconds(segment["frames"]),
                                     seed=(seed + index) % MAX_SEED, **knobs))  # fmt: skip
        return out
    samples = clip.samples  # windows: the source at 24 kHz
    for index, window in enumerate(plan["windows"]):
        part = samples[window["start"] * HOP : (window["start"] + window["length"]) * HOP]
        out.append(RenderRequest(instruction=plan["instruction"], audio=AudioClip(part, SAMPLE_RATE),
                                 seed=(seed + index) % MAX_SEED, **knobs))  # fmt: skip
    return out


def _anchor_clip(samples: np.ndarray) -> AudioClip:
    key = "anchor-" + hashlib.sha256(np.asarray(samples, dtype="<f4").tobytes()).hexdigest()
    return AudioClip(np.asarray(samples, dtype=np.float32), SAMPLE_RATE, key=key)


def render_plan(pipeline: Pipeline, plan: dict[str, Any], clip: AudioClip | None, knobs: dict[str, Any],
                hooks: Hooks, group_size: int = 1, clock: Callable[[], float] | None = None) -> LongResult:  # fmt: skip
    """Render a ``text`` or ``windows`` plan; ``clip`` is the voice (text) or the source at 24 kHz (windows);
    ``knobs``: ``num_inference_steps``, ``guidance_scale``, ``sway`` and ``seed`` (None: the deploy config's)."""
    clock = clock or time.perf_counter
    started = clock()
    seed = knobs.get("seed")
    seed = pipeline.deploy.defaults.seed if seed is None else seed
    rest = {name: knobs.get(name) for name in ("num_inference_steps", "guidance_scale", "sway")}
    requests = _requests(plan, clip, rest, seed)
    count = len(requests)
    windows = plan["kind"] == "windows"
    if windows:
        joiner = Joiner(SAMPLE_RATE, crossfade=plan["overlap"] * HOP, curve="amplitude", loudness=False)
        pauses = [0] * count
        trims = [w["trim"] * HOP for w in plan["windows"]]
    else:
        joiner = Joiner(SAMPLE_RATE, crossfade=CROSSFADE)
        pauses = [round(s["pause"] * SAMPLE_RATE) for s in plan["segments"]]
        trims = [0] * count
    audio: dict[int, np.ndarray] = {}  # finished, not yet joined (a segment goes once the ones before it are joined)
    chunks: list[np.ndarray] = []
    state = {"joined": 0, "done": 0, "passes": 0, "rendered": 0, "first": None, "anchor": None}
    meta: dict[str, Any] = {}

    def finished(index: int, samples: np.ndarray) -> None:
        audio[index] = samples
        state["done"] += 1
        if index == 0:
            state["anchor"] = samples
        while state["joined"] in audio:  # join (and stream) in order
            i = state["joined"]
            chunk = joiner.add(audio.pop(i)[trims[i]:], pauses[i], last=i == count - 1)
            chunks.append(chunk)
            if hooks.on_segment is not None:
                hooks.on_segment(i, chunk, i == count - 1)
            if state["first"] is None:
                state["first"] = clock() - started
            state["joined"] += 1

    def render(indices: list[int]) -> None:
        batch = [requests[i] for i in indices]
        state["passes"] += 1
        results = pipeline.render_batch(batch, on_step=hooks.on_step)
        for index, result in zip(indices, results):
            if isinstance(result, Exception):
                log.warning("segment %d of %d failed (%s); trying it again alone", index, count, result)
                state["passes"] += 1
                (result,) = pipeline.render_batch([requests[index]], on_step=hooks.on_step)
                if isinstance(result, Exception):
                    raise result
            meta.setdefault("knobs", (result.seed, result.num_inference_steps, result.guidance_scale))
            samples = np.asarray(result.waveform, dtype=np.float32)
            hooks.save(index, samples)
            state["rendered"] += 1
            finished(index, samples)
        hooks.progress(state["done"], count)

    loaded = {}
    for index in range(count):
        stored = hooks.load(index)
        if stored is not None:
            loaded[index] = stored
    pending = [i for i in range(count) if i not in loaded]
    if plan["kind"] == "text" and plan.get("voice") == "anchor":
        if 0 in loaded:
            finished(0, loaded.pop(0))
        else:
            render([0])
            pending.remove(0)
        anchor = _anchor_clip(state["anchor"])
        requests[1:] = [dataclasses.replace(r, audio=anchor) for r in requests[1:]]
    for index, samples in sorted(loaded.items()):
        finished(index, samples)
    if loaded:
        hooks.progress(state["done"], count)
    for start in range(0, len(pending), max(group_size, 1)):
        render(pending[start : start + max(group_size, 1)])
    waveform = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    spans = [(a / SAMPLE_RATE, b / SAMPLE_RATE) for a, b in joiner.spans]
    _, steps, guidance = meta.get("knobs", (seed, 0, 0.0))
    return LongResult(waveform, spans, state["passes"], state["rendered"], seed, steps, guidance,
                      state["first"])  # fmt: skip

