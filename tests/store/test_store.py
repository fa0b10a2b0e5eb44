"""Context store round trips (local directory and a real redis-server), refusal of bad entries, LRU."""

import time

import pytest
import torch

from icekv.compress import CompressedContext, CompressedLayer
from icekv.store import ContextStore, StoreError


def _ctx(seed=0, pages=3):
    g = torch.Generator().manual_seed(seed)
    layer = lambda: CompressedLayer(
        k=torch.randn(pages, 16, 8, generator=g), v=torch.randn(pages, 16, 8, generator=g),
        page_len=torch.tensor([16, 5, 9][:pages], dtype=torch.int32),
        positions=torch.arange(pages * 16, dtype=torch.int32).view(pages, 16),
        head_indptr=torch.tensor([0, 2, pages]))
    return CompressedContext(300, 16, [layer(), layer()], "kv2", 0.05, 123456)


def _same(a: CompressedContext, b: CompressedContext):
    assert (a.length, a.page_size, a.method, a.kv_budget, a.full_bytes) == (b.length, b.page_size, b.method, b.kv_budget, b.full_bytes)
    for x, y in zip(a.layers, b.layers):
        for f in ("k", "v", "page_len", "positions", "head_indptr"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f


@pytest.fixture(params=["local", "redis"])
def store(request, tmp_path):
    location = str(tmp_path / "store") if request.param == "local" else request.getfixturevalue("redis_url")
    s = ContextStore.open(location, "model-a")
    for k in s.backend.keys():
        s.backend.delete(k)
    return s


def test_round_trip_is_bit_exact(store):
    ctx = _ctx()
    key = store.key([1, 2, 3], "kv2", 0.05)
    store.save(key, ctx)
    _same(store.load(key), ctx)
    assert store.load(store.key([1, 2, 4], "kv2", 0.05)) is None


def test_keys_depend_on_everything_that_shapes_the_cache(store):
    k = store.key([1, 2, 3], "kv2", 0.05)
    assert len({k, store.key([1, 2, 3], "kv2", 0.1), store.key([1, 2, 3], "kvzip", 0.05),
                store.key([1, 2], "kv2", 0.05), store.key([1, 2, 3], "kv2", 0.05, {"rho": 0.5}),
                ContextStore(store.backend, "model-b").key([1, 2, 3], "kv2", 0.05)}) == 6


def test_corrupt_entry_is_refused_and_removed(store):
    key = store.key([9], "kv2", 0.05)
    store.save(key, _ctx())
    blob = bytearray(store.backend.get(key))
    blob[-5] ^= 0xFF  # flip a bit in the tensor data
    store.backend.put(key, bytes(blob))
    with pytest.raises(StoreError, match="corrupt"):
        store.load(key)
    assert store.load(key) is None  # removed: the next request recomputes


def test_foreign_entries_are_refused(store):
    key = store.key([9], "kv2", 0.05)
    store.backend.put(key, b"not a safetensors blob at all")
    with pytest.raises(StoreError, match="not a readable"):
        store.load(key)
    other = ContextStore(store.backend, "model-b")
    other.save(key, _ctx())
    with pytest.raises(StoreError, match="another context or model"):
        store.load(key)


def test_lru_eviction_respects_the_size_limit(store):
    one = len(__import__("icekv.store.format", fromlist=["encode"]).encode(_ctx(), "0" * 64, "model-a"))
    store.backend.max_bytes = int(2.5 * one)
    keys = [store.key([i], "kv2", 0.05) for i in range(3)]
    store.save(keys[0], _ctx(0))
    time.sleep(0.02)
    store.save(keys[1], _ctx(1))
    time.sleep(0.02)
    store.load(keys[0])  # now keys[1] is the least recently used
    time.sleep(0.02)
    store.save(keys[2], _ctx(2))
    assert store.load(keys[1]) is None
    assert store.load(keys[0]) is not None and store.load(keys[2]) is not None


def test_local_store_refuses_path_like_keys(tmp_path):
    s = ContextStore.open(str(tmp_path), "m")
    for key in ("../../etc/passwd", "ab" * 150, "AB" * 32, ""):
        with pytest.raises(StoreError, match="invalid context_key"):
            s.load(key)
    assert not list(tmp_path.iterdir())


def test_redis_store_refuses_keys_that_name_its_own_bookkeeping(redis_url):
    s = ContextStore.open(redis_url, "m")
    for key in ("__lru__", "__sizes__", "ab" * 150):
        with pytest.raises(StoreError, match="invalid context_key"):
            s.load(key)
