"""The deploy config: the shipped files parse, and every bad field is refused with its path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from auk_worker.deploy import load_deploy_config, parse_deploy_config
from auk_worker.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT.parent / "shared" / "auk-deploy.yaml"


def raw_config() -> dict:
    return yaml.safe_load((ROOT / "config" / "auk.yaml").read_text())


@pytest.mark.parametrize(
    "name, thinker_mode, thinker_rows", [("auk.yaml", 0, 1), ("auk-flash.yaml", 3, 1), ("auk-bulk.yaml", 3, 8)]
)
def test_shipped_configs_parse(name, thinker_mode, thinker_rows):
    config = load_deploy_config(ROOT / "config" / name)
    assert config.encoder.compilation_config.mode == thinker_mode and config.encoder.max_num_seqs == thinker_rows
    assert config.encoder.compilation_config.cudagraph_capture_sizes == (64, 128, 192, 256, 384, 512)
    assert config.dit.model_config.auk_vae_compile_shapes == (160, 320, 640)
    assert config.dit.model_config.max_dit_graphs == 32


def test_values_of_the_specified_config():
    config = load_deploy_config(ROOT / "config" / "auk.yaml")
    assert config.encoder.gpu_memory_utilization == 0.45 and config.dit.gpu_memory_utilization == 0.35
    assert config.defaults.num_inference_steps == 32 and config.defaults.guidance_scale == 2.0
    assert config.defaults.seed == 0
    assert config.encoder.limit_mm_per_prompt == {"audio": 1}
    assert not config.encoder.enforce_eager and not config.dit.enforce_eager


@pytest.mark.skipif(not SPEC.exists(), reason="the specification copy is not beside the project")
def test_project_copy_keeps_every_field_of_the_specified_config():
    spec, ours = yaml.safe_load(SPEC.read_text()), raw_config()
    for key, value in spec.items():
        if key != "stages":
            assert ours[key] == value
    for spec_stage, our_stage in zip(spec["stages"], ours["stages"]):
        for key, value in spec_stage.items():
            assert our_stage[key] == value, key


def mutate(path: list, value) -> dict:
    raw = raw_config()
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return raw


@pytest.mark.parametrize(
    "path, value, message",
    [
        (["enable_prefix_caching"], True, r"enable_prefix_caching: must be false \(a prefix-cache hit"),
        (["enable_chunked_prefill"], True, "enable_chunked_prefill: must be false"),
        (["stages", 1, "model_config", "max_dit_graphs"], "many", r"stages\[1\].model_config.max_dit_graphs: expected an integer"),
        (["stages", 1, "model_config", "auk_vae_compile_shapes"], [320, 160], "auk_vae_compile_shapes: must be increasing"),
        (["stages", 1, "model_config", "bogus"], 1, r"stages\[1\].model_config.bogus: unknown field"),
        (["stages", 0, "gpu_memory_utilization"], 1.5, r"stages\[0\].gpu_memory_utilization: must be in \(0, 1\]"),
        (["stages", 0, "compilation_config", "cudagraph_mode"], "SOMETIMES", "cudagraph_mode: must be one of"),
        (["stages", 0, "compilation_config", "mode"], 4, r"stages\[0\].compilation_config.mode: 0 \(no compilation\)"),
        (["stages", 0, "limit_mm_per_prompt"], {"audio": 2}, "at most one audio clip"),
        (["stages", 1, "default_sampling_params", "num_inference_steps"], 0, "num_inference_steps: must be in"),
        (["stages", 1, "devices"], "gpu0", r"stages\[1\].devices: expected CUDA device indices"),
        (["stages", 1, "enforce_eager"], "yes", "enforce_eager: expected true or false"),
        (["unknown_top"], 1, "unknown_top: unknown field"),
    ],
)
def test_bad_fields_are_named(path, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_deploy_config(mutate(path, value))


def test_shared_device_cannot_be_oversubscribed():
    raw = mutate(["stages", 0, "gpu_memory_utilization"], 0.7)
    with pytest.raises(ConfigError, match="ask for 1.05 > 1"):
        parse_deploy_config(raw)


@pytest.mark.parametrize("field", ["seed", "num_inference_steps", "guidance_scale"])
def test_sampling_defaults_are_stated_in_the_config_or_refused(field):
    """The deploy config is the one home of the defaults: a stage 1 that omits one is refused by name."""
    raw = raw_config()
    del raw["stages"][1]["default_sampling_params"][field]
    with pytest.raises(ConfigError, match=rf"stages\[1\].default_sampling_params.{field}: required field missing"):
        parse_deploy_config(raw)
    del raw["stages"][1]["default_sampling_params"]
    with pytest.raises(ConfigError, match=r"stages\[1\].default_sampling_params: required field missing"):
        parse_deploy_config(raw)


def test_sway_has_the_models_default_and_may_be_stated():
    assert load_deploy_config(ROOT / "config" / "auk.yaml").defaults.sway == -1.0
    assert parse_deploy_config(mutate(["stages", 1, "default_sampling_params", "sway"], -0.5)).defaults.sway == -0.5


@pytest.mark.parametrize("field, value, message", [
    ("guidance_scale", 25.0, r"guidance_scale: must be in \[0, 20\]"),
    ("sway", 0.5, r"sway: must be in \[-1, 0\]"),
    ("seed", -1, r"seed: must be in \[0, 2\^63\) \(an integer\)"),
])
def test_sampling_defaults_keep_the_requests_bounds(field, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_deploy_config(mutate(["stages", 1, "default_sampling_params", field], value))
