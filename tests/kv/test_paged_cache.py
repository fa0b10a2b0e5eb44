import pytest
import torch

from icekv.config.paging import PagingConfig
from icekv.errors import CacheFullError
from icekv.kv import PagedKVCache
from icekv.kv.token_rows import gather_tokens_reference


def _cache(max_tokens=128, page=16):
    return PagedKVCache(2, 3, 8, PagingConfig(page_size=page, pool_tokens=max_tokens))


@pytest.mark.parametrize("chunks", [[1], [16], [5, 11, 1, 20], [33, 1, 1]])
def test_write_then_gather_returns_tokens_in_order(chunks):
    cache = _cache()
    cache.add(0)
    cache.add(1)  # an interleaved second sequence must not disturb the first
    ks, vs = [], []
    for n in chunks:
        start = cache.extend(0, n)
        k, v = torch.randn(n, 3, 8), torch.randn(n, 3, 8)
        cache.write(1, 0, start, k, v)
        s1 = cache.extend(1, 2)
        cache.write(1, 1, s1, torch.zeros(2, 3, 8), torch.zeros(2, 3, 8))
        ks.append(k)
        vs.append(v)
    keys, values = cache.gather(1, 0)  # [Hkv, L, D]
    assert keys.shape == (3, sum(chunks), 8)
    torch.testing.assert_close(keys, torch.cat(ks).transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat(vs).transpose(0, 1), rtol=0, atol=0)
    table = cache.page_table([0, 1])
    assert table.seq_len(0) == sum(chunks)
    assert set(table.pages(0).tolist()).isdisjoint(table.pages(1).tolist())


def test_full_pool_is_refused_and_free_returns_pages():
    cache = _cache(max_tokens=32)
    cache.add(0)
    cache.extend(0, 32)
    cache.add(1)
    with pytest.raises(CacheFullError, match="KV cache full"):
        cache.extend(1, 1)
    cache.free(0)
    cache.extend(1, 17)
    assert cache.sequence_bytes(1) == 2 * cache.bytes_per_page
    assert cache.bytes_per_page == 2 * 2 * 3 * 16 * 8 * 4  # layers * (K,V) * heads * P * D * fp32


def test_view_range_equals_gather_and_shares_memory_only_when_pages_are_consecutive():
    cache = _cache(max_tokens=256)
    cache.add(0)
    cache.add(1)
    k = torch.randn(70, 3, 8)
    cache.write(0, 0, cache.extend(0, 40), k[:40], -k[:40])  # pages 0..2: consecutive
    cache.write(0, 1, cache.extend(1, 20), k[:20], k[:20])  # sequence 1 takes pages 3..4
    cache.write(0, 0, cache.extend(0, 30), k[40:], -k[40:])  # sequence 0 continues on pages 5..
    for start, end in [(0, 40), (3, 45), (20, 70), (0, 70), (47, 48), (10, 10)]:
        view_k, view_v = cache.view_range(0, 0, start, end)
        want_k, want_v = cache.gather_range(0, 0, start, end)
        assert torch.equal(view_k, want_k) and torch.equal(view_v, want_v)
    shares = lambda t: t.untyped_storage().data_ptr() == cache.pool.untyped_storage().data_ptr()
    assert shares(cache.view_range(0, 0, 3, 45)[0])  # pages 0..2 are consecutive ids: no copy
    assert not shares(cache.view_range(0, 0, 20, 70)[0])  # crosses from page 2 to page 5: gathered
    runs = cache.view_runs(0, 0, 20, 70)  # ... or read in place as two runs
    assert [r[0].shape[1] for r in runs] == [28, 22] and all(shares(k) for k, _ in runs)
    torch.testing.assert_close(torch.cat([k for k, _ in runs], 1), cache.gather_range(0, 0, 20, 70)[0])
    assert cache.view_runs(0, 0, 5, 5) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [16, 1])
def test_gather_tokens_copies_the_asked_rows_like_the_reference(dtype, page):
    cache = PagedKVCache(2, 3, 8, PagingConfig(page_size=page, pool_tokens=128), dtype)
    for seq in (0, 1):  # interleaved sequences: a request's pages are not consecutive ids
        cache.add(seq)
    k, v = torch.randn(40, 3, 8, dtype=dtype), torch.randn(40, 3, 8, dtype=dtype)
    for start in range(0, 40, 5):
        cache.write(1, 0, cache.extend(0, 5), k[start : start + 5], v[start : start + 5])
        cache.extend(1, 3)
    heads = torch.tensor([2, 0, 0, 1])  # [n] repeated and uneven heads
    positions = torch.tensor([[0, 39, -1], [7, -1, -1], [-1, -1, -1], [16, 15, 17]])  # [n, 3] holes, an empty row
    got = cache.gather_tokens(1, 0, heads, positions)  # [2, n, 3, D]
    want = gather_tokens_reference(cache.pool[1], cache._seqs[0].ids(), heads, positions)
    assert got.dtype == dtype and got.shape == (2, 4, 3, 8)
    assert torch.equal(got, want)
    valid = positions >= 0
    expect_k = k[positions.clamp_min(0), heads[:, None].expand_as(positions)]  # [n, 3, D]
    assert torch.equal(got[0][valid], expect_k[valid]) and not got[:, ~valid].any()
    assert cache.gather_tokens(1, 0, heads[:0], positions[:0]).shape == (2, 0, 3, 8)
