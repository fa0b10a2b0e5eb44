"""The code a GPU runs with its page pool in host memory, exercised on the CPU by telling the
engine its pool is not where attention runs: per-request attention instead of the batched paged
decode, the compute mirror for layers attended whole, selected pages staged then loaded. The
greedy tokens must equal those of the pool read in place."""

import pytest
import torch

from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine
from icekv.engine.backends.whole_tokens import ComputeMirror
from icekv.kv import PagedKVCache

SELECTIONS = [SelectionConfig(policy="full"), SelectionConfig(policy="icecache", budget=64),
              SelectionConfig(policy="icecache", budget=64,  # the search a GPU runs: ranked and rescored there
                              icecache=IceCacheConfig(search="centroids", centroid_scoring="device",
                                                      rescoring="device"))]


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(random_weights="llama-tiny", device="cpu", paging=PagingConfig(pool_tokens=8192)))


def _tokens(engine, selection, context=None):
    sampling = SamplingConfig(max_tokens=10, ignore_eos=True)
    prompts = [[3 + i % 500 for i in range(n)] for n in (40, 300, 700)]  # within the budget and past it
    seqs = [engine.submit(p, sampling, selection, context) for p in prompts]  # batched: one step for all
    return [engine.run(s).token_ids for s in seqs]


@pytest.mark.parametrize("selection", SELECTIONS, ids=["full", "icecache", "icecache on the device"])
def test_a_pool_off_the_compute_device_decodes_the_same_tokens(engine, selection, monkeypatch):
    context = engine.compress(list(range(5, 500)), "snapkv", 0.2)
    want = _tokens(engine, selection), _tokens(engine, selection, context)
    mirrored = []
    original_read = ComputeMirror.read

    def read(self, layer, length, start=0):
        mirrored.append(length)
        return original_read(self, layer, length, start)

    monkeypatch.setattr(PagedKVCache, "pool_on_compute", property(lambda self: False))
    monkeypatch.setattr(ComputeMirror, "read", read)
    assert (_tokens(engine, selection), _tokens(engine, selection, context)) == want
    assert mirrored  # the layers attended whole read the device copy


def test_the_mirror_copies_each_token_once_and_grows():
    cache = PagedKVCache(1, 2, 4, PagingConfig(page_size=4, pool_tokens=64))
    cache.add(0)
    mirror = ComputeMirror(cache, 0)
    for n in (3, 1, 9, 1):
        start = cache.extend(0, n)
        cache.write(0, 0, start, torch.randn(n, 2, 4), torch.randn(n, 2, 4))
        k, v = mirror.read(0, cache.length(0))
        want_k, want_v = cache.gather(0, 0)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert mirror.filled[0] == 14 and mirror.kv[0].shape[2] >= 14


def test_tokens_written_through_the_mirror_are_never_copied_back(monkeypatch):
    """Writes that continue the mirror are kept from the model's own tensors; a gap (tokens
    written to the pool only) is filled from the pool on the next read. Sized once by its hint."""
    cache = PagedKVCache(1, 2, 4, PagingConfig(page_size=4, pool_tokens=64))
    cache.add(0)
    mirror = ComputeMirror(cache, 0, tokens=20)
    copied = []
    view_range = PagedKVCache.view_range
    monkeypatch.setattr(PagedKVCache, "view_range",
                        lambda self, layer, seq, a, b: copied.append((a, b)) or view_range(self, layer, seq, a, b))
    for n, through_mirror in ((5, True), (1, True), (3, False), (1, True), (2, True)):
        start = cache.extend(0, n)
        k, v = torch.randn(n, 2, 4), torch.randn(n, 2, 4)
        cache.write(0, 0, start, k, v)
        if through_mirror:
            mirror.write(0, start, k, v)
        got_k, got_v = mirror.read(0, cache.length(0))
        want_k, want_v = cache.gather(0, 0)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert copied == [(6, 9)]  # only the tokens written to the pool alone
    assert mirror.kv[0].shape[2] == 20


def test_a_decode_over_a_context_holds_its_pages_only_for_the_layers_attended_whole(engine):
    context = engine.compress([5 + i % 500 for i in range(700)], "snapkv", 0.2)
    selection = SelectionConfig(policy="icecache", budget=64, n_unlimited_layers=1)
    seq = engine.submit([7, 8, 9], SamplingConfig(max_tokens=6, ignore_eos=True), selection, context)
    while not seq.decoder_ready:
        engine.step()
    engine.step()  # a decode step: every layer has attended once
    source = seq.backend.source
    assert set(source._prefix) == {0}  # the budgeted layers read the context from its host copy
    assert source.context_bytes(range(engine.model.args.num_layers)) == source.context_bytes([0]) > 0
    assert len(engine.run(seq).token_ids) == 6


def test_a_local_layers_mirror_holds_its_window_not_the_request():
    """Prefill chunks then decode steps through a layer with a window of 8: the mirror attends as
    the pool read in place does, and keeps about two windows however long the request grows."""
    from icekv.engine.backends.whole_tokens import PoolTokens

    cache = PagedKVCache(1, 2, 4, PagingConfig(page_size=4, pool_tokens=256), layer_windows=(8,))
    cache.add(0)
    mirror, in_place = ComputeMirror(cache, 0, tokens=200), PoolTokens(cache, 0)
    generator = torch.Generator().manual_seed(0)
    for n in (13, 6, *[1] * 100, 9, *[1] * 20):
        start = cache.extend(0, n)
        k, v = torch.randn(n, 2, 4, generator=generator), torch.randn(n, 2, 4, generator=generator)
        cache.write(0, 0, start, k, v)
        mirror.write(0, start, k, v)
        q, positions = torch.randn(n, 4, 4, generator=generator), torch.arange(start, start + n)
        length = start + n
        torch.testing.assert_close(mirror.attend(0, q, positions, length), in_place.attend(0, q, positions, length))
    assert cache.length(0) == 148 and mirror.base[0] > 120  # what is behind the window was dropped
    assert mirror.kv[0].shape[2] <= 8 + 4 + 13  # the window, a page not yet dropped and the widest step
