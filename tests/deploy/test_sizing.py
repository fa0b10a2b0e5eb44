"""The sizing calculator agrees with what the engine really allocates."""

import torch

from icekv.config import IceCacheConfig, PagingConfig, SelectionConfig
from icekv.engine.backends import DenseAttention, RequestPages, SparseAttention
from icekv.kv import PagedKVCache
from icekv.model import load_model
from icekv.policies import make_selector
from icekv.sizing import size
from tests.conftest import make_tiny_hf_model


def test_plan_bounds_the_real_resident_bytes(tmp_path):
    make_tiny_hf_model("llama", tmp_path)
    model = load_model(tmp_path)
    a = model.args
    sel = SelectionConfig(policy="icecache", budget=64, n_unlimited_layers=1)
    cache = PagedKVCache(a.num_layers, a.num_kv_heads, a.head_dim, PagingConfig(16, 2048))
    cache.add(0)
    backend = DenseAttention(RequestPages(cache, 0))
    model(torch.arange(500) % 512, backend.begin_step(500), backend)
    sparse = SparseAttention(RequestPages(cache, 0), a, sel, make_selector(sel))
    for t in range(20):
        model(torch.tensor([t]), sparse.begin_step(1), sparse)
        sparse.end_step()
    plan = size(a, 520, 1, sel)
    assert plan.kv_bytes_per_token == cache.bytes_per_token
    assert plan.device_bytes_full == cache.sequence_bytes(0)
    assert sparse.resident_bytes() <= plan.device_bytes_budget


def test_index_estimate_is_close_to_a_built_index(tmp_path):
    make_tiny_hf_model("llama", tmp_path)
    a = load_model(tmp_path).args
    n = 3000
    for policy, score_dtype in (("icecache", "float32"), ("icecache", "int8"), ("icecache_r", "float32"), ("quest", "float32")):
        sel = SelectionConfig(policy=policy, budget=64, n_unlimited_layers=1, icecache=IceCacheConfig(score_dtype=score_dtype))
        selector = make_selector(sel)
        g = torch.Generator().manual_seed(0)
        for layer in range(1, a.num_layers):
            selector.build(layer, torch.randn(a.num_kv_heads, n, a.head_dim, generator=g), base=0)
        estimate, real = size(a, n, 1, sel).index_host_bytes, selector.index_bytes()
        assert 0.85 * real < estimate < 1.2 * real, (policy, estimate, real)
