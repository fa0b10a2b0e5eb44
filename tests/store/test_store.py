"""Context store round trips (local directory and a real redis-server), refusal of bad entries, LRU."""

import time

import pytest
import torch

from icekv.compress import CompressedContext, CompressedLayer
from icekv.errors import ConfigError
from icekv.store import ContextStore, CorruptEntry, LocalStore, StoreError, StoreUnavailable


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
                ContextStore(store.backend, "model-b").key([1, 2, 3], "kv2", 0.05),
                store.key([1, 2, 3], "kv2", 0.05, {"normalize": True}),
                store.key([1, 2, 3], "kv2", 0.05, {"attend": "context"})}) == 8
    # a setting spelled out at its default is the same compression, so the same entry
    assert store.key([1, 2, 3], "kv2", 0.05, {"rounds": 1, "proxy": "keydiff"}) == k


def test_corrupt_entry_is_refused_and_removed(store):
    key = store.key([9], "kv2", 0.05)
    store.save(key, _ctx())
    blob = bytearray(store.backend.get(key))
    blob[-5] ^= 0xFF  # flip a bit in the tensor data
    store.backend.put(key, bytes(blob))
    with pytest.raises(StoreError, match="corrupt"):
        store.load(key)
    assert store.load(key) is None  # removed: the next request recomputes


def test_foreign_entries_are_refused_but_left_to_their_owner(store):
    key = store.key([9], "kv2", 0.05)
    store.backend.put(key, b"not a safetensors blob at all")
    with pytest.raises(CorruptEntry, match="not a readable"):
        store.load(key)
    other = ContextStore(store.backend, "model-b")  # e.g. the previous model during a rolling update
    other.save(key, _ctx())
    with pytest.raises(StoreError, match="another context or model"):
        store.load(key)
    _same(other.load(key), _ctx())  # still there for the replicas that use it


def test_metadata_is_covered_by_the_digest(store):
    key = store.key([7], "kv2", 0.05)
    store.save(key, _ctx())
    blob = store.backend.get(key)
    forged = blob.replace(b'"length":"300"', b'"length":"900"')
    assert forged != blob and len(forged) == len(blob)
    store.backend.put(key, forged)
    with pytest.raises(CorruptEntry, match="digest mismatch"):
        store.load(key)


def test_signed_store_refuses_unsigned_forged_and_differently_signed_entries(store, tmp_path, monkeypatch):
    (tmp_path / "key").write_text("replica-secret\n")
    monkeypatch.setenv("ICEKV_STORE_KEY_FILE", str(tmp_path / "key"))
    signed = ContextStore(store.backend, "model-a", b"replica-secret")
    unsigned = ContextStore(store.backend, "model-a")
    key = signed.key([5], "kv2", 0.05)
    signed.save(key, _ctx(1))
    _same(signed.load(key), _ctx(1))
    with pytest.raises(StoreError, match="signed with hmac-sha256, this store expects sha256"):
        unsigned.load(key)
    unsigned.save(key, _ctx(2))  # a writer without the key plants an entry
    with pytest.raises(StoreError, match="signed with sha256, this store expects hmac-sha256"):
        signed.load(key)
    ContextStore(store.backend, "model-a", b"another-secret").save(key, _ctx(2))
    with pytest.raises(StoreError, match="not signed with this store's key"):
        signed.load(key)
    assert store.backend.get(key) is not None  # refused, not deleted
    reopened = ContextStore.open(str(tmp_path / "local"), "model-a")
    assert reopened.secret == b"replica-secret"  # read from the file the environment names


def test_secret_files_that_cannot_be_read_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("ICEKV_STORE_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="ICEKV_STORE_KEY_FILE: cannot read the secret file"):
        ContextStore.open(str(tmp_path / "s"), "m")
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("ICEKV_STORE_KEY_FILE", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="the secret file is empty"):
        ContextStore.open(str(tmp_path / "s"), "m")


def test_a_failed_local_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """A full disk, through the store's own write path: half the blob written, then ENOSPC."""
    import errno

    s = ContextStore.open(str(tmp_path), "m")

    def full_disk(path, blob):
        with open(path, "wb") as f:
            f.write(blob[: len(blob) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalStore, "_write", staticmethod(full_disk))
    key = s.key([1], "kv2", 0.05)
    with pytest.raises(StoreUnavailable, match="cannot write an entry: No space left on device") as info:
        s.save(key, _ctx())
    assert str(tmp_path) not in str(info.value)
    assert list(tmp_path.iterdir()) == [] and s.load(key) is None


def test_concurrent_writers_of_one_key_never_mix(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    s = ContextStore.open(str(tmp_path), "m")
    key = s.key([3], "kv2", 0.05)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: s.save(key, _ctx(i % 2)), range(32)))
    loaded = s.load(key)  # one writer's whole entry, verified
    assert loaded is not None and [p.name for p in tmp_path.iterdir()] == [f"{key}.ctx"]


def test_stale_temporary_files_are_removed(tmp_path):
    import os

    s = ContextStore.open(str(tmp_path), "m")
    stale = tmp_path / f".{'0' * 64}.dead.tmp"
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    s.save(s.key([1], "kv2", 0.05), _ctx())
    assert not stale.exists()


def test_a_claim_is_one_owner_s_until_given_back_or_lapsed(store):
    key = "ab" * 32
    assert store.claim(key, "replica-a", ttl_s=3.0)
    assert not store.claim(key, "replica-b", ttl_s=3.0)
    assert store.claim(key, "replica-a", ttl_s=3.0)  # renewed by its owner
    store.release(key, "replica-b")  # not b's to give back
    assert not store.claim(key, "replica-b", ttl_s=3.0)
    store.release(key, "replica-a")
    assert store.claim(key, "replica-b", ttl_s=3.0)  # t = 0
    time.sleep(1.0)
    assert store.claim(key, "replica-b", ttl_s=3.0)  # renewed at 1 s: it lapses at 4 s, not 3 s
    time.sleep(2.5)
    assert not store.claim(key, "replica-a", ttl_s=3.0)  # 3.5 s
    time.sleep(1.0)
    assert store.claim(key, "replica-a", ttl_s=3.0)  # 4.5 s: b stopped renewing, so it lapsed and a took it
    assert store.backend.keys() == [] and not store.has(key) and store.load(key) is None  # a claim is no entry
    store.save(key, _ctx())
    assert store.has(key) and store.backend.keys() == [key]
    store.release(key, "replica-a")


def test_a_dead_replica_s_claim_file_is_removed_at_eviction(tmp_path):
    import os

    s = ContextStore.open(str(tmp_path), "m")
    key = "cd" * 32
    assert s.claim(key, "dead")
    claim = tmp_path / f".{key}.claim"
    os.utime(claim, (time.time() - 7200, time.time() - 7200))
    s.save(s.key([1], "kv2", 0.05), _ctx())
    assert not claim.exists()


def test_unreachable_redis_is_a_prompt_clear_error():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"cannot reach Redis at 127.0.0.1:{port}"):
        ContextStore.open(f"redis://:hunter2@127.0.0.1:{port}/0", "m")
    assert time.monotonic() - t0 < 10


def test_redis_killed_mid_use_fails_fast_and_names_no_secret(tmp_path):
    from tests.redis_server import start_redis

    proc, url = start_redis(tmp_path, "--requirepass", "hunter2")
    try:
        (tmp_path / "password").write_text("hunter2")
        with pytest.MonkeyPatch.context() as env:
            env.setenv("ICEKV_REDIS_PASSWORD_FILE", str(tmp_path / "password"))
            s = ContextStore.open(url, "m")  # the password from the file
        key = s.key([1], "kv2", 0.05)
        s.save(key, _ctx())
        _same(s.load(key), _ctx())
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            s.load(key)
        assert time.monotonic() - t0 < 15 and "hunter2" not in str(info.value)
    finally:
        proc.kill()


def test_redis_maxmemory_below_the_store_limit_caps_the_store(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    client.config_set("maxmemory", 10 << 20)
    try:
        s = ContextStore.open(redis_url, "m", max_bytes=8 << 30)
        assert s.backend.max_bytes == int((10 << 20) * 0.8)
    finally:
        client.config_set("maxmemory", 0)


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


def test_a_local_store_of_many_entries_stays_within_its_limit(tmp_path):
    """Entries past the limit go least recently used first, after every put, though the directory
    is scanned only now and then; another writer's entries count from this one's next scan."""
    blob = b"x" * 1000
    s = LocalStore(tmp_path, max_bytes=10_500)
    for i in range(40):
        s.put(f"{i:064x}", blob)
        held = sorted(tmp_path.glob("*.ctx"))
        assert sum(p.stat().st_size for p in held) <= 10_500
    assert 9 <= len(held) <= 10 and held[-1].stem == f"{39:064x}"  # the newest kept
    assert s.get(f"{0:064x}") is None

    other = LocalStore(tmp_path, max_bytes=10_500)
    other.put("f" * 64, blob)  # its first put scans: the entries the first writer left are counted
    assert sum(p.stat().st_size for p in tmp_path.glob("*.ctx")) <= 10_500 and other.get("f" * 64) == blob


def test_a_local_store_over_a_path_it_cannot_use_says_so(tmp_path):
    (tmp_path / "a-file").write_text("")
    for root in (tmp_path / "a-file", tmp_path / "a-file" / "below"):
        with pytest.raises(StoreUnavailable, match="cannot use directory .*a-file"):
            ContextStore.open(str(root), "m")


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
