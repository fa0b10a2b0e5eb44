"""Kernel tests run the OpenAI-Triton kernels in triton's CPU interpreter, or natively on a GPU
with ``ICEKV_TEST_DEVICE=cuda`` (bench/gpu_check.sh), where bf16 is tested too."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
NATIVE = os.environ.get("ICEKV_TEST_DEVICE") == "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def kdev(monkeypatch) -> str:
    """The device kernel tests put tensors on, with the triton backend forced (on CPU through the
    interpreter, which tests/conftest.py selects before triton is first imported)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pinned in requirements.txt)")
    monkeypatch.setenv("ICEKV_KERNELS", "triton")
    if NATIVE:
        if not torch.cuda.is_available():
            pytest.fail("ICEKV_TEST_DEVICE=cuda but torch sees no CUDA device")
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


def skip_unsupported(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not NATIVE:
        pytest.skip("bf16 tl.dot is wrong in triton's CPU interpreter; tested natively by bench/gpu_check.sh")
