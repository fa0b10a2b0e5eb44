"""The sink and window kept on the compute device equal what the pool holds, step after step."""

import pytest
import torch

from icekv.config import PagingConfig, SelectionConfig
from icekv.engine.backends import RequestPages
from icekv.engine.backends.tail import DeviceTail
from icekv.kv import PagedKVCache
from icekv.policies import sink_tokens, window_start


def test_appending_and_advancing_keeps_the_window_the_pool_holds():
    cfg = SelectionConfig(policy="icecache", budget=64)
    cache = PagedKVCache(1, 2, 8, PagingConfig(16, 1024))
    cache.add(0)
    source = RequestPages(cache, 0)
    g = torch.Generator().manual_seed(0)
    cache.extend(0, 50)
    cache.write(0, 0, 0, torch.randn(50, 2, 8, generator=g), torch.randn(50, 2, 8, generator=g))
    sink_end = sink_tokens(cfg)
    start = window_start(cfg, sink_end, 50)
    tail = DeviceTail(*source.sink_window(0, sink_end, start, 50), start, (cfg.n_win_pages + 1) * cfg.page_size)
    for position in range(50, 120):  # crosses several page flushes
        cache.extend(0, 1)
        k, v = torch.randn(1, 2, 8, generator=g), torch.randn(1, 2, 8, generator=g)
        cache.write(0, 0, position, k, v)
        tail.append(position, k[0], v[0])
        for got, want in zip(tail.views(), source.sink_window(0, sink_end, start, position + 1)):
            assert torch.equal(got, want)
        start = window_start(cfg, sink_end, position + 1)
        tail.advance(start)
    assert tail.win_start == start and tail.n == 120 - start


def test_a_token_out_of_order_is_refused():
    kv = torch.zeros(2, 4, 8)
    tail = DeviceTail(kv, kv, kv, kv, win_start=16, capacity=8)
    with pytest.raises(RuntimeError, match="position 21 does not follow 19"):
        tail.append(21, torch.zeros(2, 8), torch.zeros(2, 8))
