"""Sparse paged attention against a plain softmax over exactly the attended tokens."""

import math

import numpy as np
import pytest
import torch

from icekv.attention import sparse_paged_attention
from icekv.config.paging import KV_DTYPES
from icekv.kv.quant import KVFormat


def reference(q, sink_k, sink_v, page_k, page_v, page_len, win_k, win_v):
    hq, hkv = q.shape[0], sink_k.shape[0]
    out = torch.empty_like(q)
    for h in range(hq):
        kv = h // (hq // hkv)
        ks = [sink_k[kv]] + [page_k[kv, j, : page_len[kv, j]] for j in range(page_k.shape[1])] + [win_k[kv]]
        vs = [sink_v[kv]] + [page_v[kv, j, : page_len[kv, j]] for j in range(page_v.shape[1])] + [win_v[kv]]
        k, v = torch.cat(ks), torch.cat(vs)
        out[h] = torch.softmax(k @ q[h] / math.sqrt(q.shape[-1]), 0) @ v
    return out


@pytest.fixture(params=["torch", "triton", "numba"])
def backend(request, monkeypatch):
    """The reference, the kernel path the engine takes on CUDA (here in triton's interpreter) and
    the compiled CPU one."""
    if request.param == "triton":
        pytest.importorskip("triton", reason="triton is pinned in requirements.txt")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ICEKV_KERNELS", request.param)
    return request.param


@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2), (8, 1)])
@pytest.mark.parametrize("sink,n_pages,win", [(2, 3, 5), (0, 1, 1), (1, 0, 3), (4, 5, 16)])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_matches_reference_over_awkward_shapes(backend, hq, hkv, sink, n_pages, win, head_dim, kv_dtype):
    """Quantized pages are read as stored rows (codes and scales, decoded inside the kernel): the
    reference attends their decoded values, and the sink and window as the pool would hold them."""
    g = torch.Generator().manual_seed(hq * 100 + n_pages)
    p, fmt = 4, KVFormat(kv_dtype)
    rnd = lambda *s: torch.randn(*s, generator=g)
    q = rnd(hq, head_dim)
    page_len = torch.randint(0, p + 1, (hkv, n_pages), generator=g)  # partial and empty pages
    sink_k, sink_v, win_k, win_v = rnd(hkv, sink, head_dim), rnd(hkv, sink, head_dim), rnd(hkv, win, head_dim), rnd(hkv, win, head_dim)
    page_k, page_v = fmt.pack(rnd(hkv, n_pages, p, head_dim)), fmt.pack(rnd(hkv, n_pages, p, head_dim))  # [Hkv, K, P, W]
    got = sparse_paged_attention(q, sink_k, sink_v, page_k, page_v, page_len, win_k, win_v, fmt)
    tail = [fmt.as_stored(t) for t in (sink_k, sink_v, win_k, win_v)]
    want = reference(q, *tail[:2], fmt.unpack(page_k, q.dtype), fmt.unpack(page_v, q.dtype), page_len, *tail[2:])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 1)])
@pytest.mark.parametrize("sink,n_pages,win", [(2, 3, 5), (0, 1, 1), (4, 5, 16)])
def test_bf16_pages_match_the_reference_over_their_values(backend, hq, hkv, sink, n_pages, win):
    """A bf16 cache: queries, pages and tail in bf16 (the compiled kernel widens them as it reads),
    against plain attention in fp32 over the same bf16 values; the result is bf16."""
    if backend == "triton":
        pytest.skip("triton's interpreter runs on numpy, which has no bf16 (the GPU check runs the kernel in bf16)")
    g = torch.Generator().manual_seed(hq + 10 * n_pages)
    rnd = lambda *s: torch.randn(*s, generator=g).bfloat16()
    q, page_k, page_v = rnd(hq, 64), rnd(hkv, n_pages, 4, 64), rnd(hkv, n_pages, 4, 64)
    page_len = torch.randint(0, 5, (hkv, n_pages), generator=g)
    tail = [rnd(hkv, n, 64) for n in (sink, sink, win, win)]
    got = sparse_paged_attention(q, *tail[:2], page_k, page_v, page_len, *tail[2:])
    want = reference(q.float(), *(t.float() for t in tail[:2]), page_k.float(), page_v.float(), page_len,
                     *(t.float() for t in tail[2:]))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # the output rounded to bf16


def test_garbage_in_unattended_slots_is_ignored(backend):
    q = torch.randn(2, 16)
    page_k = torch.randn(1, 2, 4, 16)
    page_v = torch.randn(1, 2, 4, 16)
    lens = torch.tensor([[2, 0]])
    sink = torch.randn(1, 1, 16)
    a = sparse_paged_attention(q, sink, sink, page_k, page_v, lens, sink, sink)
    page_k[0, 0, 2:], page_k[0, 1] = 1e4, 1e4
    page_v[0, 0, 2:], page_v[0, 1] = 1e4, -1e4  # stale data from earlier steps
    b = sparse_paged_attention(q, sink, sink, page_k, page_v, lens, sink, sink)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("sink,win_start,length", [(4, 9, 13), (0, 5, 6), (8, 8, 8), (3, 16, 23)])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_tail_read_from_pool_equals_the_tail_as_tensors(sink, win_start, length, kv_dtype):
    """The decode loop's CPU path reads sink and window by position straight from the request's
    pages (scattered, partial) in the pool: same output as the reference over copies of them."""
    from icekv.config.paging import PagingConfig
    from icekv.kernels.cpu_decode import sparse_decode_pool_cpu
    from icekv.kv import PagedKVCache

    g = torch.Generator().manual_seed(length)
    hq, hkv, d, p = 6, 2, 16, 4
    fmt = KVFormat(kv_dtype)
    cache = PagedKVCache(2, hkv, d, PagingConfig(page_size=p, pool_tokens=128), kv_format=fmt)
    cache.add(0), cache.add(1)
    for n in (5, 3, 9, 4, 7, 7):  # interleaved growth: the pages of request 0 are not consecutive
        for seq in (0, 1):
            start = cache.extend(seq, n)
            cache.write(1, seq, start, torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g))
    cache.truncate(0, length)
    q = torch.randn(hq, d, generator=g)
    page_k, page_v = fmt.pack(torch.randn(2, hkv, 3, p, d, generator=g))  # [Hkv, K, P, W] each
    page_len = torch.tensor([[4, 0, 2], [1, 3, 4]])
    sink_k, sink_v = cache.gather_range(1, 0, 0, sink)  # values, decoded
    win_k, win_v = cache.gather_range(1, 0, win_start, length)
    tail = np.array([[0, sink], [win_start, length]])
    got = sparse_decode_pool_cpu(q, cache.pool[1], cache.page_ids(0), tail, page_k, page_v, page_len, fmt)
    pages = fmt.unpack(page_k, q.dtype), fmt.unpack(page_v, q.dtype)
    torch.testing.assert_close(got, reference(q, sink_k, sink_v, *pages, page_len, win_k, win_v), rtol=1e-5, atol=1e-5)
