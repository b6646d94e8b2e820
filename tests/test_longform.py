"""Long texts and recordings, without the service: estimates, AuK's wording, splitting, joining, windows, and a plan
rendered over a hand-written fake pipeline (one that fails a chosen segment, counts its calls and echoes its clip)."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from auk_worker import rules
from auk_worker.errors import Canceled, InputError, ModelError
from auk_worker.longform import duration, instructions, join, plan, text, timestamps, windows
from auk_worker.longform.render import Hooks, render_plan
from auk_worker.types import HOP, SAMPLE_RATE, AudioClip, RenderResult

LATIN = "".join(f"Night {i}: the old lighthouse keeper climbed the stairs each evening, counting every step. "
                "Storms came and went; the light never failed! Did anyone thank him? Not once.\n"
                for i in range(40))  # fmt: skip
CHINESE = "今天天气很好，我们一起去公园散步。孩子们在草地上奔跑，老人们坐在长椅上聊天！" * 40


# ---------------------------------------------------------------------------------------------------- estimates


def test_estimate_rules_and_their_sources() -> None:
    assert duration.estimate("Hello", gen_seconds=4.0) == duration.Estimate(4.0, "given")
    # The upstream CLI's rule: clip seconds x bytes(text) / bytes(ref_text) / speed.
    got = duration.estimate("abcdefgh", clip_seconds=3.0, ref_text="abcd", speed=2.0)
    assert got.source == "ref_text" and math.isclose(got.seconds, 3.0 * 8 / 4 / 2)
    latin = duration.estimate("x" * 150)
    assert latin.source == "rate:latin" and math.isclose(latin.seconds, 10.0)
    assert math.isclose(duration.estimate("x" * 150, speed=0.5).seconds, 20.0)
    cjk = duration.estimate("你" * 45)
    assert cjk.source == "rate:cjk" and math.isclose(cjk.seconds, 10.0)
    assert math.isclose(duration.estimate("の" * 50, language="ja").seconds, 10.0)
    assert math.isclose(duration.estimate("の" * 50, language="Japanese").seconds, 10.0)
    assert duration.language_code("zh-CN") == "zh" and duration.language_code("Auto") is None
    with pytest.raises(InputError, match="^language: 'Klingon!' is neither"):
        duration.language_code("Klingon!")
    assert duration.estimate("Привет, как дела?").source == "rate:other"
    assert duration.estimate("Hello 你好 world 世界").source == "rate:mixed"
    for bad in (0.1, 5.0, float("nan"), True):
        with pytest.raises(InputError, match=r"speed must be in \[0.25, 4\]"):
            duration.estimate("x", speed=bad)
    with pytest.raises(InputError, match="ref_text: a transcript needs its clip"):
        duration.estimate("x", ref_text="y")


# ---------------------------------------------------------------------------------------------------- wording


def test_instructions_follow_the_trained_templates() -> None:
    zero_shot = instructions.write_instruction("speak", "Hi.", has_clip=True)
    assert zero_shot == 'Say the following with the same voice: "Hi."'
    assert instructions.write_instruction("speak", "Hi.", description="A calm man.") == (
        'Generate speech based on the following description: "A calm man.". The content to speak is: "Hi.".'
    )
    assert instructions.write_instruction("speak", "Hi.", style="Whispered.") == (
        'Generate speech based on the following description: "Whispered.". The content to speak is: "Hi.".'
    )
    chinese = instructions.write_instruction("speak", "你好。")
    assert chinese == '请基于下面的描述: "A clear, natural voice.",生成语音内容"你好。".'
    assert instructions.write_instruction("denoise", has_clip=True).startswith("Remove only the background noise")
    with pytest.raises(InputError, match="^audio: task 'enhance' works on a recording"):
        instructions.write_instruction("enhance")
    with pytest.raises(InputError, match="^style: "):
        instructions.write_instruction("speak", "Hi.", has_clip=True, style="loud")
    with pytest.raises(InputError, match="^task: unknown task"):
        instructions.write_instruction("sing", has_clip=True)
    written = instructions.write_instruction("speak", "Good night.", description="A soft voice.")
    assert instructions.spoken_text(written) == "Good night." and instructions.speaks(written)
    assert not instructions.speaks(instructions.RECORDING_TASKS["enhance"])


# ---------------------------------------------------------------------------------------------------- splitting


def _split(body: str, max_s: float, **kw) -> list[text.Piece]:
    est = duration.Estimator(**kw)
    pieces = text.split_text(text.clean_text(body), est, max_s)
    assert all(est(p.text) <= max_s for p in pieces)
    return pieces


def test_split_prefers_sentences_then_clauses_then_words_and_keeps_every_word() -> None:
    pieces = _split(LATIN, 20.0)
    assert len(pieces) > 10
    assert " ".join(p.text for p in pieces).split() == text.clean_text(LATIN).split()  # nothing lost, no word cut
    assert all(p.text[-1] in ".!?;," for p in pieces)  # every cut at punctuation here
    assert {p.pause_after for p in pieces[:-1]} <= {text.PAUSE_PARAGRAPH, text.PAUSE_SENTENCE, text.PAUSE_CLAUSE}
    no_punctuation = " ".join(["lighthouse"] * 400)
    pieces = _split(no_punctuation, 5.0)
    assert all(set(p.text.split()) == {"lighthouse"} for p in pieces)
    assert sum(len(p.text.split()) for p in pieces) == 400 and {p.pause_after for p in pieces} == {0.0}


def test_split_cjk_and_mixed_scripts_between_characters_never_inside_a_latin_word() -> None:
    pieces = _split(CHINESE, 8.0)
    assert "".join(p.text for p in pieces) == CHINESE
    unpunctuated = "我们今天去公园玩了很久然后回家吃饭" * 20
    pieces = _split(unpunctuated, 3.0)
    assert "".join(p.text for p in pieces) == unpunctuated and len(pieces) > 5
    mixed = ("我们用 TensorFlow 和 PyTorch 训练模型然后部署到服务器上" * 12)
    pieces = _split(mixed, 2.0)
    assert "".join(p.text for p in pieces).replace(" ", "") == mixed.replace(" ", "")
    latin = [word for p in pieces for word in re.findall(r"[A-Za-z]+", p.text)]
    assert set(latin) == {"TensorFlow", "PyTorch"} and len(latin) == 24  # Latin words stay whole
    japanese = "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。" * 10
    assert "".join(p.text for p in _split(japanese, 3.0, language="ja")) == japanese


def test_a_word_longer_than_a_segment_and_empty_text_are_refused_by_field() -> None:
    with pytest.raises(InputError, match=r"^text: the word 'aaaa.*longer than one segment"):
        _split("short words then " + "a" * 400, 20.0)
    for empty in ("", "   \n\t ", "\x00\x01"):
        with pytest.raises(InputError, match="^text is empty once cleaned"):
            text.clean_text(empty)
    with pytest.raises(InputError, match="^text is 100001 characters long; at most 100000"):
        text.clean_text("a" * 100_001)


# ---------------------------------------------------------------------------------------------------- joining


def test_join_lengths_cross_fades_and_incremental_output_equal_the_whole() -> None:
    rng = np.random.default_rng(1)
    segments = [rng.standard_normal(n).astype(np.float32) * 0.02 for n in (9600, 24000, 4800, 12000)]
    pauses = [0, 8400, 3600, 0]
    whole = join.join(segments, pauses, SAMPLE_RATE)
    assert len(whole) == join.joined_samples([len(s) for s in segments], pauses, 960)
    joiner = join.Joiner(SAMPLE_RATE)
    parts = [joiner.add(s, pauses[i], last=i == 3) for i, s in enumerate(segments)]
    assert np.array_equal(np.concatenate(parts), whole) and all(len(p) > 0 for p in parts)
    gains = joiner.gains  # one loudness: every segment at the target over its active blocks
    for seg, gain in zip(segments, gains):
        assert math.isclose(np.sqrt(np.mean((seg * gain) ** 2)), join.TARGET_RMS, rel_tol=0.05)
    # Equal-power curves keep unrelated signals' power, equal-amplitude ones a coherent signal's level.
    out, into = join.curves(960, "power")
    assert np.allclose(out**2 + into**2, 1.0, atol=1e-6)
    out, into = join.curves(960, "amplitude")
    assert np.allclose(out + into, 1.0, atol=1e-6)


def test_windows_cover_the_recording_and_a_tone_joins_without_a_seam() -> None:
    total = 30_000  # 10 minutes of frames
    planned = windows.plan_windows(total)
    assert planned[0].start == 0 and planned[-1].start + planned[-1].length == total
    assert all(w.length <= windows.WINDOW_FRAMES for w in planned)
    assert windows.plan_windows(700) == [windows.Window(0, 700)]
    # A pass-through render of a 440 Hz tone, windowed and joined: the seam is below -100 dB.
    t = np.arange(total * HOP // 20) / SAMPLE_RATE
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    frames = len(tone) // HOP
    planned = windows.plan_windows(frames)
    parts = [tone[w.start * HOP : (w.start + w.length) * HOP][w.trim * HOP :] for w in planned]
    joined = join.join(parts, [0] * len(parts), SAMPLE_RATE, crossfade=windows.OVERLAP_FRAMES * HOP,
                       curve="amplitude", loudness=False)  # fmt: skip
    assert len(joined) == frames * HOP
    assert 20 * np.log10(np.max(np.abs(joined - tone[: frames * HOP])) + 1e-12) < -100


def test_timestamps_formats() -> None:
    segments = [{"index": 0, "text": "Hello.", "start": 0.0, "end": 1.25}, {"index": 1, "text": "Bye.", "start": 1.5,
                                                                           "end": 3661.0}]  # fmt: skip
    srt = timestamps.render(segments, "srt").decode()
    assert "1\n00:00:00,000 --> 00:00:01,250\nHello.\n" in srt and "01:01:01,000" in srt
    vtt = timestamps.render(segments, "vtt").decode()
    assert vtt.startswith("WEBVTT\n\n1\n00:00:00.000 --> 00:00:01.250\nHello.")
    assert b'"text": "Bye."' in timestamps.render(segments, "json")


# ---------------------------------------------------------------------------------------------------- planning


def _req(**fields):
    base = dict(text=None, task=None, instruction=None, description=None, style=None, language=None, speed=None,
                gen_seconds=None, ref_text=None)  # fmt: skip
    return SimpleNamespace(**{**base, **fields})


def test_plans_single_text_windows_and_refusals() -> None:
    single = plan.plan_request(_req(text="Hello there."), None)
    assert single["kind"] == "single" and single["duration"]["source"] == "rate:latin"
    assert single["instruction"].startswith("Generate speech based on the following description")
    long = plan.plan_request(_req(text=LATIN[:4096]), None)
    assert long["kind"] == "text" and long["voice"] == "anchor" and len(long["segments"]) > 10
    assert long["segments"][0]["frames"] <= plan.ANCHOR_MAX_S * 50
    assert long["segments"][1]["instruction"].startswith("Say the following with the same voice")
    clip = {"samples": 5 * 24000, "sample_rate": 24000}
    cloned = plan.plan_request(_req(text=LATIN[:4096]), clip)
    assert cloned["voice"] == "clip" and all(s["frames"] + 250 <= 1500 for s in cloned["segments"])
    given = plan.plan_request(_req(text=LATIN[:4096], gen_seconds=300.0), None)
    assert abs(given["duration"]["seconds"] - 300.0) <= len(given["segments"]) / 50
    raw = plan.plan_request(_req(instruction='Say the following: "Welcome."'), None)
    assert raw["kind"] == "single" and raw["gen_seconds"] == pytest.approx(8 / 15)
    recording = {"samples": 600 * 16000, "sample_rate": 16000}
    long_rec = plan.plan_request(_req(task="denoise"), recording)
    assert long_rec["kind"] == "windows" and long_rec["duration"]["seconds"] == 600.0
    with pytest.raises(InputError, match="^audio: the clip \\(29.00 s\\) leaves"):
        plan.plan_request(_req(text=LATIN[:2000]), {"samples": 29 * 24000, "sample_rate": 24000})
    with pytest.raises(InputError, match="^ref_text: the transcript .* does not fit its clip"):
        plan.plan_request(_req(text=LATIN[:2000], ref_text="Hi." * 200), clip)
    with pytest.raises(InputError, match="^gen_seconds: the instruction's words take about"):
        plan.plan_request(_req(instruction='Say the following: "' + "word " * 200 + '"'), None)


# ---------------------------------------------------------------------------------------------------- rendering


class FakePipeline:
    """Echoes a request's clip when it has one (a pass-through), else seeded noise; fails ``fail[i]`` times the
    segment whose instruction contains ``i``'s marker."""

    def __init__(self, fail: dict[str, int] | None = None) -> None:
        self.deploy = SimpleNamespace(defaults=SimpleNamespace(seed=0))
        self.fail = dict(fail or {})
        self.calls: list[int] = []
        self.rendered: list[str] = []

    def render_batch(self, requests, on_step=None):
        self.calls.append(len(requests))
        out = []
        for request in requests:
            if on_step is not None:
                on_step(1, 1)
            marker = next((m for m in self.fail if m in request.instruction), None)
            if marker is not None and self.fail[marker] > 0:
                self.fail[marker] -= 1
                out.append(ModelError(f"injected failure of {marker}"))
                continue
            frames = rules.request_frames(request)
            if request.gen_seconds is None:
                wave = np.asarray(request.audio.samples[: frames * HOP], dtype=np.float32)
            else:
                wave = np.random.default_rng(request.seed).standard_normal(frames * HOP).astype(np.float32) * 0.05
            self.rendered.append(request.instruction)
            out.append(RenderResult(wave, request.seed, 4, 2.0))
        return out


def _text_plan(body: str = LATIN[:3000]) -> dict:
    return plan.plan_request(_req(text=body), None)


def test_render_plan_groups_anchor_length_and_streaming() -> None:
    planned = _text_plan()
    pipe = FakePipeline()
    streamed: list[tuple[int, int, bool]] = []
    chunks: list[np.ndarray] = []

    def on_segment(index: int, samples: np.ndarray, last: bool) -> None:
        streamed.append((index, len(samples), last))
        chunks.append(samples)

    result = render_plan(pipe, planned, None, {"seed": 7}, Hooks(on_segment=on_segment), group_size=4)
    n = len(planned["segments"])
    assert len(result.waveform) == planned["samples"]  # the estimated length, to the sample
    assert pipe.calls[0] == 1 and max(pipe.calls) == 4 and result.passes == len(pipe.calls)
    assert [i for i, _, _ in streamed] == list(range(n)) and streamed[-1][2]
    assert np.array_equal(np.concatenate(chunks), result.waveform)
    again = render_plan(FakePipeline(), planned, None, {"seed": 7}, Hooks(), group_size=4)
    assert np.array_equal(again.waveform, result.waveform)  # seeded: identical run to run


def test_a_failed_segment_is_retried_alone_and_stored_segments_are_not_rendered_again() -> None:
    planned = _text_plan()
    marker = planned["segments"][5]["text"][:30]
    pipe = FakePipeline(fail={marker: 1})
    stored: dict[int, np.ndarray] = {}
    result = render_plan(pipe, planned, None, {"seed": 3}, Hooks(save=stored.__setitem__), group_size=4)
    assert 1 in pipe.calls[2:] and len(stored) == len(planned["segments"])
    assert sum(marker in r for r in pipe.rendered) == 1
    # A second failure ends the attempt; the segments finished before it stay stored for the next one.
    kept: dict[int, np.ndarray] = {}
    with pytest.raises(ModelError):
        render_plan(FakePipeline(fail={marker: 2}), planned, None, {"seed": 3}, Hooks(save=kept.__setitem__),
                    group_size=4)  # fmt: skip
    assert 0 in kept and 5 not in kept
    resumed = FakePipeline()
    again = render_plan(resumed, planned, None, {"seed": 3}, Hooks(load=kept.get), group_size=4)
    assert len(resumed.rendered) == len(planned["segments"]) - len(kept)
    assert np.array_equal(again.waveform, result.waveform)


def test_cancel_stops_at_the_next_group() -> None:
    planned = _text_plan()
    pipe = FakePipeline()

    def progress(done: int, total: int) -> None:
        if done >= 5:
            raise Canceled("canceled")

    with pytest.raises(Canceled):
        render_plan(pipe, planned, None, {}, Hooks(progress=progress), group_size=4)
    assert sum(pipe.calls) == 5


def test_windows_plan_renders_a_long_recording_to_its_length() -> None:
    seconds = 40.0
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    planned = plan.plan_request(_req(task="enhance"), {"samples": len(tone), "sample_rate": SAMPLE_RATE})
    result = render_plan(FakePipeline(), planned, AudioClip(tone, SAMPLE_RATE), {}, Hooks(), group_size=2)
    assert len(result.waveform) == 2000 * HOP
    assert np.max(np.abs(result.waveform - tone[: 2000 * HOP])) < 1e-5
