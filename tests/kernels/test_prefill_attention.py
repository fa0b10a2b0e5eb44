"""A prompt chunk's attention (the last N of L positions, GQA) against a plain softmax, on the CPU
and, under ICEKV_TEST_DEVICE=cuda, on the GPU in bf16 (the lower-right causal form flash attention
takes)."""

import pytest
import torch

from icekv.attention import causal_attention
from tests.kernels.conftest import NATIVE


def _reference(q, k, v, positions):
    """fp32 softmax of each query over keys 0 .. its position."""
    hkv, length, d = k.shape
    qg = q.float().view(q.shape[0], hkv, -1, d)  # [N, Hkv, G, D]
    scores = torch.einsum("nhgd,htd->nhgt", qg, k.float()) * d**-0.5
    visible = torch.arange(length) <= positions[:, None]  # [N, L]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.einsum("nhgt,htd->nhgd", scores.softmax(-1), v.float()).reshape(q.shape)


@pytest.mark.parametrize("n, length", [(1, 40), (7, 7), (64, 300), (200, 1000)])
@pytest.mark.parametrize("device, dtype, tol", [("cpu", torch.float32, 1e-5)]
                         + ([("cuda", torch.bfloat16, 3e-2)] if NATIVE else []))
def test_a_prompt_chunk_sees_its_prefix(n, length, device, dtype, tol):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(n, 32, 128, generator=g)
    k, v = torch.randn(8, length, 128, generator=g), torch.randn(8, length, 128, generator=g)
    positions = torch.arange(length - n, length)
    out = causal_attention(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), positions)
    torch.testing.assert_close(out.float().cpu(), _reference(q, k, v, positions), rtol=tol, atol=tol)
