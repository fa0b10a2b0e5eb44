import math

import pytest
import torch

from icekv.attention import causal_attention


def naive(q, k, v, pos):
    hq, hkv = q.shape[1], k.shape[0]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        for h in range(hq):
            kh, vh = k[h // (hq // hkv)], v[h // (hq // hkv)]
            s = (kh[: pos[i] + 1] @ q[i, h]) / math.sqrt(q.shape[-1])
            out[i, h] = torch.softmax(s, 0) @ vh[: pos[i] + 1]
    return out


@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("n,length", [(1, 1), (1, 37), (5, 5), (7, 40)])
def test_matches_naive_softmax(hq, hkv, n, length):
    torch.manual_seed(0)
    q = torch.randn(n, hq, 16)
    k, v = torch.randn(hkv, length, 16), torch.randn(hkv, length, 16)
    pos = torch.arange(length - n, length)
    torch.testing.assert_close(causal_attention(q, k, v, pos), naive(q, k, v, pos), rtol=1e-5, atol=1e-5)
