"""Ahead-of-time compilation of every kernel to PTX for sm_90, on this CPU-only machine.

Compiled in a fresh interpreter without TRITON_INTERPRET (kernels loaded by the interpreter
tests in this process have no compiler form)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.kernels.conftest import HAS_TRITON, NATIVE

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pinned in requirements.txt)")

COMPILE_ALL = r"""
import json, sys, torch
from icekv.kernels import aot
specs = {}
for dt in (torch.float16, torch.bfloat16, torch.float32):
    name = str(dt).split(".")[1]
    specs[f"decode_{name}_g4_d128"] = aot.decode_spec(dt, 8, 4, 128, 16)
    specs[f"decode_split8_{name}"] = aot.decode_spec(dt, 8, 4, 128, 16, num_splits=8)
    specs[f"merge8_{name}"] = aot.merge_spec(dt, 128, 8)
    specs[f"select_{name}"] = aot.select_spec(dt, 8, 4, 128, 16, 8192)
    specs[f"scatter_{name}"] = aot.scatter_spec(dt, 16, 128)
specs["decode_g3_d64_p8"] = aot.decode_spec(torch.float16, 3, 3, 64, 8)
compiled = {k: aot.compile_kernel(s) for k, s in specs.items()}
aot.write_artifacts(compiled, sys.argv[1])
"""


def no_interpreter_env():
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ICEKV_KERNELS")}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("ptx")
    subprocess.run([sys.executable, "-c", COMPILE_ALL, str(out)], check=True, env=no_interpreter_env(), timeout=600)
    return out, json.loads((out / "kernels.json").read_text())


def test_every_kernel_compiles_to_sm90_ptx(artifacts):
    out, manifest = artifacts
    assert len(manifest) == 16
    for key, meta in manifest.items():
        ptx = (out / f"{key}.ptx").read_text()
        assert re.search(r"^\.target sm_90a?$", ptx, re.M), key
        assert f".visible .entry {meta['name']}(" in ptx, key
        assert meta["arch"] == 90
        # launch facts the host must honour match what the PTX itself declares
        assert re.search(rf"\.reqntid {meta['threads_per_block']}\b", ptx), key
        assert meta["threads_per_block"] == 32 * meta["num_warps"]
        assert meta["shared_mem"] >= 0
        # TensorRT passes exactly the signature's arguments; triton's trailing scratch pointers
        # are safe to leave unset only because no kernel asks for scratch memory
        assert meta["ptx_params"] >= len(meta["signature"]) and meta["scratch_bytes"] == 0, key


def test_specialisation_reaches_the_ptx(artifacts):
    """Dtypes and constexprs are really compiled in: fp16 and bf16 kernels differ, MMA is used."""
    out, manifest = artifacts
    fp16 = (out / "decode_float16_g4_d128.ptx").read_text()
    bf16 = (out / "decode_bfloat16_g4_d128.ptx").read_text()
    assert fp16 != bf16
    assert "mma" in fp16 or "wgmma" in fp16
    assert manifest["decode_float16_g4_d128"]["signature"]["out_ptr"] == "*fp16"
    assert manifest["decode_split8_float16"]["signature"]["out_ptr"] == "*fp32"  # fp32 partials
    assert manifest["select_float16"]["constexprs"]["BLOCK_C"] == 8192
    assert manifest["decode_g3_d64_p8"]["constexprs"]["BLOCK_P"] == 16  # pages < 16 padded for tl.dot


@pytest.mark.skipif(NATIVE, reason="on a GPU the kernels load compiled, not interpreted")
def test_interpreted_kernels_refuse_aot(kdev):
    import torch

    from icekv.kernels import aot, sparse_decode_attention

    q = torch.zeros(1, 2, 64)
    pages = torch.zeros(1, 1, 16, 64)
    ids = torch.zeros(1, 1, 1, dtype=torch.int32)
    sparse_decode_attention(q, pages, pages, ids, ids)  # loads the kernel module interpreted
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        aot.compile_kernel(aot.decode_spec(torch.float16, 1, 2, 64, 16))
