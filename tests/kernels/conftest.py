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
# a layer's index searched with KV heads of these sizes, query heads per KV head, candidates per
# query head and k pages
SEARCH_SHAPES = [
    ([700, 90, 0], 3, 10, 4),  # uneven heads, one empty
    ([1, 5, 17], 1, 8, 3),  # one-token and partial pages, one query head per KV head
    ([400, 400], 4, 96, 12),  # candidates above the pages: every page exact
    ([300, 200], 3, 6, 40),  # k above the candidates' union
]


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


@pytest.fixture(params=["torch", "triton"])
def backend_device(request, monkeypatch) -> str:
    """The device a test of a kernel's caller runs on, once through the plain-torch references and
    once through the Triton kernels (``kdev``)."""
    if request.param == "torch":
        monkeypatch.setenv("ICEKV_KERNELS", "torch")
        return "cuda" if NATIVE else "cpu"
    return request.getfixturevalue("kdev")


def index_layer(sizes: list[int], d: int = 32, seed: int = 2, dtype: torch.dtype = torch.float32):
    """A layer's page store and its DCI trees, one per KV head of ``sizes[h]`` random keys."""
    from icekv.methods.icecache import IceCacheConfig
    from icekv.index import DCITree, PageStore

    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d + 1, generator=g)
    store = PageStore(len(sizes), 16, d, dtype)
    cfg = IceCacheConfig(score_dtype=str(dtype).removeprefix("torch."))
    trees = [DCITree(torch.randn(n, d, generator=g) * 2, 16, cfg, u / u.norm(), store, h) for h, n in enumerate(sizes)]
    return store, trees


def skip_unsupported(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not NATIVE:
        pytest.skip("bf16 tl.dot is wrong in triton's CPU interpreter; tested natively by bench/gpu_check.sh")
