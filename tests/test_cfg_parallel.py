"""CFG parallelism on the CPU: the worker's process and a follower process (gloo) each run one half of every
guided step of the tiny checkpoint, and the render matches the one-process render."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch.distributed as dist

from auk_worker.deploy import load_deploy_config
from auk_worker.errors import Canceled, ConfigError
from auk_worker.pipeline import AuKPipeline
from auk_worker.tiny.checkpoint import make_tiny_checkpoint
from auk_worker.types import AudioClip, RenderRequest

INSTRUCT = 'Generate speech based on the following description: "Calm." The content to speak is: "Hi."'
ZERO_SHOT = 'Say the following with the same voice: "Hi."'

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def paired(deploy):
    return dataclasses.replace(deploy, stages=(deploy.encoder, dataclasses.replace(deploy.dit, devices="0,1",
                                                                                   cfg_parallel_size=2)))


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "base", variant="base")
    deploy = load_deploy_config()
    alone = AuKPipeline.load(checkpoint, deploy, device="cpu")
    pair = AuKPipeline.load(checkpoint, paired(deploy), device="cpu")
    yield alone, pair
    pair.cfg_pair.close()


def clip(seconds: float, rate: int = 24_000) -> AudioClip:
    samples = 0.2 * np.random.default_rng(3).standard_normal(int(seconds * rate))
    return AudioClip(samples=samples.astype(np.float32), sample_rate=rate)


def requests() -> list[RenderRequest]:
    return [
        RenderRequest(INSTRUCT, gen_seconds=0.4, num_inference_steps=4, guidance_scale=2.0, seed=7),
        RenderRequest(ZERO_SHOT, audio=clip(0.5), gen_seconds=0.3, num_inference_steps=3, guidance_scale=3.0, seed=8),
    ]


def test_a_paired_render_matches_the_one_process_render(pipes):
    alone, pair = pipes
    assert pair.cfg_pair is not None and pair.cfg_pair.process.is_alive()
    for request in requests():
        expected, got = alone.render(request).waveform, pair.render(request).waveform
        assert got.shape == expected.shape
        # Only the matrix kernels' blocking for b rows against 2b can differ; fp32 keeps that far below 1e-5.
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def test_a_paired_batch_matches_and_unguided_renders_stay_local(pipes):
    alone, pair = pipes
    batch = requests()
    for expected, got in zip(alone.render_batch(batch), pair.render_batch(batch)):
        np.testing.assert_allclose(got.waveform, expected.waveform, rtol=0, atol=1e-5)
    unguided = RenderRequest(INSTRUCT, gen_seconds=0.3, num_inference_steps=2, guidance_scale=0.0, seed=1)
    np.testing.assert_array_equal(pair.render(unguided).waveform, alone.render(unguided).waveform)


def test_a_cancel_keeps_the_pair_in_step(pipes):
    alone, pair = pipes

    def cancel_at_two(done: int, total: int) -> None:
        if done == 2:
            raise Canceled("canceled at step 2")

    with pytest.raises(Canceled):
        pair.render(requests()[0], on_step=cancel_at_two)
    request = requests()[1]  # the follower finished the canceled pass and takes the next one
    np.testing.assert_allclose(pair.render(request).waveform, alone.render(request).waveform, rtol=0, atol=1e-5)


def test_the_deploy_config_names_two_devices_for_a_pair(tmp_path):
    text = open(load_deploy_config().source).read()
    line = "    max_num_seqs: 1              # jobs rendered together in one DiT pass (bulk queue)\n"
    assert text.count(line) == 1
    path = tmp_path / "pair.yaml"
    path.write_text(text.replace(line, line + "    cfg_parallel_size: 2\n"))
    with pytest.raises(ConfigError, match="two distinct GPUs"):
        load_deploy_config(path)
    path.write_text(text.replace(line, line + "    cfg_parallel_size: 2\n").replace('devices: "0"\n    max_num_seqs: 1 ',
                                                                                   'devices: "0,1"\n    max_num_seqs: 1 ', 1))
    assert load_deploy_config(path).dit.cfg_parallel_size == 2
    path.write_text(text.replace(line, line + "    cfg_parallel_size: 3\n"))
    with pytest.raises(ConfigError, match="1 or 2"):
        load_deploy_config(path)
