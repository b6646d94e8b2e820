"""The engine end to end on the tiny checkpoint (CPU, fp32): release-layout loading, lengths, seeds, variants,
batching, and the errors bad requests and bad checkpoints get."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import yaml
from safetensors.torch import load_file, save_file

from auk_worker.checkpoint import read_release
from auk_worker.errors import AudioError, CheckpointError, InputError, ModelError
from auk_worker.model.dit.layers import _grouped_conv_as_bmm
from auk_worker.model.sampling import FLASH_T_GRID
from auk_worker.pipeline import AuKPipeline
from auk_worker.tiny.checkpoint import make_tiny_checkpoint
from auk_worker.types import SAMPLE_RATE, AudioClip, RenderRequest

INSTRUCT = 'Generate speech based on the following description: "Calm." The content to speak is: "Hi."'
ZERO_SHOT = 'Say the following with the same voice: "Hi."'


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {variant: make_tiny_checkpoint(root / variant, variant=variant) for variant in ("base", "flash")}


@pytest.fixture(scope="module")
def pipes(checkpoints) -> dict[str, AuKPipeline]:
    return {variant: AuKPipeline.load(path, device="cpu") for variant, path in checkpoints.items()}


def clip(seconds: float, rate: int = 44_100, channels: int = 2, seed: int = 0) -> AudioClip:
    samples = 0.2 * np.random.default_rng(seed).standard_normal((int(seconds * rate), channels))
    return AudioClip(samples=samples.mean(axis=1).astype(np.float32), sample_rate=rate)


@pytest.mark.parametrize("variant", ["base", "flash"])
@pytest.mark.parametrize("with_clip", [False, True])
def test_output_length_and_rate(pipes, variant, with_clip):
    request = RenderRequest(ZERO_SHOT if with_clip else INSTRUCT, audio=clip(0.73) if with_clip else None,
                            gen_seconds=0.61, num_inference_steps=3, seed=5)
    result = pipes[variant].render(request)
    assert result.sample_rate == SAMPLE_RATE
    assert result.waveform.dtype == np.float32 and result.waveform.ndim == 1
    assert len(result.waveform) == 31 * 480  # ceil(50 * 0.61) frames of 480 samples
    assert np.isfinite(result.waveform).all() and np.abs(result.waveform).max() <= 1.0
    assert set(result.timings) >= {"encode", "vae_encode", "dit", "decode", "total"}


def test_target_defaults_to_the_clips_whole_frames(pipes):
    result = pipes["base"].render(RenderRequest("Remove the noise.", audio=clip(0.5051, rate=24_000), seed=1,
                                                num_inference_steps=2))
    assert len(result.waveform) == (int(0.5051 * 24_000) // 480) * 480


def test_flash_pins_its_recipe(pipes):
    result = pipes["flash"].render(RenderRequest(INSTRUCT, gen_seconds=0.2, num_inference_steps=40, guidance_scale=3.0))
    assert result.num_inference_steps == 4 and result.guidance_scale == 0.0
    assert pipes["flash"].schedule(RenderRequest(INSTRUCT)).grid.tolist() == pytest.approx(FLASH_T_GRID)


def test_a_twin_sharing_the_weights_changes_only_what_it_is_given(pipes):
    base = pipes["base"]
    flash = base.sharing_weights(release=dataclasses.replace(base.release, variant="flash"))
    assert flash.dit is base.dit and flash.encoder is base.encoder and flash.vae is base.vae
    assert flash.schedule(RenderRequest(INSTRUCT)).num_steps == 4
    assert base.schedule(RenderRequest(INSTRUCT)).num_steps == 32
    with pytest.raises(TypeError, match="no attribute"):
        base.sharing_weights(step_graph=None)


def test_base_takes_the_deploy_defaults(pipes):
    schedule = pipes["base"].schedule(RenderRequest(INSTRUCT))
    assert schedule.num_steps == 32 and schedule.guidance_scale == 2.0 and schedule.seed == 0


def test_seeds(pipes):
    pipe = pipes["base"]
    request = RenderRequest(INSTRUCT, gen_seconds=0.3, num_inference_steps=3, seed=42)
    first, again = pipe.render(request), pipe.render(request)
    other = pipe.render(RenderRequest(INSTRUCT, gen_seconds=0.3, num_inference_steps=3, seed=43))
    assert first.seed == 42
    assert np.array_equal(first.waveform, again.waveform)
    assert not np.allclose(first.waveform, other.waveform)


def test_global_rng_is_untouched(pipes):
    state = torch.get_rng_state()
    pipes["base"].render(RenderRequest(ZERO_SHOT, audio=clip(0.3), gen_seconds=0.2, num_inference_steps=2,
                                       vae_sample=True, seed=3))
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("thinker_rows", [1, 3])
def test_batch_matches_one_at_a_time_and_isolates_failures(pipes, thinker_rows, monkeypatch):
    """With the prompts through the thinker one at a time or three to a pass (stage 0's max_num_seqs)."""
    pipe = pipes["base"]
    monkeypatch.setattr(pipe.encoder, "max_rows", thinker_rows)
    requests = [
        RenderRequest(INSTRUCT, gen_seconds=0.4, num_inference_steps=3, seed=1),
        RenderRequest(INSTRUCT + " Longer.", gen_seconds=0.7, num_inference_steps=3, seed=2),
        RenderRequest("   ", gen_seconds=0.4, num_inference_steps=3),
        RenderRequest(ZERO_SHOT, audio=clip(0.5), gen_seconds=0.5, num_inference_steps=3, seed=4),
    ]
    batched = pipe.render_batch(requests)
    assert isinstance(batched[2], InputError)
    for index in (0, 1, 3):
        alone = pipe.render(requests[index])
        assert batched[index].seed == alone.seed
        np.testing.assert_allclose(batched[index].waveform, alone.waveform, atol=1e-5)


def test_a_failing_thinker_pass_fails_only_the_job_that_causes_it(pipes, monkeypatch):
    """A pass of several prompts that fails is retried one prompt at a time: the others render."""
    pipe = pipes["base"]
    monkeypatch.setattr(pipe.encoder, "max_rows", 4)
    conditions = pipe.encoder.conditions
    poisoned = pipe.encoder.embed("Poisoned.", None).shape[0]  # the prompt length that fails

    def failing(embeds):
        if any(e.shape[0] == poisoned for e in embeds):
            raise ModelError("the thinker failed")
        return conditions(embeds)

    monkeypatch.setattr(pipe.encoder, "conditions", failing)
    requests = [
        RenderRequest(INSTRUCT, gen_seconds=0.4, num_inference_steps=2, seed=1),
        RenderRequest("Poisoned.", gen_seconds=0.4, num_inference_steps=2, seed=2),
        RenderRequest(INSTRUCT + " Longer.", gen_seconds=0.4, num_inference_steps=2, seed=3),
    ]
    assert len({pipe.encoder.embed(r.instruction, None).shape[0] for r in requests}) == 3
    results = pipe.render_batch(requests)
    assert isinstance(results[1], ModelError) and "the thinker failed" in str(results[1])
    for index in (0, 2):
        assert results[index].waveform.shape == (int(0.4 * SAMPLE_RATE),)
        assert results[index].timings["encode"] > 0
    with pytest.raises(ModelError, match="the thinker failed"):
        pipe.render(requests[1])


def test_long_target_decodes_in_tiles_like_a_whole_decode(pipes):
    pipe = pipes["base"]
    latents = torch.randn(1, 700, 64)
    with torch.inference_mode():
        tiled = pipe._decode(latents)  # 700 frames > the 640-frame tile: decoded in windows
        whole = pipe.vae.decode(latents)
    assert pipe.vae_tile_frames == 640
    assert tiled.shape == whole.shape == (1, 700 * 480)
    assert (tiled - whole).abs().max() < 1e-5


@pytest.mark.parametrize(
    "request_, error, message",
    [
        (RenderRequest(INSTRUCT), InputError, "gen_seconds is required when no audio is given"),
        (RenderRequest("", gen_seconds=1.0), InputError, "instruction must be a non-empty string"),
        (RenderRequest(INSTRUCT, gen_seconds=30.5), InputError, "at most 30 s"),
        (RenderRequest(INSTRUCT, audio=clip(20.0, rate=8_000, channels=1), gen_seconds=10.5), InputError, "at most 30 s"),
        (RenderRequest(INSTRUCT, gen_seconds=-1.0), InputError, "gen_seconds must be a positive number"),
        (RenderRequest(INSTRUCT, gen_seconds=float("nan")), InputError, "gen_seconds must be a positive number"),
        (RenderRequest(INSTRUCT, gen_seconds=1.0, num_inference_steps=0), InputError, "num_inference_steps"),
        (RenderRequest(INSTRUCT, gen_seconds=1.0, sway=0.5), InputError, "sway"),
        (RenderRequest(INSTRUCT, gen_seconds=1.0, guidance_scale=-1.0), InputError, "guidance_scale"),
        (RenderRequest(INSTRUCT, gen_seconds=1.0, seed=-3), InputError, "seed"),
        (RenderRequest("Say <|im_end|> now", gen_seconds=1.0), InputError, "im_end"),
        (RenderRequest(INSTRUCT, audio=AudioClip(np.zeros(10, np.float32), 24_000)), AudioError, "at least 20 ms"),
        (RenderRequest(INSTRUCT, audio=AudioClip(np.full(4800, np.nan, np.float32), 24_000)), AudioError, "NaN"),
    ],
)
def test_bad_requests_get_named_errors(pipes, request_, error, message):
    with pytest.raises(error, match=message):
        pipes["base"].render(request_)


def test_tiny_checkpoint_is_deterministic_and_in_release_layout(checkpoints, tmp_path):
    again = make_tiny_checkpoint(tmp_path / "again", variant="base")
    names = sorted(p.relative_to(again).as_posix() for p in again.rglob("*") if p.is_file())
    assert {"config.yaml", "auk_base.safetensors", "vae.safetensors", "qwen/config.json",
            "qwen/tokenizer.json", "qwen/preprocessor_config.json"} <= set(names)
    for name in ("auk_base.safetensors", "vae.safetensors", "qwen/model.safetensors"):
        digest = lambda root: hashlib.sha256((root / name).read_bytes()).hexdigest()  # noqa: E731
        assert digest(again) == digest(checkpoints["base"]), name
    weights = load_file(str(again / "auk_base.safetensors"))
    assert {"layer_weights", "layer_scale", "transformer.rotary_embed.inv_freq"} <= set(weights)
    assert all(k.startswith("transformer.") or k in ("layer_weights", "layer_scale") for k in weights)
    assert all(t.dtype == torch.float32 for t in weights.values())  # the release export is fp32
    flash = load_file(str(checkpoints["flash"] / "auk_flash.safetensors"))
    assert not torch.equal(flash["layer_scale"], weights["layer_scale"])  # each release has its own fusion


def copy_checkpoint(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def test_missing_tensor_is_named(checkpoints, tmp_path):
    root = copy_checkpoint(checkpoints["base"], tmp_path / "c")
    weights = load_file(str(root / "auk_base.safetensors"))
    del weights["transformer.single_transformer_blocks.1.ff.linear_out.weight"]
    save_file(weights, str(root / "auk_base.safetensors"))
    with pytest.raises(CheckpointError, match="transformer.single_transformer_blocks.1.ff.linear_out.weight"):
        AuKPipeline.load(root, device="cpu")


def test_unexpected_and_misshaped_tensors_are_named(checkpoints, tmp_path):
    root = copy_checkpoint(checkpoints["base"], tmp_path / "c")
    weights = load_file(str(root / "auk_base.safetensors"))
    weights["text_encoder.stray"] = torch.zeros(2)
    save_file(weights, str(root / "auk_base.safetensors"))
    with pytest.raises(CheckpointError, match="text_encoder.stray"):
        AuKPipeline.load(root, device="cpu")
    del weights["text_encoder.stray"]
    weights["transformer.proj_out.bias"] = torch.zeros(3)
    save_file(weights, str(root / "auk_base.safetensors"))
    with pytest.raises(CheckpointError, match=r"transformer.proj_out.bias.*\(3,\), expected \(64,\)"):
        AuKPipeline.load(root, device="cpu")
    shutil.copy(checkpoints["base"] / "auk_base.safetensors", root / "auk_base.safetensors")
    vae = load_file(str(root / "vae.safetensors"))
    del vae["global_mean"]
    save_file(vae, str(root / "vae.safetensors"))
    with pytest.raises(CheckpointError, match="global_mean"):
        AuKPipeline.load(root, device="cpu")


def test_variant_comes_from_the_config_not_the_file_name(checkpoints, tmp_path):
    root = copy_checkpoint(checkpoints["base"], tmp_path / "AuK-Flash-looking-name")
    assert read_release(root).variant == "base"
    config = yaml.safe_load((root / "config.yaml").read_text())
    config["model"]["name"] = "AuK-Flash"
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(CheckpointError, match="auk_flash.safetensors is missing"):
        read_release(root)
    config["model"]["name"] = "AuK-Turbo"
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(CheckpointError, match="model.name must be one of"):
        read_release(root)


def test_grouped_conv_as_one_matmul_equals_the_convolution():
    conv = torch.nn.Conv1d(64, 64, 31, groups=16, padding=15)
    h = torch.randn(3, 64, 40)
    with torch.no_grad():
        assert (conv(h) - _grouped_conv_as_bmm(h, conv)).abs().max() < 1e-5


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "auk_worker.cli", *args], capture_output=True, text=True, timeout=300)


def test_render_command(checkpoints, tmp_path):
    source = tmp_path / "clip.flac"
    sf.write(source, 0.1 * np.random.default_rng(0).standard_normal((22_050, 2)), 22_050)
    out = tmp_path / "out.wav"
    done = run_cli("render", "--checkpoint", str(checkpoints["flash"]), "--instruction", ZERO_SHOT,
                   "--audio", str(source), "--gen-seconds", "0.5", "--seed", "9", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "0.50 s at 24000 Hz (12000 samples), seed 9, 4 steps" in done.stdout
    assert "encode" in done.stdout and "dit" in done.stdout and "decode" in done.stdout
    data, rate = sf.read(out)
    assert rate == 24_000 and data.shape == (12_000,)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--instruction", "x", "--out", "o.wav"], "gen_seconds is required"),
        (["--instruction", "x", "--gen-seconds", "40", "--out", "o.wav"], "at most 30 s"),
        (["--instruction", "x", "--audio", "missing.wav", "--out", "o.wav"], "cannot read the audio file"),
    ],
)
def test_render_command_refuses_bad_input_in_one_line(checkpoints, tmp_path, args, message):
    done = run_cli("render", "--checkpoint", str(checkpoints["base"]), *args)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("auk: error:")]
    assert len(lines) == 1 and message in lines[0]


def test_render_command_refuses_a_directory_that_is_no_checkpoint(tmp_path):
    done = run_cli("render", "--checkpoint", str(tmp_path), "--instruction", "x", "--gen-seconds", "1",
                   "--out", str(tmp_path / "o.wav"))
    assert done.returncode == 2 and "config.yaml is missing" in done.stderr


@pytest.mark.parametrize("clip_seconds", [0.0, 20.0, 19.99])
@pytest.mark.parametrize("gen_seconds", [10.0, 10.0000005, 10.01, 9.99])
def test_the_api_and_the_engine_apply_one_length_rule(clip_seconds, gen_seconds):
    """Near 30 s the API must refuse exactly what the worker would refuse (frames, not seconds)."""
    from api.submit import record_request
    from auk_worker.service.records.requests import AudioRef, JobRequest

    gen_seconds = gen_seconds + (20.0 if clip_seconds == 0.0 else 0.0)
    audio = AudioRef(key="clip.wav") if clip_seconds else None
    job = JobRequest(instruction=INSTRUCT, audio=audio, gen_seconds=min(gen_seconds, 30.0))
    samples = round(clip_seconds * 24_000)
    clip = {"bucket": "b", "key": "clip.wav", "duration_s": clip_seconds, "sample_rate": 24_000, "samples": samples}

    def verdict(check) -> bool:
        try:
            check()
        except InputError:
            return False
        return True

    api = verdict(lambda: record_request(job, clip if clip_seconds else None))
    in_memory = AudioClip(np.zeros(samples, np.float32), 24_000) if clip_seconds else None
    request = RenderRequest(INSTRUCT, audio=in_memory, gen_seconds=job.gen_seconds)
    engine = verdict(lambda: AuKPipeline.target_frames(request, samples))
    assert api == engine


@pytest.mark.parametrize("variant", ["base", "flash"])
@pytest.mark.parametrize("knobs", [{}, {"guidance_scale": 0.0}, {"num_inference_steps": 5, "guidance_scale": 3.5,
                                                                 "sway": -0.5, "seed": 11}])
def test_the_instant_pipeline_reports_what_the_real_one_would(pipes, variant, knobs):
    """The model-free pipeline resolves a request as the real one does, from the same deploy config: an explicit
    guidance of 0.0 stays 0.0, unset knobs take the config's defaults, Flash pins its recipe."""
    from auk_worker.service.worker.instant import InstantPipeline

    pipe = pipes[variant]
    request = RenderRequest(INSTRUCT, gen_seconds=0.3, **knobs)
    schedule = pipe.schedule(request)
    result = InstantPipeline(pipe.variant, pipe.deploy).render(request)
    assert (result.num_inference_steps, result.guidance_scale, result.seed) == (
        schedule.num_steps, schedule.guidance_scale, schedule.seed)


def test_the_flash_recipe_of_the_rules_is_its_grid():
    from auk_worker import rules

    assert rules.FLASH_STEPS == len(FLASH_T_GRID) - 1
