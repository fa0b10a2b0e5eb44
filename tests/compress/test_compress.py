"""KV² scoring against a slow direct computation, exact-budget eviction, physically smaller caches."""

import math
import re

import pytest
import torch

from icekv.compress import COMPRESSORS, CompressedContext, evict, make_compressor, parse_settings
from icekv.errors import ConfigError
from icekv.compress.scoring import keydiff_scores, refeed_scores, run_steps
from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.engine.compression import scoring_context
from tests.conftest import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, smollm2_dir):
    """A tiny random Qwen2 (GQA 4:2) with the real SmolLM2 tokenizer files (vocab fits)."""
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_hf_model("qwen2", path, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((smollm2_dir / name).read_bytes())
    return Engine(EngineConfig(model_dir=str(path), paging=PagingConfig(16, 2048)))


class NaiveRefeed:
    """Reference: loops over layers' heads and queries, explicit softmax, no batching. Outputs attend
    the ``visible`` context, scores come from a softmax over the ``scored`` context; with
    ``out_proj``/``inputs`` a weight is scaled by ||W_o,h v_j|| / ||h_i||."""

    def __init__(self, cache, seq_id, scored, visible=None, out_proj=None, inputs=None):
        self.cache, self.seq_id, self.scored, self.fed, self.scores = cache, seq_id, scored, {}, {}
        self.visible = scored if visible is None else visible
        self.out_proj, self.inputs = out_proj, inputs

    def _softmax(self, q, h, kv, me, allowed, ctx_k, ctx_v, fk, fv, d):
        idx = [t for t in range(len(allowed)) if allowed[t]]
        keys = [ctx_k[kv, t] for t in idx] + [fk[j][kv] for j in range(me + 1)]
        vals = [ctx_v[kv, t] for t in idx] + [fv[j][kv] for j in range(me + 1)]
        p = torch.softmax(torch.stack([q @ key / math.sqrt(d) for key in keys]), 0)
        return p, vals, idx

    def attend(self, layer, q, k, v):
        ctx_k, ctx_v = self.cache.gather_range(layer, self.seq_id, 0, len(self.scored))
        fk, fv = self.fed.setdefault(layer, ([], []))
        fk.extend(k), fv.extend(v)
        n, hq, d = q.shape
        hkv = k.shape[1]
        out = torch.zeros_like(q)
        score = self.scores.setdefault(layer, torch.zeros(hkv, len(self.scored)))
        for i in range(n):
            me = len(fk) - n + i
            for h in range(hq):
                kv = h // (hq // hkv)
                p, vals, _ = self._softmax(q[i, h], h, kv, me, self.visible, ctx_k, ctx_v, fk, fv, d)
                out[i, h] = sum(pj * vj for pj, vj in zip(p, vals))
                p, _, idx = self._softmax(q[i, h], h, kv, me, self.scored, ctx_k, ctx_v, fk, fv, d)
                for pj, t in zip(p[: len(idx)], idx):
                    if self.out_proj is not None:
                        w_h = self.out_proj[layer][:, h * d:(h + 1) * d]
                        pj = pj * (w_h @ ctx_v[kv, t]).norm() / self.inputs[layer][i].norm()
                    score[kv, t] = max(score[kv, t], pj)
        return out


@pytest.mark.parametrize("outputs_see_everything", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_refeed_scores_match_a_direct_computation(tiny_engine, outputs_see_everything, normalize):
    e = tiny_engine
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    req = e.prefill(ids)
    try:
        scored = torch.zeros(70, dtype=torch.bool)
        scored[:4] = True
        scored[30:60] = True  # sinks + one chunk, as KV² restricts each chunk's scoring
        visible = torch.ones(70, dtype=torch.bool) if outputs_see_everything else None
        fed = [ids[i] for i in (33, 41, 42, 57)]
        fast = refeed_scores(e.model, e.cache, req.seq_id, fed, list(range(70, 74)), scored, chunk=3,
                             visible=visible, normalize=normalize)
        inputs: dict[int, torch.Tensor] = {}  # the attention's input per layer (the fed tokens')
        hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].clone()))
                 for i, layer in enumerate(e.model.layers)]
        out_proj = [layer.self_attn.o_proj.weight for layer in e.model.layers] if normalize else None
        ref = NaiveRefeed(e.cache, req.seq_id, scored, visible, out_proj, inputs)
        try:
            e.model(torch.tensor(fed), torch.arange(70, 74), ref)
        finally:
            for hook in hooks:
                hook.remove()
        slow = torch.stack([ref.scores[l] for l in range(e.model.args.num_layers)])
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-6)
        assert bool((fast[..., ~scored] == 0).all())
    finally:
        e.release(req)


def _kv2_scores(engine, ids, budget, **settings):
    req = engine.prefill(ids)
    try:
        return run_steps(make_compressor("kv2", **settings).score_steps(scoring_context(engine, req.seq_id, ids, budget)))
    finally:
        engine.release(req)


def test_kv2_levers_change_what_they_claim_to(tiny_engine):
    e = tiny_engine
    ids = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(4)).tolist()
    # one chunk over the whole context: the outputs see what is scored either way
    one_chunk = {"chunk": 4096, "rho": 0.25}
    torch.testing.assert_close(_kv2_scores(e, ids, 0.1, attend="chunk", **one_chunk),
                               _kv2_scores(e, ids, 0.1, attend="context", **one_chunk))
    # several chunks: seeing the whole context changes the re-fed tokens' states, so the scores
    chunks = {"chunk": 32, "rho": 0.25}
    assert not torch.allclose(_kv2_scores(e, ids, 0.1, attend="chunk", **chunks),
                              _kv2_scores(e, ids, 0.1, attend="context", **chunks))
    # every token re-fed: the proxy has nothing left to choose
    torch.testing.assert_close(_kv2_scores(e, ids, 0.1, rho=1.0, proxy="keydiff", chunk=32),
                               _kv2_scores(e, ids, 0.1, rho=1.0, proxy="snapkv", chunk=32))
    assert not torch.allclose(_kv2_scores(e, ids, 0.1, rho=0.1, proxy="keydiff", chunk=32),
                              _kv2_scores(e, ids, 0.1, rho=0.1, proxy="snapkv", chunk=32))
    # rho_scale: 4x a 5% budget re-feeds what rho=0.2 does
    torch.testing.assert_close(_kv2_scores(e, ids, 0.05, rho_scale=4.0), _kv2_scores(e, ids, 0.05, rho=0.2))
    plain = _kv2_scores(e, ids, 0.1, normalize=False, rho_scale=1)
    normalized = _kv2_scores(e, ids, 0.1, normalize=True, rho_scale=1)
    assert bool((plain <= 1).all()) and not torch.allclose(plain, normalized)


def test_kv2_refeed_share():
    assert make_compressor("kv2").refeed_share(0.05) == pytest.approx(0.5)  # 10x the budget by default
    assert make_compressor("kv2", rho_scale=4).refeed_share(0.05) == pytest.approx(0.2)
    assert make_compressor("kv2", rho_scale=1).refeed_share(0.05) == 0.05
    assert make_compressor("kv2", rho_scale=40).refeed_share(0.05) == 1.0
    assert make_compressor("kv2", rho=0.3, rho_scale=4).refeed_share(0.05) == 0.3


def test_keydiff_is_negative_cosine_to_the_mean_direction(tiny_engine):
    e = tiny_engine
    req = e.prefill(list(range(40)))
    try:
        s = keydiff_scores(e.cache, req.seq_id, e.model.args.num_layers, chunk=4096)
        k, _ = e.cache.gather_range(1, req.seq_id, 0, 40)  # [Hkv, T, D]
        kn = torch.nn.functional.normalize(k, dim=-1)
        anchor = kn.mean(1, keepdim=True)
        expected = -torch.nn.functional.cosine_similarity(k, anchor, dim=-1)
        torch.testing.assert_close(s[1], expected, rtol=1e-5, atol=1e-5)
    finally:
        e.release(req)


def test_settings_strings_are_typed_by_the_method_fields():
    assert parse_settings("kv2", " rho_scale=4, normalize=yes,attend=context,rho=none,rounds=2 ") == {
        "rho_scale": 4.0, "normalize": True, "attend": "context", "rho": None, "rounds": 2}
    assert parse_settings("kv2", "") == {} and parse_settings("snapkv", "window=16") == {"window": 16}


@pytest.mark.parametrize("method, text, message", [
    ("kv2", "rho=2", "rho must be in (0, 1]"), ("kv2", "speed=1", "kv2 has no setting 'speed'"),
    ("kv2", "normalize=maybe", "expected bool"), ("kv2", "rounds=1.5", "expected int"),
    ("kv2", "attend=all", "attend must be one of chunk, context"), ("kv2", "proxy=oracle", "proxy must be one of"),
    ("kv2", "rho_scale", "is not NAME=VALUE"), ("kv2", "rho_scale=0", "rho_scale must be > 0"),
    ("kv2", "chunk=0", "chunk must be >= 1"), ("kv2", "n_sinks=-1", "n_sinks must be >= 0"),
    ("zip", "a=1", "unknown compression method"),
])
def test_bad_settings_are_named(method, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_settings(method, text)


@pytest.mark.parametrize("budget", [0.02, 0.1, 0.37, 1.0])
def test_global_threshold_keeps_exactly_the_budget(budget):
    scores = torch.rand(5, 3, 200, generator=torch.Generator().manual_seed(0))
    keep = evict(scores, budget)
    assert int(keep.sum()) == round(budget * scores.numel())
    assert bool(keep[..., :4].all())  # sinks
    kept_min = scores.masked_fill(~keep, float("inf"))[..., 4:].min()
    dropped_max = scores.masked_fill(keep, float("-inf"))[..., 4:].max()
    assert kept_min >= dropped_max  # one threshold for all layers and heads
    per_head = keep.sum(-1)
    if 0.1 <= budget < 1:  # (at 2% the budget is exactly the sinks)
        assert len(set(per_head.flatten().tolist())) > 1  # budgets differ per layer/head


KV2_VARIANTS = [{"rounds": 2}, {"normalize": True}, {"attend": "context", "chunk": 32}, {"proxy": "snapkv"},
                {"rho_scale": 4.0}]


@pytest.mark.parametrize("method, settings", [(m, {}) for m in sorted(COMPRESSORS)] +
                         [("kv2", s) for s in KV2_VARIANTS])
def test_full_budget_compressed_decode_equals_full_decode(tiny_engine, method, settings):
    e = tiny_engine
    ctx_ids = torch.randint(0, 512, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    question = [5, 6, 7, 8, 9]
    sampling = SamplingConfig(max_tokens=12, ignore_eos=True)
    full = e.generate(ctx_ids + question, sampling)
    ctx = e.compress(ctx_ids, method, 1.0, **settings)
    out = e.generate(question, sampling, context=ctx, selection=SelectionConfig(policy="full"))
    assert out.token_ids == full.token_ids


def test_compressed_bytes_scale_with_the_budget(tiny_engine):
    e = tiny_engine
    ids = torch.randint(0, 512, (400,), generator=torch.Generator().manual_seed(2)).tolist()
    sizes = {b: e.compress(ids, "keydiff", b) for b in (0.05, 0.25, 1.0)}
    full = sizes[1.0].full_bytes
    for b, ctx in sizes.items():
        kept = sum(map(sum, (layer.kept_per_head for layer in ctx.layers)))
        assert kept == round(b * 400 * e.model.args.num_layers * e.model.args.num_kv_heads)
        # pages are per head; at most one partly filled page per (layer, head) on top
        slack = e.model.args.num_layers * e.model.args.num_kv_heads * 16 * full / (400 * e.model.args.num_kv_heads * e.model.args.num_layers)
        assert ctx.kv_bytes <= b * full + slack
    assert sizes[0.05].kv_bytes < sizes[0.25].kv_bytes < sizes[1.0].kv_bytes


def test_compressed_context_keeps_only_kept_tokens_with_positions(tiny_engine):
    e = tiny_engine
    ids = list(range(100, 180))
    req = e.prefill(ids)
    try:
        keep = torch.zeros(e.model.args.num_layers, e.model.args.num_kv_heads, 80, dtype=torch.bool)
        keep[:, 0, [0, 5, 70]] = True
        keep[:, 1, :20] = True
        ctx = CompressedContext.from_cache(e.cache, req.seq_id, keep, "test", 0.1)
        layer = ctx.layers[1]
        assert layer.kept_per_head == [3, 20]
        assert layer.positions[layer.head_indptr[0]].tolist()[:3] == [0, 5, 70]
        k, _ = e.cache.gather_range(1, req.seq_id, 0, 80)
        torch.testing.assert_close(layer.k[0, 2], k[0, 70])
    finally:
        e.release(req)


@pytest.mark.parametrize("policy", ["icecache"])
def test_icecache_over_a_compressed_context_equals_full_when_the_budget_covers_it(tiny_engine, policy):
    from icekv.config.selection import SelectionConfig

    e = tiny_engine
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    ctx = e.compress(ids, "keydiff", 0.5)
    question = list(range(20, 60))  # 40 tokens + 30 new: the window flushes own pages into the index
    sampling = SamplingConfig(max_tokens=30, ignore_eos=True)
    dense = e.generate(question, sampling, context=ctx, selection=SelectionConfig(policy="full"))
    wide = SelectionConfig(policy=policy, budget=2048, n_unlimited_layers=1)
    sparse = e.generate(question, sampling, context=ctx, selection=wide)
    assert sparse.token_ids == dense.token_ids and sparse.kv.bytes_moved > 0


def test_small_budget_over_a_compressed_context_selects_and_stays_bounded(tiny_engine):
    from icekv.config.selection import SelectionConfig

    e = tiny_engine
    ids = torch.randint(0, 512, (600,), generator=torch.Generator().manual_seed(8)).tolist()
    ctx = e.compress(ids, "keydiff", 0.5)
    sel = SelectionConfig(policy="icecache", budget=64, n_unlimited_layers=0)
    out = e.generate(list(range(10, 50)), SamplingConfig(max_tokens=20, ignore_eos=True), context=ctx, selection=sel)
    assert out.new_tokens == 20 and 0 < out.kv.resident_bytes < ctx.kv_bytes
    for policy in ("quest", "streaming", "icecache_r"):
        with pytest.raises(Exception, match="cannot select over a compressed context"):
            e.generate([1, 2], SamplingConfig(max_tokens=2), context=ctx, selection=SelectionConfig(policy=policy, budget=64))
