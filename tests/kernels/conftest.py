"""Kernel tests run the OpenAI-Triton kernels in triton's CPU interpreter."""

from __future__ import annotations

import importlib.util

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def interpret(monkeypatch):
    """Force the triton backend on CPU tensors: the interpreter is chosen when a kernel module
    first decorates its kernels, which happens inside the test, after this variable is set."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pinned in requirements.txt)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ICEKV_KERNELS", "triton")
