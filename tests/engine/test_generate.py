"""End-to-end generation with the real default model over the paged cache."""

import pytest

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.errors import CacheFullError, ConfigError
from icekv.eval.tasks import HaystackSampler

pytestmark = pytest.mark.model


def test_capital_of_france(engine):
    out = engine.generate("The capital of France is", SamplingConfig(max_tokens=8))
    assert "Paris" in out.text
    assert out.prompt_tokens == 5 and out.new_tokens == 8 and out.finish_reason == "length"
    assert out.kv.total_bytes == out.kv.pages * engine.cache.bytes_per_page > 0


def test_needle_in_4k_tokens_of_essays_full_cache(engine, essays_text):
    sample = HaystackSampler(essays_text, engine.tokenizer).make("niah_single", 4000, seed=7, depth=0.4)
    assert 3900 <= sample.prompt_tokens <= 4000
    out = engine.generate(sample.prompt, SamplingConfig(max_tokens=12), selection=SelectionConfig(policy="full"))
    assert sample.question.answers[0] in out.text


def test_streamed_text_equals_final_text_and_stop_cuts(engine):
    pieces = []
    out = engine.generate("The capital of France is", SamplingConfig(max_tokens=16), on_text=pieces.append)
    assert "".join(pieces) == out.text
    stopped = engine.generate("The capital of France is", SamplingConfig(max_tokens=16, stop=(".",)))
    assert stopped.text == " Paris" and stopped.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(engine):
    cfg = lambda s: SamplingConfig(max_tokens=12, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True)
    a, b = engine.generate("Once upon a time", cfg(1)), engine.generate("Once upon a time", cfg(1))
    c = engine.generate("Once upon a time", cfg(2))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_bad_requests_are_refused_and_pages_returned(engine):
    free = engine.cache.pages_available
    with pytest.raises(ConfigError, match="empty"):
        engine.generate("", SamplingConfig(max_tokens=4))
    with pytest.raises(CacheFullError, match="exceeds the KV cache capacity"):
        engine.generate([1] * engine.cache.capacity_tokens, SamplingConfig(max_tokens=4))
    assert engine.cache.pages_available == free


@pytest.mark.parametrize("policy", ["full", "icecache", "quest", "snapkv"])
def test_question_over_a_prefilled_context_equals_the_whole_prompt(engine, essays_text, policy):
    """A suffix decoded over a prefilled context (the long-context eval's several questions per
    prefill) gives the tokens of the same text sent whole, and leaves the context as it was.
    SnapKV's observation window (32 queries) spans the context's end and the shorter question."""
    context = engine.tokenizer.encode(essays_text[:6000])[:900]
    questions = [engine.tokenizer.encode(" Question: who is the author? Answer:"),
                 engine.tokenizer.encode(" In one word, the topic is")]
    sampling = SamplingConfig(max_tokens=8, ignore_eos=True)
    selection = SelectionConfig(policy=policy, budget=128)
    req = engine.prefill(context)
    free_after_prefill = engine.cache.pages_available
    try:
        for q in questions * 2:  # twice: the first decodes must not have changed the context's KV
            asked = engine.decode(req, sampling, selection, suffix=q)
            whole = engine.generate(context + q, sampling, selection=selection)
            assert asked.token_ids == whole.token_ids and asked.prompt_tokens == len(context) + len(q)
            assert engine.cache.length(req.seq_id) == len(context)
            assert engine.cache.pages_available == free_after_prefill
    finally:
        engine.release(req)
