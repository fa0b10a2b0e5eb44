"""The baselines' selectors and estimators against plain references, over awkward shapes."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from icekv.attention.sampled import attention_lse, merge_lse
from icekv.index.lsh import simhash
from icekv.methods.arkvale import ArkValeConfig
from icekv.methods.magicpig import MagicPIGConfig
from icekv.methods.omnikv import OmniKVConfig
from icekv.methods.pqcache import PQCacheConfig
from icekv.methods.snapkv import SnapKVConfig
from icekv.methods.arkvale import ArkValeSelector, digest_scores, digest_scores_reference, page_digests
from icekv.methods.magicpig import MagicPIGSelector, Samples, hyperplanes, sample_log_weights, sampling_probability
from icekv.methods.omnikv import OmniKVSelector, filter_scores
from icekv.methods.pqcache import PQCacheSelector, estimate, estimate_reference, kmeans, nearest
from icekv.methods.snapkv import window_votes
from icekv.methods.tokens import TokenPages, top_tokens


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- token selections as virtual pages
def test_token_pages_cut_each_head_in_order_and_name_pages_by_content():
    pages = TokenPages(4)
    sel = pages.select(0, [np.array([3, 5, 9, 10, 11]), np.zeros(0, np.int64), np.array([1, 2])])
    assert sel.heads.tolist() == [0, 0, 2] and torch.equal(sel.pages, sel.versions)
    assert pages.positions(0, sel.heads, sel.pages).tolist() == [[3, 5, 9, 10], [11, -1, -1, -1], [1, 2, -1, -1]]
    again = pages.select(1, [np.array([1, 2]), np.array([3, 5, 9, 10, 12]), np.zeros(0, np.int64)])
    assert again.pages[0] == sel.pages[2] and again.pages[1] == sel.pages[0]  # same tokens, same page
    assert again.pages[2] not in sel.pages.tolist()  # other tokens: another page
    assert pages.positions(1, again.heads, again.pages).tolist() == [[1, 2, -1, -1], [3, 5, 9, 10], [12, -1, -1, -1]]
    empty = pages.select(2, [np.zeros(0, np.int64)] * 2)
    assert len(empty.pages) == 0 and pages.positions(2, empty.heads, empty.pages).shape == (0, 4)


def test_top_tokens_keeps_the_best_in_sequence_order_and_never_a_minus_inf():
    scores = torch.tensor([[1.0, 5.0, 3.0, float("-inf")], [0.0, float("inf"), float("-inf"), float("-inf")]])
    best = top_tokens(scores, 3)
    assert best[0].tolist() == [0, 1, 2] and best[1].tolist() == [0, 1]
    assert [len(x) for x in top_tokens(scores[:, :0], 3)] == [0, 0]


# ---- ArkVale
@pytest.mark.parametrize("hkv,group,groups,n", [(2, 3, 1, 7), (2, 3, 2, 1), (4, 1, 2, 0), (1, 4, 1, 5)])
def test_arkvale_scores_equal_the_dimensionwise_reference(hkv, group, groups, n):
    keys = _rand(hkv, n, 16, 8, seed=n)  # [Hkv, n, P, D]
    upper, lower = page_digests(keys)
    assert bool((upper >= lower).all())
    q = _rand(hkv * group, 8, seed=1)
    torch.testing.assert_close(digest_scores(q, upper, lower, groups), digest_scores_reference(q, upper, lower, groups))


def test_arkvale_digest_is_the_box_shrunk_to_the_mean_spread():
    page = torch.tensor([[[0.0], [1.0], [4.0]]])[None]  # one head, one page of 3 keys, D = 1
    upper, lower = page_digests(page)
    centre, spread = 2.0, (2 + 1 + 2) / 3
    assert upper.item() == pytest.approx(centre + spread) and lower.item() == pytest.approx(centre - spread)


def test_arkvale_keeps_the_best_resident_pages_and_finds_the_hot_one():
    sel = ArkValeSelector(page_size=4, config=ArkValeConfig(topk_share=0.5))
    keys = _rand(2, 64, 8, seed=2) * 0.1
    q = torch.zeros(4, 8)
    q[:, 0] = 1.0
    keys[:, 20, 0] = 10.0  # page 5 is hot for both KV heads
    sel.build(0, keys, 0)
    first = sel.select(0, q, 4)
    assert first.per_head(2)[0][0].item() == 5
    assert len(first.per_head(2)[0]) == 4
    q2 = torch.zeros(4, 8)
    q2[:, 1] = 1.0
    resident = first.per_head(2)[0]
    second = sel.select(0, q2, 4).per_head(2)[0]  # 2 from the ranking, then the 2 best residents
    scores = digest_scores(q2, sel.upper[0], sel.lower[0], 1)[0]
    fresh = scores.topk(2).indices
    assert second[:2].tolist() == fresh.tolist()
    rest = resident[~torch.isin(resident, fresh)]
    assert second[2:].tolist() == rest[scores[rest].argsort(descending=True)][:2].tolist()


# ---- PQCache
@pytest.mark.parametrize("hkv,group,n,m", [(2, 3, 50, 2), (1, 1, 1, 2), (2, 2, 300, 4)])
def test_pq_estimate_equals_q_dot_the_decoded_keys(hkv, group, n, m):
    sel = PQCacheSelector(page_size=16, config=PQCacheConfig(sub_vectors=m, sub_bits=4, kmeans_iters=3))
    keys = _rand(hkv, n, 16, seed=n)
    sel.build(0, keys, 0)
    q = _rand(hkv * group, 16, seed=3)
    est = estimate(q, sel.centroids[0], sel.codes[0])
    torch.testing.assert_close(est, estimate_reference(q, sel.centroids[0], sel.codes[0]), rtol=1e-5, atol=1e-5)
    if n <= 16:  # as many centroids as keys: the codes are exact
        exact = torch.einsum("hd,hnd->hn", q, keys.repeat_interleave(group, 0))
        torch.testing.assert_close(est, exact, rtol=1e-5, atol=1e-5)


def test_kmeans_finds_the_clumps():
    x = torch.cat([_rand(1, 200, 4, seed=4) + c for c in (-5.0, 0.0, 5.0)], 1)  # three clumps
    done = kmeans(x, 3, iters=20, seed=0)
    assert sorted(done[0, :, 0].round().tolist()) == [-5.0, 0.0, 5.0]  # one centroid per clump
    assert torch.equal(nearest(x, done)[0].view(3, 200), nearest(x, done)[0].view(3, 200)[:, :1].expand(3, 200))


def test_pqcache_recent_share_is_always_selected():
    sel = PQCacheSelector(page_size=4, config=PQCacheConfig(recent_ratio=0.5, kmeans_iters=2))
    sel.build(0, _rand(2, 200, 8, seed=5), base=32)
    chosen = sel.select(0, _rand(4, 8, seed=6), 4)  # 16 tokens: 8 recent
    positions = sel.page_positions(0, chosen.heads, chosen.pages)
    for h in range(2):
        mine = positions[chosen.heads == h].flatten()
        assert set(range(32 + 192, 32 + 200)) <= set(mine.tolist()) and (mine >= 0).sum() == 16


# ---- OmniKV
def test_omnikv_scores_take_the_max_over_every_query_head():
    keys, q = _rand(2, 30, 8, seed=7), _rand(6, 8, seed=8)
    ref = torch.stack([q[h] @ keys[h // 3].T / math.sqrt(8) for h in range(6)]).amax(0)
    torch.testing.assert_close(filter_scores(q, keys), ref)


def test_omnikv_budgeted_layers_attend_the_latest_filters_tokens():
    sel = OmniKVSelector(page_size=4)
    keys = _rand(2, 40, 8, seed=9) * 0.1
    keys[1, 7, 0] = 9.0
    sel.build(1, keys, base=16)
    q = torch.zeros(4, 8)
    q[:, 0] = 1.0
    sel.observe(1, q)
    chosen = sel.select(2, _rand(4, 8), 1)
    positions = sel.page_positions(2, chosen.heads, chosen.pages)
    assert all(16 + 7 in row.tolist() for row in positions)  # one set, every KV head
    assert OmniKVConfig().filters(32) == (2, 8, 18) and OmniKVConfig().filters(24) == (2, 6, 14)
    assert sorted(OmniKVConfig().dense_layers(32)) == [0, 1, 2, 3, 8, 9, 18, 19]


def test_omnikv_each_filter_resets_the_choice_and_none_before_the_first_raises():
    sel = OmniKVSelector(page_size=4)
    with pytest.raises(ValueError, match="no filter layer"):
        sel.select(2, torch.zeros(4, 8), 1)
    for layer, hot in ((1, 3), (4, 30)):
        keys = _rand(2, 40, 8, seed=layer) * 0.1
        keys[0, hot, 0] = 9.0
        sel.build(layer, keys, base=0)
    q = torch.zeros(4, 8)
    q[:, 0] = 1.0
    for layer, hot in ((1, 3), (4, 30)):  # one step: filter 1, its layers, filter 4, its layers
        sel.observe(layer, q)
        chosen = sel.select(layer + 1, q, 1)
        assert hot in sel.page_positions(layer + 1, chosen.heads, chosen.pages)[0].tolist()


# ---- SnapKV
@pytest.mark.parametrize("w,t,group", [(4, 20, 2), (1, 9, 1), (6, 6, 3)])
def test_snapkv_votes_equal_a_loop_over_heads(w, t, group):
    hkv, d = 2, 8
    q, keys = _rand(w, hkv * group, d, seed=10), _rand(hkv, t, d, seed=11)
    votes = window_votes(q, keys, kernel=3)
    ref = torch.zeros(hkv, t)
    for h in range(hkv * group):
        total = torch.zeros(t)
        for i in range(w):
            pos = t - w + i
            s = keys[h // group, : pos + 1] @ q[i, h] / math.sqrt(d)
            total[: pos + 1] += s.softmax(0)
        pooled = F.avg_pool1d(total[None, None], 3, 1, padding=1, count_include_pad=False)[0, 0]
        ref[h // group] += pooled / group
    torch.testing.assert_close(votes, ref, rtol=1e-5, atol=1e-6)
    assert SnapKVConfig().window == 32 and SnapKVConfig().kernel == 5


# ---- MagicPIG
def test_simhash_packs_each_tables_signs():
    cfg = MagicPIGConfig(bits=3, tables=4)
    planes = hyperplanes(8, cfg)
    x = _rand(5, 8, seed=12)
    codes = simhash(x, planes, 3)
    signs = (x @ planes > 0).int()
    ref = torch.stack([(signs[:, j * 3:(j + 1) * 3] * torch.tensor([1, 2, 4])).sum(-1) for j in range(4)], -1)
    assert torch.equal(codes.int(), ref)


@pytest.mark.parametrize("min_collisions", [1, 2, 3])
def test_sampling_probability_matches_the_frequency_of_collisions(min_collisions):
    cfg = MagicPIGConfig(bits=2, tables=6, min_collisions=min_collisions)
    q, k = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.6, 0.8, 0.0, 0.0])  # cos 0.6
    trials, hits = 4000, 0
    for seed in range(trials):
        planes = hyperplanes(4, MagicPIGConfig(bits=2, tables=6, seed=seed))
        hits += int((simhash(q, planes, 2) == simhash(k, planes, 2)).sum() >= min_collisions)
    p = sampling_probability(torch.tensor(0.6), cfg).item()
    assert abs(hits / trials - p) < 4 * math.sqrt(p * (1 - p) / trials) + 1e-3
    if min_collisions == 2:  # the authors' closed form
        one = (1 - math.acos(0.6) / math.pi) ** 2
        assert p == pytest.approx(1 - (1 - one) ** 6 - 6 * one * (1 - one) ** 5, rel=1e-5)


def test_split_softmax_merged_by_lse_equals_the_whole():
    q, k, v = _rand(3, 8, seed=13), _rand(3, 20, 8, seed=14), _rand(3, 20, 8, seed=15)
    whole, _ = attention_lse(q, k, v)
    a, la = attention_lse(q, k[:, :7], v[:, :7])
    b, lb = attention_lse(q, k[:, 7:], v[:, 7:])
    torch.testing.assert_close(merge_lse(a, la, b, lb), whole)
    empty, le = attention_lse(q, k[:, :0], v[:, :0])
    assert bool(torch.isinf(le).all()) and torch.equal(empty, torch.zeros(3, 8))
    torch.testing.assert_close(merge_lse(whole, _, empty, le), whole)  # nothing sampled: the exact part alone


def test_magicpig_caps_the_samples_and_scales_their_share():
    cfg = MagicPIGConfig(bits=2, tables=8, min_collisions=2)
    sel = MagicPIGSelector(config=cfg)
    keys, q = _rand(2, 100, 8, seed=16), _rand(4, 8, seed=17)
    sel.build(0, keys, base=10)
    centred = keys - keys.mean(1, keepdim=True)
    collided = [int(((simhash(centred[h // 2], sel.planes, 2) == simhash(q[h], sel.planes, 2)).sum(-1) >= 2).sum())
                for h in range(4)]  # the reference count per query head
    wide = sel.sample(0, q, cap=1000)
    assert (wide.positions >= 0).sum(1).tolist() == collided and wide.kept_share.tolist() == [1.0] * 4
    assert bool((wide.positions[wide.positions >= 0] >= 10).all()) and int(wide.positions.max()) < 110
    cap = min(collided) - 1
    narrow = sel.sample(0, q, cap=cap)
    assert narrow.positions.shape == (4, cap) and bool((narrow.positions >= 0).all())
    assert narrow.kept_share.tolist() == pytest.approx([cap / n for n in collided])
    assert set(narrow.positions[0].tolist()) <= set(wide.positions[0].tolist())  # a subset of the collided


def test_magicpig_weights_follow_the_angle_to_the_centred_key():
    cfg = MagicPIGConfig()
    q, keys, mean = _rand(2, 4, seed=18), _rand(2, 3, 4, seed=19), _rand(2, 4, seed=20)
    centred = keys - mean[:, None]
    samples = Samples(torch.zeros(2, 3, dtype=torch.long), centred.norm(dim=-1), mean, torch.tensor([1.0, 0.5]))
    got = sample_log_weights(q, keys, samples, cfg)
    for h in range(2):
        for m in range(3):
            cos = float(q[h] @ centred[h, m] / (q[h].norm() * centred[h, m].norm()))
            p = (1 - math.acos(cos) / math.pi) ** 10
            w = 1 - (1 - p) ** 150 - 150 * p * (1 - p) ** 149
            assert got[h, m].item() == pytest.approx(math.log(w * [1.0, 0.5][h] + 1e-4), rel=1e-4, abs=1e-5)
