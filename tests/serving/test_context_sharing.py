"""Reusable contexts through the serving engine thread (real engine, real model, no Triton):
compressed once per key however many requests ask, on one replica or on two sharing a store,
shared, released, cancelled, failed cleanly."""

import time

from dataclasses import dataclass

import pytest

from icekv.compress.methods import COMPRESSORS
from icekv.config.engine import EngineConfig, SchedulerConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.serving.context_service import ContextService
from icekv.serving.engine_loop import EngineLoop
from icekv.serving.request import ContextRequest, GenerateRequest
from icekv.serving.shared_contexts import SharedContexts
from icekv.store import CLAIM_TTL_S, ContextStore
from tests.serving.sinks import RecordingSink

pytestmark = pytest.mark.model
QUESTION = "\nWhat is the special magic number for amber-falcon mentioned in the provided text? " \
           "The special magic number for amber-falcon mentioned in the provided text is"


@pytest.fixture(scope="module")
def document(essays_text):
    words = essays_text.split()[:700]
    words.insert(350, "One of the special magic numbers for amber-falcon is: 4817263.")
    return " ".join(words)


def _replica(model_dir, store_dir, claim_ttl_s: float = CLAIM_TTL_S) -> EngineLoop:
    """A replica's serving loop over the context store in ``store_dir`` (its ``store`` attribute)."""
    cfg = EngineConfig(model_dir=str(model_dir), scheduler=SchedulerConfig(max_active_requests=8))
    store = {}

    def contexts(engine):
        store["store"] = ContextStore.open(str(store_dir), engine.model_id)
        return ContextService(engine, store["store"], engine.kv.context_limit, 4096, claim_ttl_s=claim_ttl_s)

    made = EngineLoop(lambda: Engine(cfg), make_contexts=contexts)
    made.store = store["store"]
    return made


@pytest.fixture
def loop(smollm2_dir, tmp_path):
    made = _replica(smollm2_dir, tmp_path / "store")
    yield made
    made.stop()


def _ask(loop, document, question=QUESTION, method="kv2", cancel=False):
    req = GenerateRequest(question, SamplingConfig(max_tokens=8), SelectionConfig(policy="full"), False, None,
                          ContextRequest(document, None, method, 0.25))
    sink = RecordingSink(cancel=cancel)
    spec = loop.contexts.spec(req.context, None)
    context = loop.contexts.find(spec.key)
    if context is None:
        loop.submit_compression(req, sink, spec)
    else:
        sink.context_used(spec.key, "hit")
        loop.submit(req, sink, context, spec.key)
    return sink, spec


def test_concurrent_requests_share_one_compression(loop, document):
    asked = [_ask(loop, document) for _ in range(4)]
    for sink, _ in asked:
        assert sink.finished.wait(300) and sink.failure is None, sink.failure
    stats = loop.contexts.stats
    assert stats.misses == 1 and stats.joined == 3  # one compression, three waited on it
    assert sorted(s.context_cache for s, _ in asked) == ["compressed", "joined", "joined", "joined"]
    answers = {s.result.text for s, _ in asked}
    assert len(answers) == 1 and "4817263" in answers.pop()
    key = asked[0][1].key
    assert loop.store.load(key) is not None  # stored for other replicas
    assert loop.contexts.shared.users(key) == 0  # every request gave it back, it stays cached
    again, _ = _ask(loop, document)
    assert again.finished.wait(300) and again.context_cache == "hit"
    assert again.result.text == asked[0][0].result.text


def test_a_failed_compression_fails_its_waiters_and_stores_nothing(loop, document, monkeypatch):
    @dataclass(frozen=True)
    class Broken:  # a compressor's shape: a dataclass of settings with score_steps
        def score_steps(self, engine, seq_id, ids, kv_budget):
            yield
            raise RuntimeError("scoring exploded")

    monkeypatch.setitem(COMPRESSORS, "broken", Broken)  # fault injection: a method that fails mid-way
    asked = [_ask(loop, document, method="broken") for _ in range(3)]
    for sink, _ in asked:
        assert sink.finished.wait(300)
        assert sink.failure[0] == "internal" and "scoring exploded" not in sink.failure[1]
    key = asked[0][1].key
    assert loop.store.load(key) is None and loop.contexts.shared.acquire(key) is None
    assert loop.engine.cache.pages_available == loop.engine.cache.allocator.num_pages  # pages freed
    ok, _ = _ask(loop, document)  # the server goes on
    assert ok.finished.wait(300) and ok.failure is None


def test_a_compression_nobody_waits_for_is_cancelled(loop, document):
    sink, spec = _ask(loop, document, cancel=True)
    assert sink.finished.wait(300) and sink.failure[0] == "cancelled"
    assert loop.store.load(spec.key) is None
    assert not loop.contexts.busy
    cache = loop.engine.cache
    deadline = time.monotonic() + 10  # the client is told at once; the prefill's pages go at the next step
    while cache.pages_available != cache.allocator.num_pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.pages_available == cache.allocator.num_pages


def test_compress_only_returns_the_context(loop, document):
    req = GenerateRequest(None, SamplingConfig(), SelectionConfig(policy="full"), False, None,
                          ContextRequest(document, None, "snapkv", 0.25))
    sink = RecordingSink()
    spec = loop.contexts.spec(req.context, None)
    loop.submit_compression(req, sink, spec)
    assert sink.finished.wait(300) and sink.ready is not None and sink.context_cache == "compressed"
    assert sink.ready.length == len(spec.ids) and loop.store.load(spec.key) is not None


def test_two_replicas_on_one_store_compress_a_new_context_once(smollm2_dir, tmp_path, document):
    replicas = [_replica(smollm2_dir, tmp_path / "store") for _ in range(2)]
    try:
        asked = [(_ask(replicas[i % 2], document)[0], i % 2) for i in range(6)]  # 3 each, interleaved
        for sink, _ in asked:
            assert sink.finished.wait(300) and sink.failure is None, sink.failure
        compressed_on = [i for sink, i in asked if sink.context_cache == "compressed"]
        assert len(compressed_on) == 1  # one compression across both replicas
        assert sum(r.contexts.stats.misses for r in replicas) == 1
        other = replicas[1 - compressed_on[0]]
        assert other.contexts.stats.joined >= 1  # it waited on the claimant's entry instead of compressing
        assert {s.context_cache for s, i in asked if i != compressed_on[0]} <= {"joined", "hit"}
        answers = {s.result.text for s, _ in asked}
        assert len(answers) == 1 and "4817263" in answers.pop()
        assert not list((tmp_path / "store").glob(".*.claim"))  # the claim was given back
    finally:
        for r in replicas:
            r.stop()


def test_a_context_another_replica_gives_up_is_compressed_here(loop, document):
    spec = loop.contexts.spec(ContextRequest(document, None, "kv2", 0.25), None)
    assert loop.store.claim(spec.key, "another-replica")  # compressing it elsewhere, renewing its claim
    gone, _ = _ask(loop, document, cancel=True)  # a waiter that leaves: its wait is dropped
    assert gone.finished.wait(30) and gone.failure[0] == "cancelled"
    sink, _ = _ask(loop, document)
    assert not sink.finished.wait(1.5) and sink.context_cache == "joined"  # waits on that replica
    loop.store.release(spec.key, "another-replica")  # which failed, and stored nothing
    assert sink.finished.wait(300) and sink.failure is None, sink.failure
    assert loop.contexts.stats.misses == 1 and "4817263" in sink.result.text
    assert loop.store.load(spec.key) is not None


def test_a_dead_replica_s_claim_lapses_and_the_context_is_compressed_here(smollm2_dir, tmp_path, document):
    replica = _replica(smollm2_dir, tmp_path / "store", claim_ttl_s=2.0)
    try:
        spec = replica.contexts.spec(ContextRequest(document, None, "kv2", 0.25), None)
        t0 = time.monotonic()
        assert replica.store.claim(spec.key, "dead-replica", ttl_s=2.0)  # then never renewed nor given back
        sink, _ = _ask(replica, document)
        assert sink.finished.wait(300) and sink.failure is None, sink.failure
        assert time.monotonic() - t0 >= 2.0 and sink.context_cache == "joined"
        assert replica.contexts.stats.misses == 1 and "4817263" in sink.result.text
    finally:
        replica.stop()


class _Ctx:
    def __init__(self, nbytes):
        self.nbytes = nbytes


def test_shared_contexts_evict_only_unused_ones():
    shared = SharedContexts(max_bytes=250)
    a, b, c = _Ctx(100), _Ctx(100), _Ctx(100)
    shared.add("a", a)
    shared.add("b", b)
    shared.release("b")
    assert shared.add("c", c) is c and shared.count == 2  # over 250: b (unused) went, a (in use) stayed
    assert shared.acquire("b") is None and shared.acquire("a") is a
    shared.add("d", _Ctx(100))  # every entry in use: nothing can go, the bound is exceeded
    assert shared.count == 3 and shared.nbytes == 300
    for key, times in (("a", 2), ("c", 1), ("d", 1)):
        for _ in range(times):
            shared.release(key)
    assert shared.nbytes <= 250 and shared.acquire("d") is not None  # the least recently used went first
    assert shared.add("d", _Ctx(100)) is not None and shared.users("d") == 2  # a second copy joins the first
