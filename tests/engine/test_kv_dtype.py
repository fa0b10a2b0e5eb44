"""Quantized KV pages with the real model: the model's predictions stay close to those over the
model-dtype pool, requests batched give what each gives alone, a stored int8 context answers like
its in-memory twin, and the same pool bytes admit several times the tokens."""

from dataclasses import replace

import pytest
import torch

from icekv.config.engine import EngineConfig, SchedulerConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.eval.tasks import HaystackSampler
from tests.engine.test_batching import GREEDY, alone_tokens, context_questions, run_joining
from tests.engine.test_compile_loops import _signatures

pytestmark = pytest.mark.model

QUANTIZED = ("int8", "fp8_e4m3")


@pytest.fixture(scope="module")
def engines(smollm2_dir):
    """One engine per quantized format (the model-dtype one is the session's ``engine``)."""
    return {kv: Engine(EngineConfig(model_dir=str(smollm2_dir), paging=PagingConfig(kv_dtype=kv,
                                                                                    pool_tokens=8192)))
            for kv in QUANTIZED}


@pytest.mark.parametrize("kv_dtype,mean_gap,same_share,clear_lead",
                         [("int8", 0.06, 0.96, 0.5), ("fp8_e4m3", 0.15, 0.92, 0.75)])
def test_next_token_predictions_follow_the_model_dtype_pool(engine, engines, essays_text, kv_dtype, mean_gap,
                                                            same_share, clear_lead):
    """Every position of a 1,000-token prompt scored (its prefill reads back the quantized K/V of
    the chunks before and of its own): the log-probability of the text's next token stays within
    ``mean_gap`` nats on average; the most likely token is the same wherever the model-dtype pool's
    leads its runner-up by ``clear_lead`` nats (quantization noise may only swap near-tied tokens),
    and at ``same_share`` of all positions (e4m3 keeps 3 mantissa bits against int8's 7 bits per
    row's scale: it strays more, and moves a few positions' log-probabilities by over half a nat)."""
    ids = engine.tokenizer.encode(essays_text)[:1000]
    scored = SamplingConfig(max_tokens=1, prompt_logprobs=2)
    ref = engine.generate(ids, scored).prompt_logprobs[1:]
    got = engines[kv_dtype].generate(ids, scored).prompt_logprobs[1:]
    gap = torch.tensor([abs(a["logprob"] - b["logprob"]) for a, b in zip(ref, got)])
    assert 0 < gap.mean() <= mean_gap  # above 0: the pool does quantize
    same_top = [a["top_logprobs"][0]["token_id"] == b["top_logprobs"][0]["token_id"] for a, b in zip(ref, got)]
    lead = [a["top_logprobs"][0]["logprob"] - a["top_logprobs"][1]["logprob"] for a in ref]
    clear = [same for same, nats in zip(same_top, lead) if nats >= clear_lead]
    assert len(clear) > len(ref) / 2 and all(clear), (sum(clear), len(clear))
    assert sum(same_top) / len(ref) >= same_share, (sum(same_top), float(gap.mean()))


@pytest.mark.parametrize("kv_dtype,least_cosine", [("int8", 0.999), ("fp8_e4m3", 0.995)])
def test_short_prompts_logits_and_greedy_tokens_follow_the_model_dtype_pool(engine, engines, essays_text, kv_dtype,
                                                                           least_cosine):
    """Six 200-token prompts: the next-token logits after each (its prefill reads back the
    quantized K/V) keep a cosine of ``least_cosine`` to the model-dtype pool's and the same top
    token; greedy continuations of 16 tokens agree for half their length on average (they part
    where two tokens are near-tied, and then continue differently)."""
    ids = engine.tokenizer.encode(essays_text)
    prompts = [ids[i * 600: i * 600 + 200] for i in range(6)]
    agreed = []
    for prompt in prompts:
        a, b = engine.prefill(prompt), engines[kv_dtype].prefill(prompt)
        assert torch.nn.functional.cosine_similarity(a.logits.float(), b.logits.float(), 0) >= least_cosine
        assert a.logits.argmax() == b.logits.argmax()
        engine.release(a), engines[kv_dtype].release(b)
        ta = engine.generate(prompt, SamplingConfig(max_tokens=16, ignore_eos=True)).token_ids
        tb = engines[kv_dtype].generate(prompt, SamplingConfig(max_tokens=16, ignore_eos=True)).token_ids
        agreed.append(next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), 16))
    assert sum(agreed) / len(agreed) >= 8, agreed


NEEDLE_POLICIES = ("full", "icecache")


@pytest.fixture(scope="module")
def needle(engine, essays_text):
    """A needle context, and the model-dtype pool's answer to it under each policy (asked once,
    compared with every quantized format's)."""
    sample = HaystackSampler(essays_text, engine.tokenizer).make("niah_single", 3000, seed=7, depth=0.4)
    return sample, {policy: engine.generate(sample.prompt, SamplingConfig(max_tokens=12),
                                            selection=SelectionConfig(policy=policy, budget=128))
                    for policy in NEEDLE_POLICIES}


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("policy", NEEDLE_POLICIES)
def test_a_needle_is_found_as_with_the_model_dtype_pool(engines, needle, kv_dtype, policy):
    sample, refs = needle
    ref = refs[policy]
    got = engines[kv_dtype].generate(sample.prompt, SamplingConfig(max_tokens=12),
                                     selection=SelectionConfig(policy=policy, budget=128))
    assert sample.question.answers[0] in ref.text and sample.question.answers[0] in got.text
    assert got.kv.total_bytes < 0.3 * ref.kv.total_bytes  # 68 bytes a row against fp32's 256
    if policy == "icecache":
        assert 0 < got.kv.bytes_moved < 0.3 * ref.kv.bytes_moved + got.kv.bytes_moved / got.kv.pages_moved


def test_quantized_requests_batched_equal_each_alone_and_free_their_pages(engines, essays_text):
    """Batched with requests that join mid-decode, full, icecache, quest and two requests over a
    compressed context give their greedy tokens alone. MagicPIG runs in the same batch but is only
    checked to finish: its sampled set (LSH collisions) is discontinuous in the keys, and over int8
    rows it was seen to change a late token with the batch around it (not over fp32 or fp8 rows)."""
    engine = engines["int8"]
    words = essays_text.split()
    prompts = [" ".join(words[i * 41 : i * 41 + n]) for i, n in enumerate((400, 150, 520, 260))]
    context = engine.compress(engine.tokenizer.encode(" ".join(words[3000:3300])), "keydiff", 0.5)
    requests = [dict(prompt=p, selection=SelectionConfig(policy=pol, budget=64))
                for p, pol in zip(prompts, ("full", "icecache", "quest", "magicpig"))]
    requests += context_questions(context)
    alone = alone_tokens(engine, requests)
    free = engine.cache.pages_available
    seqs = run_joining(engine, requests, 3, 3)  # the others join while the first three decode
    assert all(s.error is None for s in seqs)
    exact = [i for i, r in enumerate(requests) if r["selection"].policy != "magicpig"]
    assert [seqs[i].result.token_ids for i in exact] == [alone[i] for i in exact]
    assert engine.cache.pages_available == free


def test_a_stored_int8_context_answers_like_its_twin(engine, engines, essays_text, tmp_path):
    """Compressed once over an int8 pool, stored, loaded back: the same answer as the context in
    memory (the rows are stored as they are), the answer the fp32 engine's twin gives, in about a
    quarter of its bytes."""
    from icekv.store import ContextStore

    sample = HaystackSampler(essays_text, engine.tokenizer).make("niah_single", 1500, seed=3, depth=0.5)
    cut = sample.prompt.rindex("What is the special magic number")
    context_ids, question = engine.tokenizer.encode(sample.prompt[:cut]), sample.prompt[cut:]
    answers = {}
    for name, eng in (("auto", engine), ("int8", engines["int8"])):
        ctx = eng.compress(context_ids, "kv2", 0.25)
        store = ContextStore.open(str(tmp_path / name), eng.model_id)
        key = store.key(context_ids, "kv2", 0.25)
        stored = store.save(key, ctx)
        loaded = store.load(key)
        assert loaded.kv_dtype == ctx.kv_dtype == name
        text = eng.generate(question, SamplingConfig(max_tokens=12), context=loaded).text
        assert text == eng.generate(question, SamplingConfig(max_tokens=12), context=ctx).text
        answers[name] = (text, stored)
    assert sample.question.answers[0] in answers["auto"][0] and sample.question.answers[0] in answers["int8"][0]
    assert answers["int8"][1] < 0.35 * answers["auto"][1]


@pytest.mark.parametrize("dtype,kv_dtype,model_tokens,alone,quantized", [
    ("float32", "int8", 512, 1, 6),  # 68 bytes a row against 256: 1,920 tokens in the bytes of 512
    ("bfloat16", "fp8_e4m3", 1024, 3, 6),  # 68 against 128: 1,920 tokens in the bytes of 1,024
])
def test_the_same_pool_bytes_admit_about_twice_or_four_times_the_tokens(smollm2_dir, dtype, kv_dtype, model_tokens,
                                                                        alone, quantized):
    """A pool of the bytes that hold ``model_tokens`` tokens in the model's dtype, then as
    quantized rows: requests of 308 tokens run ``alone`` then ``quantized`` at once."""
    def running_at_once(kv: str, tokens: int) -> int:
        engine = Engine(EngineConfig(model_dir=str(smollm2_dir), dtype=dtype, paging=PagingConfig(16, tokens, kv_dtype=kv),
                                     selection=SelectionConfig(policy="full"),  # the pool's rows alone charged
                                     scheduler=SchedulerConfig(max_queue_wait_s=3600)))  # bf16 on a CPU is slow
        seqs = [engine.submit([i + 1] * 300, replace(GREEDY, max_tokens=8)) for i in range(8)]
        engine.step()
        n = len(engine.scheduler.running)
        while not all(s.done for s in seqs):
            engine.step()
        assert all(s.error is None for s in seqs)
        return n

    element = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    pool_bytes = model_tokens * 30 * 2 * 3 * 64 * element  # SmolLM2: 30 layers, 3 KV heads, head dim 64
    quantized_tokens = pool_bytes // (30 * 2 * 3 * 68) // 16 * 16
    assert quantized_tokens == 1920
    assert running_at_once("auto", model_tokens) == alone
    assert running_at_once(kv_dtype, quantized_tokens) == quantized


def test_a_quantized_decode_after_engine_load_compiles_nothing(engines, essays_text):
    """The engine compiled its loops for its own format: a decode under full attention (the batched
    kernel) and under icecache (slots, the pool tail) compiles nothing more."""
    engine = engines["fp8_e4m3"]
    before = _signatures()
    prompt = engine.tokenizer.encode(essays_text)[:700]
    for policy in ("full", "icecache"):
        out = engine.generate(prompt, SamplingConfig(max_tokens=24, ignore_eos=True),
                              selection=SelectionConfig(policy=policy, budget=64))
        assert out.new_tokens == 24
    assert _signatures() == before
