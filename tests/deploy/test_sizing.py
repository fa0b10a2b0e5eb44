"""The sizing calculator agrees with what the engine really allocates."""

from dataclasses import replace

import torch

from icekv.config.paging import PagingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine.backends import DenseAttention, RequestPages, SparseAttention
from icekv.kv import PagedKVCache
from icekv.model import load_model
from icekv.model.random import shape_args
from icekv.policies import resolve
from icekv.sizing import device_need, size
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
    sparse = SparseAttention(RequestPages(cache, 0), a, resolve(sel), resolve(sel).make_selector())
    for t in range(20):
        model(torch.tensor([t]), sparse.begin_step(1), sparse)
        sparse.end_step()
    plan = size(a, 520, 1, resolve(sel))
    assert plan.kv_bytes_per_token == cache.bytes_per_token
    assert plan.device_bytes_full == cache.sequence_bytes(0)
    assert sparse.resident_bytes() <= plan.device_bytes_budget


def test_index_estimate_is_close_to_a_built_index(tmp_path):
    make_tiny_hf_model("llama", tmp_path)
    a = load_model(tmp_path).args
    n = 3000
    cases = (("icecache", "float32", "float32"), ("icecache", "int8", "float32"), ("icecache_r", "float32", "float32"),
             ("quest", "float32", "float32"), ("icecache", "auto", "bfloat16"), ("icecache", "auto", "float32"))
    sizes = {}
    for policy, score_dtype, kv_dtype in cases:
        sel = SelectionConfig(policy=policy, budget=64, n_unlimited_layers=1, icecache=IceCacheConfig(score_dtype=score_dtype))
        selector = resolve(sel).make_selector()
        g = torch.Generator().manual_seed(0)
        for layer in range(1, a.num_layers):
            keys = torch.randn(a.num_kv_heads, n, a.head_dim, generator=g).to(getattr(torch, kv_dtype))
            selector.build(layer, keys, base=0)
        estimate, real = size(a, n, 1, resolve(sel), kv_dtype).index_host_bytes, selector.index_bytes()
        assert 0.85 * real < estimate < 1.2 * real, (policy, score_dtype, kv_dtype, estimate, real)
        sizes[policy, score_dtype, kv_dtype] = real
    # the default follows the KV: bf16 page keys under a bf16 cache (a smaller index), fp32 under fp32
    assert sizes["icecache", "auto", "float32"] == sizes["icecache", "float32", "float32"]
    assert sizes["icecache", "auto", "bfloat16"] < 0.75 * sizes["icecache", "float32", "float32"]


def test_centroid_copy_estimate_is_close_to_the_copies_made(tmp_path):
    make_tiny_hf_model("llama", tmp_path)
    a = load_model(tmp_path).args
    n = 3000
    for policy, rescoring in (("icecache", "host"), ("icecache_r", "host"), ("icecache", "device")):
        sel = SelectionConfig(policy=policy, budget=64, n_unlimited_layers=1,
                              icecache=IceCacheConfig(search="centroids", centroid_scoring="device",
                                                      rescoring=rescoring))
        selector = resolve(sel).make_selector()
        g = torch.Generator().manual_seed(0)
        for layer in range(1, a.num_layers):
            selector.build(layer, torch.randn(a.num_kv_heads, n, a.head_dim, generator=g), base=0)
            selector.select(layer, torch.randn(a.num_heads, a.head_dim, generator=g), resolve(sel).selected_pages)
        estimate = resolve(sel).device_index_bytes(a, n, "cpu", 4)
        assert 0.8 * selector.device_bytes() < estimate < 1.25 * selector.device_bytes(), (policy, estimate)
        on_host = replace(sel, icecache=IceCacheConfig(search="centroids", centroid_scoring="auto"))
        assert resolve(on_host).device_index_bytes(a, n, "cpu", 4) == 0  # auto: the host, on a CPU
        assert resolve(on_host).device_index_bytes(a, n, "cuda", 2) > 0


def test_device_need_of_a_prefill_and_of_decodes():
    a = shape_args("llama-3.1-8b")
    per = 2 * a.num_kv_heads * a.head_dim * 2  # bf16 K and V of one token in one layer
    sparse = SelectionConfig(policy="icecache", budget=256, icecache=IceCacheConfig(search="centroids"))
    need = device_need(a, 32768, 100, resolve(sparse), per, device_type="cuda", chunk_tokens=512)
    assert need.prefill == a.num_layers * 32768 * per  # every layer's K/V of the prompt
    unlimited = sparse.n_unlimited_layers * 32868 * per
    slots = (a.num_layers - sparse.n_unlimited_layers) * (256 + 16) * per
    assert unlimited + slots < need.decode < unlimited + slots + 0.05 * need.prefill  # + the centroid copy
    assert need.most == need.prefill
    full = device_need(a, 32768, 100, resolve(SelectionConfig(policy="full")), per, chunk_tokens=512)
    assert full.decode == a.num_layers * 32868 * per and full.most == full.decode
    assert device_need(a, 32768, 100, None, per, context_bytes=5, chunk_tokens=512).decode == 0  # prefill only


def test_a_local_layer_is_charged_about_its_window_on_the_device():
    """Gemma 3's layout: ten of twelve layers attend 512 tokens; at 128k under icecache the device
    holds the two global layers' budget and the local layers' windows, and the pool every token;
    its prefill the global layers' prompt and the local layers' windows."""
    everywhere = replace(shape_args("llama-tiny"), num_layers=12)
    gemma_like = replace(everywhere, sliding_window=512, local_layers=(0, 1, 2, 3, 4, 6, 7, 8, 9, 10))
    plan = resolve(SelectionConfig(policy="icecache", budget=256, n_unlimited_layers=0))
    sized, whole = size(gemma_like, 131072, 1, plan), size(everywhere, 131072, 1, plan)
    assert sized.kv_bytes_per_token == whole.kv_bytes_per_token  # the pool still holds every layer
    per_layer_token = sized.kv_bytes_per_token // 12
    assert sized.device_bytes_budget == (2 * 256 + 10 * 1024) * per_layer_token
    full = resolve(SelectionConfig(policy="full"))
    windowed = device_need(gemma_like, 131072, 0, plan, per_layer_token, chunk_tokens=512)
    dense = device_need(everywhere, 131072, 0, full, per_layer_token, chunk_tokens=512)
    assert windowed.decode < dense.decode / 50  # the centroid copy included
    assert windowed.prefill == (2 * 131072 + 10 * (2 * 512 + 511)) * per_layer_token  # two windows and a chunk
    assert dense.prefill == 12 * 131072 * per_layer_token
