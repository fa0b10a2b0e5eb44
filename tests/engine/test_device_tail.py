"""The sink and window kept on the compute device equal what the pool holds, step after step, and
attending them gives what reading them in place from the pool gives."""

import pytest
import torch

from icekv.config.paging import PagingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine.backends import RequestPages
from icekv.engine.backends.tail import DeviceTail, PoolTail
from icekv.kv import DevicePageCache, PagedKVCache
from icekv.kv.quant import KVFormat
from icekv.policies import resolve


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_appending_and_advancing_keeps_the_window_the_pool_holds(kv_dtype):
    """Each step the device tail's views equal the pool's tokens, and attention over the device
    tail and some slots equals the same attention reading the tail in place (partial pages: the
    window crosses page flushes; GQA: 4 query heads on 2 KV heads)."""
    plan = resolve(SelectionConfig(policy="icecache", budget=64))
    fmt = KVFormat(kv_dtype)
    cache = PagedKVCache(1, 2, 8, PagingConfig(16, 1024), kv_format=fmt)
    cache.add(0)
    source = RequestPages(cache, 0)
    g = torch.Generator().manual_seed(0)
    cache.extend(0, 50)
    cache.write(0, 0, 0, torch.randn(50, 2, 8, generator=g), torch.randn(50, 2, 8, generator=g))
    sink_end = plan.sink_tokens
    start = plan.window_start(sink_end, 50)
    tail = DeviceTail(*source.sink_window(0, sink_end, start, 50), start, plan.window_tokens, fmt)
    in_place = PoolTail(source, 0, sink_end, start, 50)
    slots = DevicePageCache(2, 2, 16, cache.pool.shape[-1], cache.pool.dtype)
    picked = torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([0, 0])  # heads, pages, versions
    slots.fill_from_pool(*picked, torch.arange(16, 32).repeat(2, 1), cache.pool[0], cache.page_ids(0))
    for position in range(50, 120):  # crosses several page flushes
        cache.extend(0, 1)
        k, v = torch.randn(1, 2, 8, generator=g), torch.randn(1, 2, 8, generator=g)
        cache.write(0, 0, position, k, v)
        tail.append(position, k[0], v[0])
        in_place.append(position, k[0], v[0])
        for got, want in zip(tail.views(), source.sink_window(0, sink_end, start, position + 1)):
            assert torch.equal(got, want)
        q = torch.randn(4, 8, generator=g)  # [Hq, D]
        torch.testing.assert_close(tail.attend(q, slots), in_place.attend(q, slots), rtol=1e-5, atol=1e-5)
        start = plan.window_start(sink_end, position + 1)
        tail.advance(start)
        in_place.advance(start)
    assert tail.win_start == start and tail.n == 120 - start


def test_a_token_out_of_order_is_refused():
    kv = torch.zeros(2, 4, 8)
    tail = DeviceTail(kv, kv, kv, kv, win_start=16, capacity=8)
    with pytest.raises(RuntimeError, match="position 21 does not follow 19"):
        tail.append(21, torch.zeros(2, 8), torch.zeros(2, 8))
