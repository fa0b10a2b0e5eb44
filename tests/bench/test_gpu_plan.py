"""The real GPU run's admission and memory plan (bench/gpu_check.sh at Llama-3.1-8B's shape, bf16,
32k, 128k and 8 x 32k), computed on the CPU with the engine's own sizing: every part's every
(policy, context, batch) is admitted in one wave, and each engine's peak host and device memory fits
each kind of lent machine (128 GiB host; an H100's or an H200's device memory)."""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from icekv.cli import main as icekv

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("gpu_parts", BENCH / "gpu_parts.py")
gpu_parts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_parts)


def _plan(name: str, capsys, device_gib: float = min(gpu_parts.DEVICE_GIB.values())) -> dict:
    rc = icekv(gpu_parts.plan_args(name, device_gib))
    out, err = capsys.readouterr()
    assert rc == 0, err  # refusals name their numbers
    return json.loads(out.splitlines()[0])["plan"]


@pytest.mark.parametrize("kind", list(gpu_parts.DEVICE_GIB))
@pytest.mark.parametrize("name", list(gpu_parts.PARTS))
def test_every_part_of_the_real_run_is_admitted_in_one_wave_and_fits_the_machine(name, kind, capsys):
    plan = _plan(name, capsys, gpu_parts.DEVICE_GIB[kind])
    assert plan["admitted"] and plan["waves"]
    for wave in plan["waves"]:
        assert wave["refusals"] == [] and wave["index_share"] < 1  # the index never outweighs the KV
    for group in plan["groups"]:
        assert group["host_bytes"] <= gpu_parts.HOST_GIB * 2**30
        assert group["device_bytes"] <= gpu_parts.DEVICE_GIB[kind] * 2**30


def test_the_batch_of_eight_runs_as_one_wave_with_its_limits_sized_for_it(capsys):
    plan = _plan("batch_32k", capsys)
    eight = [w for w in plan["waves"] if w["batch"] == 8]
    assert {w["policy"] for w in eight} == {"full", "icecache"}
    assert plan["scheduler"]["max_active_requests"] == 8
    assert plan["paging"]["pool_tokens"] >= 8 * (32768 + 16)  # every request's pages at once
    ice = next(w for w in eight if w["policy"] == "icecache")
    assert ice["device_charge"] <= plan["scheduler"]["max_device_bytes"]


def test_wide_page_keys_over_a_bf16_cache_are_refused_before_anything_loads(capsys):
    rc = icekv([*gpu_parts.plan_args("batch_32k"), "--score-dtype", "float32"])
    assert rc == 2 and "index outweighs the KV" in capsys.readouterr().err


def test_the_check_refuses_an_interpreter_without_torch_before_running_anything(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "/bin/false", "GPU_CHECK_DIR": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "/bin/false cannot import torch" in done.stderr and "PYTHON" in done.stderr
    assert not (tmp_path / "out").exists()  # refused before any part wrote anything
