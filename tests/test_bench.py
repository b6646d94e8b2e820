"""The benchmarks stay honest on the CPU: `python -m bench.pipeline --tiny --device cpu` writes a complete result,
the utilisation counts the right weights, and `bench.throughput --dtype` changes only what it says."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_tiny_pipeline_benchmark_runs(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.pipeline", "--tiny", "--device", "cpu", "--runs", "1", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = tmp_path.glob("pipeline-tiny-cpu-*.json")
    result = json.loads(path.read_text())
    assert set(result["latency"]) == {"base zero-shot", "base instruct", "flash zero-shot"}
    for kind in result["latency"].values():
        for seconds, row in kind.items():
            assert row["samples"] == int(seconds.rstrip("s")) * 24_000
            assert row["wall_s"] > 0 and row["stages_ms"]["dit"] > 0
    assert result["environment"]["torch"]


def test_utilisation_counts_the_weights_a_position_passes():
    """708 M block-linear weights per position at release size, the figure the DiT's compute limit is quoted with
    (a double block's text-stream twins are passed by text positions only, so they do not count twice)."""
    import torch

    from auk_worker.model.dit import AuKDiT, DiTConfig
    from bench.models import RELEASE_ARCH, position_weights

    with torch.device("meta"):
        dit = AuKDiT(DiTConfig.from_arch(RELEASE_ARCH, latent_dim=64))
    dim, inner = 1536, 3072
    per_block = dim * 3 * dim + dim * dim + dim * 2 * inner + inner * dim
    assert position_weights(dit) == 30 * per_block
    assert round(position_weights(dit) / 1e6) == 708


def test_throughput_dtype_option_rewrites_only_stage_one_dtype(tmp_path):
    """``bench.throughput --dtype float8`` serves a copy of the deploy config that differs in that field alone."""
    from auk_worker.deploy import load_deploy_config
    from auk_dev.local import REPO
    from bench.throughput import with_dit_dtype

    source = REPO / "config" / "auk-bulk.yaml"
    original = load_deploy_config(source)
    copy = load_deploy_config(with_dit_dtype(source, "float8", tmp_path / "bulk.yaml"))
    assert original.dit.dtype == "auto" and copy.dit.dtype == "float8"
    assert copy.encoder == original.encoder
    assert dataclasses.replace(copy.dit, dtype="auto") == original.dit


def test_results_name_a_changed_checkout_dirty(tmp_path, monkeypatch):
    """A result names the commit it measured: HEAD, or HEAD-dirty when tracked files differ from it."""
    from bench.common import commit

    monkeypatch.delenv("AUK_COMMIT", raising=False)
    git = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = git("rev-parse", "--short", "HEAD").stdout.strip()
    assert commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert commit(tmp_path) == f"{head}-dirty"
    monkeypatch.setenv("AUK_COMMIT", "abc1234")
    assert commit(tmp_path) == "abc1234"
    assert commit(tmp_path / "missing") == "abc1234"
    monkeypatch.delenv("AUK_COMMIT")
    assert commit(tmp_path.parent / "not-a-checkout-here") == "unknown"


def test_kernel_kinds_sort_the_names_a_dit_step_profile_shows():
    from bench.common import kind

    products = "matrix products and convolutions"
    assert kind("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN") == products
    assert kind("sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc") == products
    assert kind("void cudnn::cnn::dgrad2d_grouped_direct_kernel<float, int, float, float>") == products
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"
    assert kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>") == "attention"
    assert kind("_varlen_attention_kernel") == "attention"
    hand_written = ("_attention_inputs_kernel", "_modulated_norm_kernel", "_alias_free_kernel",
                    "_position_conv_kernel", "_causal_conv_kernel", "_overlap_add_kernel", "alias_free_activation")
    assert [kind(name) for name in hand_written] == ["hand-written"] * 7
    assert kind("triton_red_fused_add_mul_native_layer_norm_split_unsqueeze_0") == "inductor"
    assert kind("triton_poi_fused__scaled_dot_product_cudnn_attention_cat_slice_transpose_view_2") == "inductor"
    assert kind("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast") == "other"
