"""The VAE on a tiny config with the release's decoder geometry (6 stages, 480 hop, kernels 3/7/11) but
1-32 channels: checkpoint layout and strict loading, weight-norm folding, lengths, tiling, causality,
posterior sampling and latent normalisation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from auk_worker.errors import CheckpointError, ConfigError
from auk_worker.model.vae import AuKVAE, VAEConfig, load_vae, plan_tiles
from auk_worker.model.vae.alias_free import lowpass_taps
from auk_worker.model.vae.config import decoder_context
from auk_worker.model.vae.vae import weight_norm_keys

TINY = VAEConfig(upsample_initial_channel=64, downsample_channels=(12, 12, 12, 12, 16, 16, 16))
HOP = 480


def random_vae(seed: int = 0) -> AuKVAE:
    """A tiny VAE with weights scaled so the decoder output stays well inside the clamp."""
    torch.manual_seed(seed)
    model = AuKVAE(TINY)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d)):
                fan = module.weight[0].numel()
                module.weight.normal_(std=0.5 / fan**0.5)
        for name, param in model.named_parameters():
            if name.endswith((".alpha", ".beta")):
                param.normal_(std=0.2)
        model.global_mean.normal_(std=0.1)
        model.global_log_std.uniform_(0.5, 2.0)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def model() -> AuKVAE:
    return random_vae()


@pytest.fixture(scope="module")
def checkpoint(model: AuKVAE) -> dict[str, torch.Tensor]:
    return model.release_state_dict()


@pytest.fixture(scope="module")
def loaded(checkpoint: dict[str, torch.Tensor]) -> AuKVAE:
    return load_vae(checkpoint, TINY, "cpu")


def latents(frames: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, frames, TINY.latent_dim, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------- config


def test_config_round_trips_through_the_release_mapping():
    section = TINY.to_release()
    assert section["model_init_kwargs"]["downsample_channels"] == [12, 12, 12, 12, 16, 16, 16]
    section["model_init_kwargs"]["latent_dim"] = "${model.vae.latent_dim}"  # as the YAML writes it
    assert VAEConfig.from_release(section) == TINY
    bare = {"latent_dim": 64, "downsample_rate": 480, "target_sample_rate": 24000}
    assert VAEConfig.from_release(bare) == VAEConfig()  # absent model_init_kwargs take the released values


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("downsample_rates", [2, 2, 2, 3, 4, 4]),
        ("upsample_rates", [5, 4, 3, 2, 2, 3]),
        ("downsample_channels", [16, 24, 48, 96, 192, 384, 768]),
    ],
)
def test_config_rejects_bad_geometry_naming_the_field(field: str, value: list[int]):
    section = VAEConfig().to_release()
    section["model_init_kwargs"][field] = value
    with pytest.raises(CheckpointError, match=field):
        VAEConfig.from_release(section)


def test_config_rejects_other_rates_and_latent_mismatch():
    with pytest.raises(CheckpointError, match="target_sample_rate"):
        VAEConfig.from_release({**VAEConfig().to_release(), "target_sample_rate": 16000})
    with pytest.raises(CheckpointError, match="downsample_rate"):
        VAEConfig.from_release({**VAEConfig().to_release(), "downsample_rate": 320})
    with pytest.raises(CheckpointError, match="latent_dim"):
        VAEConfig.from_release({**VAEConfig().to_release(), "latent_dim": 32})


def test_release_size_parameter_count():
    """146.9 M parameters without the flow (counted in the checkpoint layout, g and v)."""
    with torch.device("meta"):
        model = AuKVAE(VAEConfig())
    weights = {k: t for k, t in model.release_state_dict().items() if not k.endswith(".filter")}
    count = sum(t.numel() for k, t in weights.items() if k not in ("global_mean", "global_log_std"))
    assert abs(count - 146.9e6) / 146.9e6 < 1e-3


# ----------------------------------------------------------------------------------------------- loading


def test_checkpoint_keys_follow_the_release_layout(checkpoint: dict[str, torch.Tensor]):
    for key in [
        "global_mean",
        "global_log_std",
        "audio_encoder.generator.0.layer.weight_g",
        "audio_encoder.generator.2.layer.weight_v",  # first strided conv
        "audio_encoder.generator.3.layers.5.1.weight_g",  # ResStack: dilated conv of the 6th pair
        "audio_encoder.generator.18.layers.0.3.bias",
        "audio_encoder.generator.20.layer.weight_v",  # head
        "conv_pre.weight_g",
        "ups.5.0.weight_v",
        "resblocks.17.convs1.2.weight_g",
        "resblocks.17.convs2.2.bias",
        "resblocks.0.activations.5.act.beta",
        "resblocks.0.activations.0.upsample.filter",
        "resblocks.0.activations.0.downsample.lowpass.filter",
        "activation_post.act.alpha",
        "conv_post.weight_g",
    ]:
        assert key in checkpoint, key
    assert "conv_post.bias" not in checkpoint
    assert "audio_encoder.generator.21.layer.weight_g" not in checkpoint
    # transposed conv: weight [in, out, k] normalised over all but the input-channel axis
    assert checkpoint["ups.0.0.weight_g"].shape == (64, 1, 1)
    assert checkpoint["audio_encoder.generator.20.layer.weight_v"].shape == (128, 16, 3)


def test_strict_load_round_trips(model: AuKVAE, loaded: AuKVAE):
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        torch.testing.assert_close(theirs[key], mine[key], rtol=1e-6, atol=1e-7, msg=key)
    assert not any(p.requires_grad for p in loaded.parameters())


def test_missing_key_is_named(checkpoint: dict[str, torch.Tensor]):
    state = dict(checkpoint)
    del state["resblocks.4.convs2.1.weight_v"]
    with pytest.raises(CheckpointError, match=r"resblocks\.4\.convs2\.1\.weight_v"):
        load_vae(state, TINY, "cpu")


def test_unexpected_key_is_named_but_flow_is_ignored(checkpoint: dict[str, torch.Tensor]):
    flow = {"flow.flows.0.pre.weight": torch.zeros(3, 3), "flow.flows.0.enc.in_layers.0.weight_g": torch.ones(4)}
    load_vae({**checkpoint, **flow}, TINY, "cpu")
    with pytest.raises(CheckpointError, match=r"conv_post\.bias"):
        load_vae({**checkpoint, "conv_post.bias": torch.zeros(1)}, TINY, "cpu")


def test_shape_mismatch_names_key_and_shapes(checkpoint: dict[str, torch.Tensor]):
    state = {**checkpoint, "conv_pre.weight_v": torch.zeros(64, 32, 7)}
    with pytest.raises(CheckpointError, match=r"conv_pre\.weight_v.*\(64, 32, 7\).*\(64, 64, 7\)"):
        load_vae(state, TINY, "cpu")


def test_filter_taps_are_optional_and_checked(checkpoint: dict[str, torch.Tensor], loaded: AuKVAE):
    filters = [key for key in checkpoint if key.endswith(".filter")]
    assert len(filters) == 2 * (18 * 6 + 1)
    without = {key: value for key, value in checkpoint.items() if key not in filters}
    rebuilt = load_vae(without, TINY, "cpu")
    for key in filters:
        assert torch.equal(rebuilt.state_dict()[key], loaded.state_dict()[key])
    taps = lowpass_taps().flatten()
    assert taps.shape == (12,) and abs(taps.sum().item() - 1) < 1e-6
    assert torch.allclose(taps, taps.flip(0))  # linear phase
    bad = {**checkpoint, filters[3]: checkpoint[filters[3]] * 1.01}
    with pytest.raises(CheckpointError, match=filters[3].replace(".", r"\.")):
        load_vae(bad, TINY, "cpu")


def test_folding_matches_per_forward_weight_norm(checkpoint: dict[str, torch.Tensor], loaded: AuKVAE):
    """The reference recomputes g * v / ||v|| every forward; folding once must give the same decode."""
    reference = AuKVAE(TINY)
    norm_keys = weight_norm_keys(reference)
    plain = {k: v for k, v in checkpoint.items() if not k.endswith(("weight_g", "weight_v"))}
    reference.load_state_dict(plain, strict=False)
    for key in norm_keys:
        module = reference.get_submodule(key.removesuffix(".weight"))
        nn.utils.parametrizations.weight_norm(module, "weight", dim=0)
        module.parametrizations.weight.original0.data = checkpoint[key + "_g"].clone()
        module.parametrizations.weight.original1.data = checkpoint[key + "_v"].clone()
    reference.eval().requires_grad_(False)
    z = latents(12)
    expected = reference.decode(z)
    assert (loaded.decode(z) - expected).abs().max() < 1e-6
    wav = expected[:, : 9 * HOP]
    assert (loaded.encode(wav) - reference.encode(wav)).abs().max() < 1e-6


# ----------------------------------------------------------------------------------------------- lengths


def test_decode_length_and_range(checkpoint: dict[str, torch.Tensor], loaded: AuKVAE):
    z = latents(7)
    wav = loaded.decode(z)
    assert wav.shape == (1, 7 * HOP) and wav.dtype == torch.float32
    assert 1e-2 < wav.abs().max() < 1.0  # the test weights keep it off the clamp
    # conv_post has no bias: a 100x gain scales the output, which is then clamped (a tanh would never reach 1)
    gain = {**checkpoint, "conv_post.weight_g": checkpoint["conv_post.weight_g"] * 100}
    loud = load_vae(gain, TINY, "cpu").decode(z)
    assert loud.abs().max() == 1.0 and (loud.abs() < 1.0).any()
    torch.testing.assert_close(loud, (wav * 100).clamp(-1.0, 1.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("samples", "frames"), [(10 * HOP, 10), (24_200, 51), (10 * HOP + 1, 10)])
def test_encode_frame_count(loaded: AuKVAE, samples: int, frames: int):
    wav = torch.randn(2, samples, generator=torch.Generator().manual_seed(3)) * 0.1
    z = loaded.encode(wav)
    assert z.shape == (2, frames, TINY.latent_dim)
    assert loaded.encoded_frames(samples) == frames
    assert loaded.valid_frames(samples) == samples // HOP


# ----------------------------------------------------------------------------------------------- tiling


def test_plan_tiles_worked_example():
    assert plan_tiles(1000, 512) == [(0, 512, 0, 503), (450, 512, 503, 953), (488, 512, 953, 1000)]
    assert plan_tiles(1000, 512, 53, 9) == plan_tiles(1000, 512)
    assert plan_tiles(300, 512) == [(0, 300, 0, 300)]
    # the last window shrinks to the smallest bucket holding its frames plus the left context
    assert plan_tiles(600, 512, sizes=(128, 256, 512)) == [(0, 512, 0, 503), (344, 256, 503, 600)]
    with pytest.raises(ConfigError):
        plan_tiles(1000, 60)


def test_plan_tiles_cover_every_frame_once_with_context():
    for frames in range(63, 400, 7):
        plan = plan_tiles(frames, 64, 53, 9, sizes=(32, 64))
        assert [p[2] for p in plan[1:]] == [p[3] for p in plan[:-1]]
        assert plan[0][2] == 0 and plan[-1][3] == frames
        for start, width, emit_start, emit_end in plan:
            assert 0 <= start and start + width <= frames and emit_start < emit_end
            assert start == 0 or emit_start - start >= 53
            assert start + width == frames or start + width - emit_end >= 9


def test_receptive_field_of_the_release_geometry():
    assert decoder_context(VAEConfig()) == (52, 7)  # inside the published tiling context (53, 9)
    assert random_vae().receptive_field() == (52, 7)  # channel counts do not matter


def test_tiled_decode_equals_whole_decode(loaded: AuKVAE):
    z = latents(150, seed=4)
    whole = loaded.decode(z)
    assert len(plan_tiles(150, 96)) == 3
    assert (loaded.decode_tiled(z, tile_frames=96) - whole).abs().max() < 1e-5  # published context 53 / 9
    left, right = loaded.receptive_field()
    assert len(plan_tiles(150, 72, left, right)) > 5
    assert (loaded.decode_tiled(z, tile_frames=72, left=left, right=right) - whole).abs().max() < 1e-5
    # too little context shows at the seams
    assert (loaded.decode_tiled(z, tile_frames=72, left=8, right=1) - whole).abs().max() > 1e-4


# ----------------------------------------------------------------------------------------------- causality


def test_last_frame_reaches_back_only_the_right_context(loaded: AuKVAE):
    n = 30
    z = latents(n, seed=5)
    changed = z.clone()
    changed[:, -1] += 1.0
    diff = (loaded.decode(changed) - loaded.decode(z)).abs()[0]
    _, right = loaded.receptive_field()
    untouched = (n - 1 - right) * HOP
    assert torch.equal(diff[:untouched], torch.zeros(untouched))
    assert diff[untouched : (n - 1) * HOP].max() > 0  # the decoder does look ahead


def test_conv_pre_is_centred(loaded: AuKVAE):
    x = torch.randn(1, TINY.latent_dim, 20)
    bumped = x.clone()
    bumped[..., 10] += 1.0
    diff = (loaded.conv_pre(bumped) - loaded.conv_pre(x)).abs().amax(dim=1)[0]
    assert torch.nonzero(diff).flatten().tolist() == list(range(7, 14))  # frames 10 - 3 ... 10 + 3


# ----------------------------------------------------------------------------------------------- latents


def test_posterior_sampling_uses_the_generator_only(loaded: AuKVAE):
    wav = torch.randn(1, 8 * HOP, generator=torch.Generator().manual_seed(6)) * 0.1
    state = torch.get_rng_state()
    first = loaded.encode(wav, sample=True, generator=torch.Generator().manual_seed(7))
    again = loaded.encode(wav, sample=True, generator=torch.Generator().manual_seed(7))
    other = loaded.encode(wav, sample=True, generator=torch.Generator().manual_seed(8))
    mean = loaded.encode(wav)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    assert not torch.allclose(first, mean)
    assert torch.equal(mean, loaded.encode(wav))


def test_normalisation_uses_the_square_root_of_global_log_std(checkpoint: dict[str, torch.Tensor]):
    mean = torch.linspace(-1.0, 1.0, TINY.latent_dim)
    log_std = torch.linspace(0.25, 4.0, TINY.latent_dim)
    model = load_vae({**checkpoint, "global_mean": mean, "global_log_std": log_std}, TINY, "cpu")
    wav = torch.randn(1, 6 * HOP, generator=torch.Generator().manual_seed(9)) * 0.1
    raw = model.audio_encoder(wav[:, None]).chunk(2, dim=1)[0].transpose(1, 2)  # [1, n, d] posterior mean
    torch.testing.assert_close(model.encode(wav), (raw - mean) / log_std.sqrt())
    identity = load_vae({**checkpoint, "global_mean": torch.zeros(64), "global_log_std": torch.ones(64)}, TINY, "cpu")
    z = latents(5)
    torch.testing.assert_close(model.decode(z), identity.decode(z * log_std.sqrt() + mean))


@pytest.mark.parametrize("samples", [481, 960, 1500, 2399, 4800])
def test_a_zero_padded_clip_with_its_length_encodes_like_the_clip_alone(loaded: AuKVAE, samples: int):
    """The fixed-shape encode (padded to a bucket, every conv output cut to the clip's own lengths) that the GPU
    replays from graphs: its first n frames are the unpadded encode, with the cuts over whole rows and over only
    the rows' ends that the bound on the padding leaves (the bound exact, and a bucket's). The input is left as
    it was."""
    wav = torch.randn(1, samples, generator=torch.Generator().manual_seed(samples))
    bucket = 4800 + 960  # longer than every clip here
    with torch.no_grad():
        alone = loaded.audio_encoder(wav[:, None, :])  # [1, 2d, n]
        padded = torch.nn.functional.pad(wav, (0, bucket - samples))
        # Noise in the padding proves the padding is never read as signal.
        padded[:, samples:] = torch.randn(bucket - samples, generator=torch.Generator().manual_seed(1))
        before = padded.clone()
        n = loaded.encoded_frames(samples)
        assert alone.shape[-1] == n
        for padding in (None, bucket - samples, bucket):
            fixed = loaded.audio_encoder(padded[:, None, :], torch.tensor([samples]), padding)
            torch.testing.assert_close(fixed[..., :n], alone, rtol=0, atol=1e-5)
            assert fixed[..., n:].abs().max() == 0, padding  # past the clip's frames only zeros
    assert torch.equal(padded, before)
    latents = loaded.latents(fixed[..., :n])
    torch.testing.assert_close(latents, loaded.encode(wav), rtol=0, atol=1e-5)
