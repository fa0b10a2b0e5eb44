"""The sparse index built layer by layer during prefill (icekv.engine.backends.prefill_index), on the real model."""

from __future__ import annotations

import pytest
import torch

from icekv.config.engine import EngineConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine
from icekv.engine.backends.prefill_index import IndexingPrefillAttention, PrefillIndex
from icekv.policies import resolve

pytestmark = pytest.mark.model

SAMPLING = SamplingConfig(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    """One thread builds the index during prefill (this machine's default may leave none free)."""
    return Engine(EngineConfig(model_dir=str(smollm2_dir), index_threads=1))


def _prompt(engine, n):
    return engine.tokenizer.encode("The archive kept letters, maps and the harbour's ledgers. " * 60)[:n]


@pytest.mark.parametrize("policy, n, budget", [("icecache", 330, 128), ("icecache_r", 330, 128), ("quest", 330, 128),
                                               ("icecache", 20, 48)])
def test_index_built_during_prefill_decodes_as_one_built_after(engine, policy, n, budget):
    ids = _prompt(engine, n)  # 20: shorter than sink + window, an empty region
    # budget 48: 20 + 40 tokens exceed it, so the decode selects (within the budget it attends all)
    sel = SelectionConfig(policy=policy, budget=budget, n_unlimited_layers=1)
    during = engine.prefill(ids, selection=sel)
    after = engine.prefill(ids)
    try:
        assert set(during.index.builds) == set(range(1, engine.model.args.num_layers))
        assert after.index is None
        sampling = SamplingConfig(max_tokens=40, ignore_eos=True) if n == 20 else SAMPLING
        a = engine.decode(during, sampling, sel)
        b = engine.decode(after, sampling, sel)
        assert during.index is None  # taken by the first decode
        assert a.token_ids == b.token_ids and a.kv.bytes_moved == b.kv.bytes_moved > 0
    finally:
        engine.release(during)
        engine.release(after)


def test_prefill_built_trees_equal_trees_built_after(engine):
    ids = _prompt(engine, 300)
    sel = SelectionConfig(policy="icecache", budget=128, icecache=IceCacheConfig(search="walk"))
    req = engine.prefill(ids, selection=sel)
    try:
        built = req.index.wait()
        plan = resolve(sel)
        fresh = plan.make_selector()
        sink = plan.sink_tokens
        end = plan.window_start(sink, len(ids))
        for layer in sorted(built):
            fresh.build(layer, engine.cache.gather_range(layer, req.seq_id, sink, end)[0], sink)
            ours, theirs = req.index.selector.stores[layer], fresh.stores[layer]
            assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.keys, theirs.keys)
    finally:
        engine.release(req)


def test_builds_start_as_soon_as_each_layer_has_its_region(engine):
    ids = _prompt(engine, 330)  # window from 304: final after the chunk ending at 320, one before the last
    plan = resolve(SelectionConfig(policy="icecache", budget=128))
    index = PrefillIndex(plan, plan.make_selector())
    seq_id = -1
    engine.cache.add(seq_id)
    try:
        backend = IndexingPrefillAttention(engine.cache, seq_id, engine.model.args, len(ids), 64, index)
        started = {}  # chunk end -> builds started by then
        for start in range(0, len(ids), 64):
            tokens = torch.tensor(ids[start : start + 64])  # [C]
            engine.model(tokens, backend.begin_step(len(tokens)), backend, logit_rows=torch.tensor([-1]))
            started[min(start + 64, len(ids))] = len(index.builds)
        assert started[256] == 0 and started[320] == len(backend.layers) == engine.model.args.num_layers - 2
        assert index.wait() == set(backend.layers)
    finally:
        index.cancel()
        engine.cache.free(seq_id)


def test_index_waits_for_the_decode_under_its_own_selection(engine):
    ids = _prompt(engine, 300)
    built_for = SelectionConfig(policy="icecache", budget=128)
    other = SelectionConfig(policy="icecache", budget=256)
    req = engine.prefill(ids, selection=built_for)
    ref = engine.prefill(ids)
    try:
        index = req.index
        assert engine.decode(req, SAMPLING, other).token_ids == engine.decode(ref, SAMPLING, other).token_ids
        assert req.index is index  # another selection built its own and left this one
        assert engine.decode(req, SAMPLING, built_for).token_ids == engine.decode(ref, SAMPLING, built_for).token_ids
        assert req.index is None
    finally:
        engine.release(req)
        engine.release(ref)


def test_release_without_decode_stops_the_builds(engine):
    req = engine.prefill(_prompt(engine, 300), selection=SelectionConfig(policy="icecache", budget=128))
    index = req.index
    engine.release(req)
    assert all(f.done() for f in index.builds.values())
    free_before = engine.cache.pages_available
    req = engine.prefill(_prompt(engine, 300))  # the pool is whole again
    engine.release(req)
    assert engine.cache.pages_available == free_before


def test_no_index_threads_means_the_first_decode_builds_it(smollm2_dir):
    engine = Engine(EngineConfig(model_dir=str(smollm2_dir), index_threads=0))
    req = engine.prefill(_prompt(engine, 300), selection=SelectionConfig(policy="icecache", budget=128))
    try:
        assert req.index is None
        gen = engine.decode(req, SAMPLING, SelectionConfig(policy="icecache", budget=128))
        assert gen.timings["index_build_s"] > 0 and len(gen.token_ids) == SAMPLING.max_tokens
    finally:
        engine.release(req)


def test_bench_first_token_uses_the_index_built_during_prefill(engine, essays_text):
    from icekv.eval.decode_bench import DecodeBenchConfig, plans_for, run_decode_bench

    cfg = DecodeBenchConfig(contexts=(600,), policies=("full", "icecache", "icecache_r"), budget=64, steps=2,
                            seed_tokens=300, ttft_contexts=(600,), repeats=2)
    full, ice, ice_r = run_decode_bench(engine, cfg, essays_text, plans_for(cfg))
    assert ice["index_prebuilt"] and not ice_r["index_prebuilt"] and not full["index_prebuilt"]
    for r in (ice, ice_r):  # time to first token: this prefill plus what its first decode spent on the index
        assert r["ttft_s"] == r["prefill_s"] + r["index_build_s"] and r["index_build_s"] >= 0
