"""rules.py: every request limit once, the length rule in latent frames, and the knobs a request resolves to.

The API's request model must refuse exactly what the rules refuse (its bounds are the rules' constants); the
end-to-end agreement of the API, the worker and the pipeline at 30 s is in tests/service/test_length_rule.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from auk_worker import rules
from auk_worker.audio import CheckedClip, checked_clip, decode_audio, resample, validate_clip
from auk_worker.deploy import DiTSampling
from auk_worker.errors import AudioError, InputError
from auk_worker.service.records.requests import JobRequest
from auk_worker.types import AudioClip

DEFAULTS = DiTSampling(seed=7, num_inference_steps=32, guidance_scale=2.0)


def api_accepts(**fields) -> bool:
    try:
        JobRequest(instruction="x", gen_seconds=1.0, **fields)
    except ValidationError:
        return False
    return True


def rules_accept(bound: rules.Bound, value) -> bool:
    return bound.problem(value) is None


@pytest.mark.parametrize("bound, values", [
    (rules.STEPS, [0, 1, 1000, 1001, 4.0, True]),
    (rules.GUIDANCE, [-0.001, 0, 0.0, 20.0, 20.001, float("nan"), float("inf"), True]),
    (rules.SWAY, [-1.0001, -1, -1.0, 0.0, 0.0001, float("nan")]),
    (rules.SEED, [-1, 0, 2**63 - 1, 2**63, 1.0, False]),
])
def test_the_api_model_refuses_exactly_what_the_rules_refuse(bound, values):
    for value in values:
        assert api_accepts(**{bound.name: value}) == rules_accept(bound, value), (bound.name, value)


def test_texts_name_the_knob_its_interval_and_the_value():
    with pytest.raises(InputError, match=r"^num_inference_steps must be in \[1, 1000\] \(an integer\), got 0$"):
        rules.STEPS.check(0)
    with pytest.raises(InputError, match=r"^seed must be in \[0, 2\^63\) \(an integer\), got 9223372036854775808$"):
        rules.SEED.check(2**63)
    with pytest.raises(InputError, match=r"^guidance_scale must be in \[0, 20\], got nan$"):
        rules.GUIDANCE.check(float("nan"))
    assert rules.STEPS.check(np.int64(8)) == 8  # any integral type, never a bool or a float


def test_instruction_and_length_rules():
    with pytest.raises(InputError, match="instruction must be a non-empty string"):
        rules.check_instruction("   ")
    with pytest.raises(InputError, match="at most 4000"):
        rules.check_instruction("x" * 4001)
    with pytest.raises(ValidationError, match="instruction must be a non-empty string"):
        JobRequest(instruction="  ", gen_seconds=1.0)
    assert JobRequest(instruction="x").gen_seconds is None  # the API estimates the length (longform/plan.py)
    with pytest.raises(ValidationError, match="instruction .* or input or text .* is required"):
        JobRequest(gen_seconds=1.0)
    with pytest.raises(ValidationError, match="instruction: give the whole instruction or its parts"):
        JobRequest(instruction="x", text="y")
    with pytest.raises(ValidationError, match="gen_seconds is 31; a raw instruction renders in one pass"):
        JobRequest(instruction="x", gen_seconds=31.0)
    with pytest.raises(InputError, match=rules.LENGTH_REQUIRED):
        rules.target_frames(None, None)
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(InputError, match="gen_seconds must be a positive number"):
            rules.target_frames(bad, None)


def test_the_target_is_counted_in_whole_frames_up_to_exactly_30_s():
    assert rules.target_frames(1e-9, None) == 1
    assert rules.target_frames(0.61, None) == 31
    assert rules.target_frames(30.0, None) == rules.MAX_TOTAL_FRAMES == 1500
    just_over = math.nextafter(30.0, 31.0)
    with pytest.raises(InputError, match="at most 30 s"):
        rules.target_frames(just_over, None)
    # The API's own bound on gen_seconds says the same at that float.
    assert JobRequest(instruction="x", gen_seconds=30.0).gen_seconds == 30.0
    with pytest.raises(ValidationError):
        JobRequest(instruction="x", gen_seconds=just_over)
    # Without gen_seconds the target is the clip's whole frames: a clip of 750 frames fits, 751 do not.
    assert rules.target_frames(None, 750) == 750
    with pytest.raises(InputError, match=r"clip \(15.02 s\) plus target \(15.02 s\) is 30.04 s"):
        rules.target_frames(None, 751)


@pytest.mark.parametrize("rate", [8_000, 11_025, 16_000, 22_050, 44_100, 48_000])
def test_clip_frames_are_the_frames_of_the_resampled_clip(rate):
    """The frames the rule counts are those of the 24 kHz copy the pipeline actually encodes."""
    rng = np.random.default_rng(rate)
    for samples in (rate // 50, rate // 50 + 1, int(rate * 0.7311), 3 * rate - 1, 3 * rate, 3 * rate + 1):
        clip = (0.1 * rng.standard_normal(samples)).astype(np.float32)
        assert len(resample(clip, rate, 24_000)) == rules.resampled_length(samples, rate, 24_000)
        assert rules.clip_frames(samples, rate) == len(resample(clip, rate, 24_000)) // 480


def test_knobs_resolve_against_the_deploy_defaults():
    unset = rules.resolve_knobs("base", DEFAULTS)
    assert unset == rules.Knobs(32, 2.0, -1.0, 7)
    explicit = rules.resolve_knobs("base", DEFAULTS, num_inference_steps=8, guidance_scale=0.0, sway=0, seed=0)
    assert explicit == rules.Knobs(8, 0.0, 0.0, 0)  # an explicit 0.0 stays 0.0
    flash = rules.resolve_knobs("flash", DEFAULTS, num_inference_steps=40, guidance_scale=3.0, seed=5)
    assert flash == rules.Knobs(rules.FLASH_STEPS, rules.FLASH_GUIDANCE, None, 5, fixed_grid=True)
    assert flash.key == rules.resolve_knobs("flash", DEFAULTS).key  # every Flash job follows one schedule
    with pytest.raises(InputError, match="num_inference_steps"):  # bounds hold whatever the variant pins
        rules.resolve_knobs("flash", DEFAULTS, num_inference_steps=0)


def test_a_clip_is_checked_once_and_an_in_memory_one_still_is():
    tone = (0.1 * np.sin(np.arange(4800) / 10)).astype(np.float32)
    checked = validate_clip(tone, 24_000)
    assert isinstance(checked, CheckedClip) and checked_clip(checked) is checked
    again = checked_clip(AudioClip(tone, 24_000))
    assert isinstance(again, CheckedClip) and np.array_equal(again.samples, tone)
    with pytest.raises(AudioError, match="NaN"):
        checked_clip(AudioClip(np.full(4800, np.nan, np.float32), 24_000))
    with pytest.raises(AudioError, match="not audio"):
        decode_audio(b"\x07" * 64)
