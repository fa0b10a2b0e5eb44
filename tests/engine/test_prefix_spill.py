"""The prefix cache's lower tier on the real model: cached pages are written to a store as they join
the cache; after the pool evicted them, or in a new engine over the same store (a restart, a
replica), a prompt's chain is read back from it and decodes the same tokens as a full prefill; a
corrupted stored page is refused, deleted and prefilled again (then written again), never served."""

import pytest
import torch

from icekv.config.engine import EngineConfig
from icekv.config.request import PromptCaching, SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.kv.prefix_cache import page_keys
from icekv.kv.prefix_tier import PrefixTier
from icekv.store import LocalStore
from icekv.store.prefix_pages import PrefixPageStore, page_key

pytestmark = pytest.mark.model
SAMPLING = SamplingConfig(max_tokens=10, ignore_eos=True)
FULL = SelectionConfig(policy="full")


def _spilling(smollm2_dir, root) -> tuple[Engine, PrefixPageStore]:
    engine = Engine(EngineConfig(model_dir=str(smollm2_dir)))
    pool = engine.cache.pool  # [L, 2, Hkv, pages, P, W]
    pages = PrefixPageStore(LocalStore(root), engine.model_id, pool.shape[:3] + pool.shape[4:], pool.dtype)
    engine.cache.prefix.lower = PrefixTier(engine.cache, pages)
    return engine, pages


def _evict_all(engine) -> None:
    engine.cache.allocator.free(engine.cache.prefix.evict(engine.cache.allocator.num_pages))
    assert engine.cache.prefix.pages == 0


@pytest.fixture(scope="module")
def conversation(smollm2_dir, essays_text, tmp_path_factory):
    """Turn 1 run on a spilling engine, its pages then evicted; turn 2's prompt."""
    root = tmp_path_factory.mktemp("spill")
    engine, pages = _spilling(smollm2_dir, root)
    encode = engine.tokenizer.encode
    first = encode(essays_text[:6000])[:1000] + encode(" Question: what is this about? Answer:")
    turn1 = engine.generate(first, SAMPLING, selection=FULL)
    pages.flush()
    second = first + turn1.token_ids + encode(" And who wrote it? Answer:")
    kept = (len(first) + len(turn1.token_ids) - 1) // 16  # full attention caches the answer's pages too
    assert pages.stats.written == engine.cache.prefix.pages == kept
    _evict_all(engine)
    expected = engine.run(engine.submit(second, SAMPLING, FULL, caching=PromptCaching(enabled=False)))
    return engine, pages, root, second, kept, expected


def test_evicted_pages_come_back_from_the_store(conversation):
    engine, pages, _, second, kept, expected = conversation
    loaded = pages.stats.loaded
    again = engine.generate(second, SAMPLING, selection=FULL)
    assert again.cached_tokens == kept * 16 and pages.stats.loaded == loaded + kept
    assert again.token_ids == expected.token_ids
    assert engine.cache.prefix.stats.reloaded_pages >= kept
    _evict_all(engine)


def test_a_new_engine_over_the_store_starts_where_the_last_one_stopped(conversation, smollm2_dir):
    _, _, root, second, kept, expected = conversation
    engine, pages = _spilling(smollm2_dir, root)
    again = engine.generate(second, SAMPLING, selection=FULL)
    assert again.cached_tokens >= kept * 16 and pages.stats.loaded == again.cached_tokens // 16
    assert again.token_ids == expected.token_ids


def test_a_corrupted_page_is_refused_and_prefilled_again(conversation):
    engine, pages, root, second, kept, expected = conversation
    _evict_all(engine)
    chain = page_keys(engine.cache.prefix.model_id, second, 16)[kept // 2]  # a page in the middle of the chain
    path = root / f"{page_key(chain)}.ctx"
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x5A
    path.write_bytes(bytes(blob))
    refused = pages.stats.refused
    again = engine.generate(second, SAMPLING, selection=FULL)
    assert again.cached_tokens == kept // 2 * 16  # the chain up to the bad page
    assert pages.stats.refused == refused + 1
    assert again.token_ids == expected.token_ids
    pages.flush()  # the page prefilled again was written again, whole
    assert pages.load(chain) is not None and pages.stats.refused == refused + 1


def test_a_prefill_kept_for_decodes_reads_its_context_back_when_asked(conversation, smollm2_dir, essays_text):
    """A prefill under full attention with caching on takes the store's pages (a new engine over
    it: another evaluation run) and decodes as one prefilled in full; by default, and under a
    sparse selection (its index is built from the prompt's pass), it prefills every token."""
    _, _, root, _, _, _ = conversation
    writer, written = _spilling(smollm2_dir, root)
    context = writer.tokenizer.encode(essays_text[8000:16000])[:700]
    suffix = writer.tokenizer.encode(" Question: what is this about? Answer:")
    first = writer.prefill(context, caching=PromptCaching())
    expected = writer.decode(first, SAMPLING, FULL, suffix=suffix)
    writer.release(first)
    written.close()
    assert written.stats.written >= len(context) // 16

    reader, pages = _spilling(smollm2_dir, root)
    plain = reader.prefill(context)  # caching off by default: every token through the model
    assert reader.cache.prefix.stats.hit_tokens == 0 and pages.stats.loaded == 0
    reader.release(plain)
    sparse = reader.prefill(context, selection=SelectionConfig(policy="icecache", budget=128),
                            caching=PromptCaching())
    assert reader.cache.prefix.stats.hit_tokens == 0 and pages.stats.loaded == 0
    reader.release(sparse)
    again = reader.prefill(context, caching=PromptCaching())
    whole = (len(context) - 1) // 16
    assert reader.cache.prefix.stats.hit_tokens == again.cached_tokens == whole * 16 and pages.stats.loaded == whole
    assert reader.decode(again, SAMPLING, FULL, suffix=suffix).token_ids == expected.token_ids
    for _ in range(2):  # decodes leave the prompt's shared pages as they were
        out = reader.decode(again, SAMPLING, SelectionConfig(policy="icecache", budget=128), suffix=suffix)
    assert out.token_ids == reader.decode(again, SAMPLING, SelectionConfig(policy="icecache", budget=128),
                                          suffix=suffix).token_ids
    reader.release(again)
    assert reader.cache.pages_available == reader.cache.allocator.num_pages


def test_a_store_that_waits_when_full_writes_every_page(tmp_path):
    """Past MAX_PENDING pages waiting, a server's store skips a page (its step never waits); one
    made to wait writes every page."""
    import threading

    from icekv.store import prefix_pages

    gate = threading.Event()

    class SlowStore(LocalStore):
        def put(self, key, blob):
            gate.wait()
            super().put(key, blob)

    rows = torch.zeros(2, 2, 1, 16, 8)
    for wait, root in ((False, tmp_path / "skip"), (True, tmp_path / "wait")):
        gate.clear()
        pages = PrefixPageStore(SlowStore(root), "m", tuple(rows.shape), rows.dtype, wait_when_full=wait)
        n = prefix_pages.MAX_PENDING + 3
        saver = threading.Thread(target=lambda: [pages.save(bytes([i % 256, i // 256]) * 8, rows) for i in range(n)])
        saver.start()
        saver.join(timeout=2)
        assert saver.is_alive() == wait  # waiting for room, or done having skipped 3
        gate.set()
        saver.join()
        pages.close()
        assert (pages.stats.written, pages.stats.failed) == ((n, 0) if wait else (n - 3, 3))
