import math

import pytest
import torch

from icekv.attention import causal_attention, decode_attention, decode_attention_chunks


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


def test_queries_that_are_not_the_last_positions_see_only_their_prefix():
    """The general mask (a batch row whose queries end before the keys do), beside the prompt
    chunk's lower-right form above."""
    torch.manual_seed(1)
    q = torch.randn(4, 9, 16)
    k, v = torch.randn(3, 30, 16), torch.randn(3, 30, 16)
    for pos in (torch.tensor([3, 8, 9, 20]), torch.arange(10, 14)):
        torch.testing.assert_close(causal_attention(q, k, v, pos), naive(q, k, v, pos), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cuts", [[], [1], [5, 6], [3, 17, 30]])
def test_decode_attention_over_chunks_equals_one_piece(cuts):
    g = torch.Generator().manual_seed(len(cuts))
    q, k, v = torch.randn(9, 16, generator=g), torch.randn(3, 40, 16, generator=g), torch.randn(3, 40, 16, generator=g)
    bounds = [0, *cuts, 40]
    chunks = [(k[:, a:b], v[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    torch.testing.assert_close(decode_attention_chunks(q, chunks), decode_attention(q, k, v))
