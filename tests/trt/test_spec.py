"""The plugins' shape and launch logic as plain functions, and the TensorRT paths where it exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from icekv.policies import resolve
from icekv.config.paging import PagingConfig
from icekv.config.selection import SelectionConfig
from icekv.kernels import launch
from icekv.model import ModelArgs
from icekv.trt.build import tensorrt_unavailable
from icekv.trt.spec import (
    DecodeStepSpec,
    attention_output_shapes,
    plugin_grid,
    select_output_shapes,
)
from tests.test_cli import refused

LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)


def test_spec_from_plan_follows_budget_and_context():
    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=4096, intermediate_size=1,
                     num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                     rope_theta=5e5, rope_scaling=None, max_position_embeddings=131072,
                     tie_word_embeddings=False, qkv_bias=False, qk_norm=False, eos_token_ids=(0,))
    plan = resolve(SelectionConfig(policy="icecache", budget=256))
    spec = DecodeStepSpec.from_plan(plan, PagingConfig(pool_tokens=131072), args)
    assert spec.group == 4 and spec.max_slots == 16 and spec.max_candidates == 8192
    assert spec.top_k == plan.selected_pages  # sink and window pages are not selected
    assert set(spec.kernel_specs()) == {"page_select", "sparse_paged_attention", "page_scatter"}
    assert spec.kernel_specs()["sparse_paged_attention"].constexprs["NUM_SPLITS"] == 1


@pytest.mark.parametrize("bad,match", [
    (dict(num_heads=30), "multiple"), (dict(head_dim=96), "power of two"), (dict(dtype="int8"), "dtype"),
    (dict(max_candidates=launch.MAX_CANDIDATES + 1), "candidate"), (dict(top_k=0), "top_k"),
])
def test_spec_rejects_what_the_kernels_cannot_run(bad, match):
    with pytest.raises(ValueError, match=match):
        DecodeStepSpec(**{**LLAMA_8B, "page_size": 16, "top_k": 12, "max_candidates": 2048, "max_slots": 16, **bad})


def test_plugin_shapes_and_grid():
    assert attention_output_shapes((4, 32, 128)) == ((4, 32, 128), (4, 32))
    assert select_output_shapes((4, 32, 128), (8, 900, 16, 128), (4, 8, 700), 12) == ((4, 8, 12), (4, 8, 12), (4, 8, 700))
    assert plugin_grid(4, 8) == (32, 1, 1)
    launch.check_page_shapes((4, 32, 128), (8, 100, 16, 128), (4, 8, 16), (4, 8, 16))
    with pytest.raises(ValueError, match="multiple"):
        launch.check_page_shapes((4, 30, 128), (8, 100, 16, 128), (4, 8, 16), (4, 8, 16))
    with pytest.raises(ValueError, match="Hkv=8"):
        launch.check_page_shapes((4, 32, 128), (8, 100, 16, 128), (4, 4, 16), (4, 4, 16))


def test_decode_launch_fills_the_gpu_without_empty_splits():
    cfg = launch.decode_launch(1, 8, 4, n_pages=16, page_size=16, head_dim=128)
    assert cfg.grid == (8, 16) and cfg.num_splits == 16  # 8 programs alone would idle 124 SMs
    assert launch.decode_launch(1, 8, 4, 3, 16, 128).num_splits == 2  # never a split without a page
    assert launch.decode_launch(64, 8, 4, 16, 16, 128).num_splits == 1  # batch already fills it
    assert launch.decode_launch(1, 8, 4, 16, 16, 128, max_splits=1).grid == (8, 1)
    assert launch.decode_launch(1, 8, 9, 16, 8, 64).block_g == 16 and launch.decode_launch(1, 1, 20, 4, 8, 64).block_g == 32


def test_select_launch_limits():
    cfg = launch.select_launch(2, 8, 4, 8191, 16, 128, pages_per_program=8)
    assert cfg.score_grid == (16, 1024) and cfg.block_c == 8192 and cfg.topk_grid == (16,)
    with pytest.raises(ValueError, match="candidate"):
        launch.select_launch(1, 8, 4, launch.MAX_CANDIDATES + 1, 16, 128)


TRT_REASON = tensorrt_unavailable()


@pytest.mark.trt
@pytest.mark.skipif(TRT_REASON is not None, reason=f"TensorRT is not usable here: {TRT_REASON}")
def test_plugins_register_where_tensorrt_imports():
    from icekv.trt.plugins import register_plugins

    spec = DecodeStepSpec(**LLAMA_8B, page_size=16, top_k=12, max_candidates=2048, max_slots=16)
    assert register_plugins(spec) == ("icekv::page_select", "icekv::sparse_paged_attention")


@pytest.mark.model
def test_build_cli_without_tensorrt(capsys, tmp_path, smollm2_dir):
    """`icekv build --ptx-only` writes the plugins' kernels; a full build names what is missing."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ICEKV_KERNELS")}
    run = lambda *a: subprocess.run([sys.executable, "-m", "icekv.cli", "build", "--out", str(tmp_path), *a],
                                    capture_output=True, text=True, env=env, timeout=600)
    done = run("--ptx-only", "--model", str(smollm2_dir))
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "kernels.json").read_text())
    assert manifest["sparse_paged_attention"]["constexprs"]["GROUP"] == 3  # SmolLM2: 9 / 3 heads
    assert manifest["page_select"]["constexprs"]["BLOCK_C"] == 2048  # 32768 tokens / 16
    build = ("build", "--out", str(tmp_path), "--model", str(smollm2_dir))
    assert "multiple of the page size" in refused(capsys, *build, "--ptx-only", "--budget", "40")
    if TRT_REASON is not None:
        err = refused(capsys, *build)
        assert "--ptx-only" in err and "tensorrt" in err


@pytest.mark.trt
@pytest.mark.gpu
@pytest.mark.skipif(TRT_REASON is not None, reason=f"TensorRT is not usable here: {TRT_REASON}")
def test_engines_build_where_tensorrt_and_a_gpu_exist(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("building a TensorRT engine needs a CUDA device")
    from icekv.trt.build import build_engines

    spec = DecodeStepSpec(**LLAMA_8B, page_size=16, top_k=12, max_candidates=2048, max_slots=16, max_batch=2)
    paths = build_engines(spec, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths.values())


def test_the_split_count_takes_few_values_as_the_pages_grow():
    """NUM_SPLITS is a compile-time constant: a full-attention decode whose pages grow one by one
    must not compile a kernel per page count."""
    splits = [launch.decode_launch(1, 8, 4, n, 16, 128).num_splits for n in range(1, 5000)]
    assert set(splits) == {1, 2, 4, 8, 16, 32}
    assert set(splits[31:]) == {32}  # past 32 pages: one variant for every length
    assert all(s <= n for n, s in enumerate(splits, start=1))  # never a split without a page
