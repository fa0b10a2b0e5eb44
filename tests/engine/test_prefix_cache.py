"""The prefix cache through the engine: a later prompt that starts with a finished request's tokens
holds its pages instead of prefilling them, and decodes the same tokens."""

import pytest

from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import PromptCaching, SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.engine.sequence import Cancelled

SAMPLING = SamplingConfig(max_tokens=10, ignore_eos=True)
FULL = SelectionConfig(policy="full")
ICECACHE = SelectionConfig(policy="icecache", budget=128)
NO_CACHE = PromptCaching(enabled=False)


@pytest.fixture(scope="module")
def turns(engine, essays_text):
    """A document, a question and a follow-up: turn 2's prompt continues turn 1's and its answer."""
    encode = engine.tokenizer.encode
    return encode(essays_text[:9000])[:1500], encode(" Question: what is this about? Answer:"), \
        encode(" And who wrote it? Answer:")


def _drop_cached(engine) -> None:
    engine.cache.allocator.free(engine.cache.prefix.evict(engine.cache.allocator.num_pages))


@pytest.mark.parametrize("selection", [FULL, ICECACHE], ids=["full", "icecache"])
def test_a_conversation_decodes_the_same_tokens_with_the_cache_as_without(engine, turns, selection):
    doc, q1, q2 = turns
    _drop_cached(engine)
    fresh = lambda ids: engine.generate(ids, SAMPLING, selection=selection)  # noqa: E731
    turn1 = fresh(doc + q1)
    assert turn1.cached_tokens == 0
    second = doc + q1 + turn1.token_ids + q2
    engine.kv.indexes.trim(0)  # the pages alone: a continued index selects within a bound (test_index_reuse)
    cached = engine.submit(second, SAMPLING, selection)
    uncached = engine.submit(second, SAMPLING, selection, caching=NO_CACHE)
    a, b = engine.run(cached), engine.run(uncached)
    assert a.token_ids == b.token_ids
    assert b.cached_tokens == 0
    # full attention keeps the answer's pages too; a selecting decode only the prompt's
    kept = len(doc + q1) + (len(turn1.token_ids) - 1 if selection is FULL else 0)
    assert a.cached_tokens == kept // 16 * 16
    assert engine.cache.pages_available == engine.cache.allocator.num_pages


def test_caching_disabled_neither_reads_nor_keeps(engine, turns):
    doc, q1, _ = turns
    _drop_cached(engine)
    engine.generate(doc + q1, SAMPLING, selection=FULL)
    cached_pages = engine.cache.prefix.pages
    out = engine.run(engine.submit(doc + q1, SAMPLING, FULL, caching=NO_CACHE))
    assert out.cached_tokens == 0 and engine.cache.prefix.pages == cached_pages


def test_requests_share_a_prefix_while_one_of_them_is_cancelled(engine, turns):
    doc, q1, q2 = turns
    _drop_cached(engine)
    prompts = [doc + q1, doc + q2, doc + q1 + q2]
    want = [engine.run(engine.submit(p, SAMPLING, FULL, caching=NO_CACHE)).token_ids for p in prompts]
    engine.generate(doc, SamplingConfig(max_tokens=1), selection=FULL)  # caches the document
    seqs = [engine.submit(p, SAMPLING, FULL) for p in prompts]
    engine.step()
    engine.step()
    seqs[1].cancel()
    while not all(s.done for s in seqs):
        engine.step()
    assert isinstance(seqs[1].error, Cancelled)
    for i in (0, 2):
        # at least the document; more where its first step came after the other's prefill had published
        assert seqs[i].result.token_ids == want[i] and seqs[i].result.cached_tokens >= len(doc) // 16 * 16
    assert engine.cache.pages_available == engine.cache.allocator.num_pages  # nothing held by anyone


def test_pool_pressure_evicts_idle_prefixes_never_a_running_requests_pages(smollm2_dir, turns):
    doc, q1, _ = turns
    engine = Engine(EngineConfig(model_dir=str(smollm2_dir), paging=PagingConfig(pool_tokens=4096)))
    want = engine.run(engine.submit(doc + q1, SAMPLING, FULL, caching=NO_CACHE)).token_ids
    engine.generate(doc, SamplingConfig(max_tokens=1), selection=FULL)
    other = list(reversed(doc))[:1400]
    engine.generate(other, SamplingConfig(max_tokens=1), selection=FULL)  # a second cached prefix
    running = engine.submit(doc + q1, SAMPLING, FULL)
    engine.step()  # holds the document's pages now
    # 2,410 tokens fit only by evicting the idle prefix's pages; the document's are held: they stay
    pressure = engine.submit(other[:100] + doc[:2300], SAMPLING, FULL, caching=NO_CACHE)
    while not (running.done and pressure.done):
        engine.step()
    assert running.error is None and pressure.error is None
    assert running.result.token_ids == want and running.result.cached_tokens == len(doc) // 16 * 16
    assert engine.cache.prefix.stats.evictions > 0
    assert engine.cache.pages_available == engine.cache.allocator.num_pages


def test_a_request_that_starts_while_another_decodes_shares_its_prompt(engine, turns):
    doc, q1, q2 = turns
    _drop_cached(engine)
    want = engine.run(engine.submit(doc + q2, SAMPLING, FULL, caching=NO_CACHE)).token_ids
    first = engine.submit(doc + q1, SamplingConfig(max_tokens=40, ignore_eos=True), FULL)
    while first.phase.value != "decode":
        engine.step()
    second = engine.submit(doc + q2, SAMPLING, FULL)  # the first is still decoding
    out = engine.run(second)
    assert not first.done and out.cached_tokens == len(doc) // 16 * 16 and out.token_ids == want
    engine.run(first)
    assert engine.cache.pages_available == engine.cache.allocator.num_pages
