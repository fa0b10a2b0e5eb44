"""Prefix-cache pages in the context store (a local directory and a real redis-server): bit-exact
round trips in every pool storage dtype, written in the background; corrupt entries refused and
deleted, foreign, unsigned or misshapen ones refused and left; a store that fails is counted, not
raised."""

import pytest
import torch

from icekv.store import ContextStore, StoreUnavailable
from icekv.store.prefix_pages import PrefixPageStore, decode_page, encode_page, page_key

SHAPE = (3, 2, 2, 16, 8)  # [L, 2, Hkv, P, W]


def _rows(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(SHAPE, generator=g) * 20
    return rows.to(dtype)


@pytest.fixture(params=["local", "redis"])
def backend(request, tmp_path):
    location = str(tmp_path / "store") if request.param == "local" else request.getfixturevalue("redis_url")
    store = ContextStore.open(location, "model-a")
    for key in store.backend.keys():
        store.backend.delete(key)
    return store.backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_pages_round_trip_bit_exact(backend, dtype):
    pages = PrefixPageStore(backend, "model-a", SHAPE, dtype)
    rows = _rows(dtype)
    pages.save(b"chain-1", rows)
    pages.flush()
    back = pages.load(b"chain-1")
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), rows.view(torch.uint8))
    assert pages.load(b"chain-2") is None
    assert (pages.stats.written, pages.stats.loaded, pages.stats.refused) == (1, 1, 0)
    pages.close()


def test_corrupt_pages_are_deleted_and_others_refused_but_kept(backend):
    pages = PrefixPageStore(backend, "model-a", SHAPE, torch.float32)
    key = page_key(b"c")
    blob = bytearray(encode_page(_rows(), key, "model-a"))
    blob[-5] ^= 0xFF  # a flipped byte in the rows
    backend.put(key, bytes(blob))
    assert pages.load(b"c") is None and backend.get(key) is None  # refused and deleted
    backend.put(key, encode_page(_rows(), key, "model-b"))  # another model's (or KV format's)
    assert pages.load(b"c") is None and backend.get(key) is not None  # refused, left for its owner
    backend.put(key, encode_page(_rows()[:, :, :, :8], key, "model-a"))  # another page size
    assert pages.load(b"c") is None
    signed = PrefixPageStore(backend, "model-a", SHAPE, torch.float32, secret=b"k" * 32)
    backend.put(key, encode_page(_rows(), key, "model-a"))  # unsigned, in a store that signs
    assert signed.load(b"c") is None
    assert pages.stats.refused == 3 and signed.stats.refused == 1


def test_a_signed_page_needs_the_key_and_names_no_other_entry():
    rows = _rows()
    blob = encode_page(rows, page_key(b"a"), "m", secret=b"s" * 32)
    assert torch.equal(decode_page(blob, page_key(b"a"), "m", SHAPE, torch.float32, secret=b"s" * 32), rows)
    with pytest.raises(Exception, match="not signed with this store's key"):
        decode_page(blob, page_key(b"a"), "m", SHAPE, torch.float32, secret=b"t" * 32)
    with pytest.raises(Exception, match="another prefix or model"):
        decode_page(blob, page_key(b"b"), "m", SHAPE, torch.float32, secret=b"s" * 32)


def test_a_failing_store_is_counted_not_raised():
    class Down:
        def put(self, key, blob):
            raise StoreUnavailable("down")

        def get(self, key):
            raise StoreUnavailable("down")

    pages = PrefixPageStore(Down(), "m", SHAPE, torch.float32)
    pages.save(b"x", _rows())
    pages.flush()
    assert pages.load(b"x") is None and pages.stats.failed == 2


def test_a_page_not_written_is_written_when_cached_again(tmp_path):
    """A write the store failed leaves the page unmarked: the next time the prefix cache keeps it,
    it is written (a page marked stored on a failed write would never reach the store)."""
    from icekv.config.paging import PagingConfig
    from icekv.kv import PagedKVCache
    from icekv.kv.prefix_tier import PrefixTier
    from icekv.store import LocalStore

    class Flaky(LocalStore):
        down = True

        def put(self, key, blob):
            if self.down:
                raise StoreUnavailable("down")
            super().put(key, blob)

    cache = PagedKVCache(SHAPE[0], SHAPE[2], SHAPE[4], PagingConfig(SHAPE[3], 64))
    pages = PrefixPageStore(Flaky(tmp_path), "m", SHAPE, torch.float32)
    tier = PrefixTier(cache, pages)
    cache.pool[:, :, :, 1] = _rows()
    tier.keep(b"chain", 1)
    pages.flush()
    assert (pages.stats.written, pages.stats.failed) == (0, 1) and pages.load(b"chain") is None
    pages.backend.down = False
    tier.keep(b"chain", 1)
    tier.keep(b"chain", 1)  # written once: the first keep's write is pending or done
    pages.flush()
    assert pages.stats.written == 1 and torch.equal(pages.load(b"chain"), _rows())
