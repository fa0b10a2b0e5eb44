"""The engine compiles its numba loops at load: a request's decode compiles nothing more."""

import pytest

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.index import dci_tree, device_rescoring, fused_search, lsh, page_store, tree_walk
from icekv.kernels import cpu_decode
from icekv.kv import device_cache, token_rows
from icekv.model import linear


def _signatures() -> dict:
    loops = {"candidates": fused_search._candidates, "rescore": fused_search._rescore,
             "picks": fused_search.union_of_picks, "merge picks": fused_search._interleave_heads,
             "rescoring plan": device_rescoring._plan, "rescoring gather": device_rescoring._gather_keys,
             "placement": dci_tree.place_tokens, "parents": dci_tree.append_tokens, "rewrite": page_store._rewrite,
             "walk": tree_walk.walk_scores, "positions": page_store._positions,
             "plan": device_cache._plan_slots, "fill": device_cache._fill, "gather": token_rows.copy_rows,
             "attention": cpu_decode._decode, "linear": linear._weight_rows_by_four}
    return {name: list(f.signatures) for name, f in loops.items()}


@pytest.mark.parametrize("search", ["centroids", "walk"])
@pytest.mark.parametrize("score_dtype", ["float32", "bfloat16", "int8"])
def test_a_sparse_decode_after_engine_load_compiles_nothing(engine, essays_text, score_dtype, search):
    before = _signatures()
    assert all(before.values())  # every loop was compiled at load
    sel = SelectionConfig(policy="icecache", budget=64, n_unlimited_layers=1,
                          icecache=IceCacheConfig(search=search, score_dtype=score_dtype))
    prompt = engine.tokenizer.encode(essays_text)[:700]
    out = engine.generate(prompt, SamplingConfig(max_tokens=24, ignore_eos=True), selection=sel)
    assert out.new_tokens == 24 and out.timings["insert_s"] > 0  # window pages were flushed into the index
    assert out.kv.pages_moved > 0  # pages went through the plan and the row gather
    assert _signatures() == before


def test_a_magicpig_decode_after_engine_load_compiles_no_hashing_loop(engine, essays_text):
    loops = (lsh._pack_signs, lsh._count)
    before = [list(f.signatures) for f in loops]
    assert all(before)  # compiled at load
    prompt = engine.tokenizer.encode(essays_text)[:700]
    out = engine.generate(prompt, SamplingConfig(max_tokens=24, ignore_eos=True),
                          selection=SelectionConfig(policy="magicpig", budget=64))
    assert out.new_tokens == 24 and out.timings["insert_s"] > 0  # tokens leaving the window were hashed too
    assert [list(f.signatures) for f in loops] == before


def _lead(step: dict) -> float:
    """How far a step's most likely token leads its runner-up, in nats."""
    top, runner_up = (choice["logprob"] for choice in step["top_logprobs"][:2])
    return top - runner_up


def _steps_before_a_near_tie(got, reference, tie_nats: float, logprob_nats: float) -> int:
    """Two greedy decodes of one prompt (``logprobs`` >= 2) agree step by step: the same token,
    its log-probability within ``logprob_nats``, until a step where either decode's two most likely
    tokens lie within ``tie_nats`` (rounding may pick either, and the decodes part there); at that
    step each picks a token the reference ranks within ``tie_nats + logprob_nats`` of its top.
    Returns the steps before it (all of them where no near-tie comes)."""
    for step, (mine, theirs) in enumerate(zip(got.logprobs, reference.logprobs)):
        if min(_lead(mine), _lead(theirs)) <= tie_nats:
            top = theirs["top_logprobs"][0]["logprob"]
            near = {choice["token_id"] for choice in theirs["top_logprobs"]
                    if top - choice["logprob"] <= tie_nats + logprob_nats}
            assert {mine["token_id"], theirs["token_id"]} <= near, (step, mine, theirs)
            return step
        assert mine["token_id"] == theirs["token_id"], (step, mine, theirs)
        assert abs(mine["logprob"] - theirs["logprob"]) <= logprob_nats, (step, mine, theirs)
    return len(reference.logprobs)


@pytest.mark.model
def test_a_bf16_engine_decodes_through_the_compiled_kernel_and_compiles_nothing(smollm2_dir, essays_text,
                                                                                 monkeypatch):
    """Under a bf16 compute dtype the sparse decode reads sink, window and slots as bf16 words in
    place (the int16 variant, compiled at load), and decodes as the torch path does: the same
    tokens, each within bf16's rounding in log-probability, up to the first near-tie."""
    from icekv.config.engine import EngineConfig
    from icekv.engine import Engine

    engine = Engine(EngineConfig(model_dir=str(smollm2_dir), dtype="bfloat16"))
    before = _signatures()
    assert any("int16" in str(signature) for signature in before["attention"])
    sel = SelectionConfig(policy="icecache", budget=64, n_unlimited_layers=1)
    prompt = engine.tokenizer.encode(essays_text)[:700]
    sampling = SamplingConfig(max_tokens=16, ignore_eos=True, logprobs=4)
    out = engine.generate(prompt, sampling, selection=sel)
    assert out.new_tokens == 16 and _signatures() == before
    monkeypatch.setenv("ICEKV_KERNELS", "torch")  # the tail on the side, attention by the torch reference
    reference = engine.generate(prompt, sampling, selection=sel)
    assert _steps_before_a_near_tie(out, reference, tie_nats=0.25, logprob_nats=0.15) >= 3
