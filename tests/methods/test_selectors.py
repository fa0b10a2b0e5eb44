"""Streaming, Quest and GQA merging behave as specified; configs refuse bad budgets."""

import pytest
import torch

from icekv.config.selection import SelectionConfig
from icekv.errors import ConfigError
from icekv.policies import resolve
from icekv.methods.quest import QuestSelector
from icekv.methods.streaming import StreamingSelector
from icekv.methods.gqa import merge_ranked, merge_ranked_heads


def test_merge_interleaves_by_rank_and_drops_duplicates():
    scores = torch.tensor([[9.0, 8.0, 1.0, 0.0, 7.0], [0.0, 1.0, 9.0, 8.0, 7.5]])
    # head 0 ranks 0,1,4,...; head 1 ranks 2,3,4,... -> 0,2,1,3,4
    assert merge_ranked(scores, 5, by_score=False).tolist() == [0, 2, 1, 3, 4]
    assert merge_ranked(scores, 3, by_score=False).tolist() == [0, 2, 1]


def test_merge_by_score_takes_a_rank_best_score_first():
    scores = torch.tensor([[5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 9.0, 1.0], [0.0, 6.0, 0.0, 8.0]])
    # best pages: head 0 -> 0 (5), head 1 -> 2 (9), head 2 -> 3 (8); seconds: 1 (4), 3 (1), 1 (6)
    assert merge_ranked(scores, 2, by_score=False).tolist() == [0, 2]  # head order: the first two heads' best
    assert merge_ranked(scores, 2, by_score=True).tolist() == [2, 3]  # the two best of the heads' best
    assert merge_ranked(scores, 4, by_score=True).tolist() == [2, 3, 0, 1]  # second rank: 1 (6), 1, 3: taken
    tied = torch.tensor([[0.0, 3.0], [3.0, 0.0]])
    assert merge_ranked(tied, 1, by_score=True).tolist() == [1]  # a tie keeps head order


@pytest.mark.parametrize("by_score", [False, True])
def test_merge_ranks_equal_scores_lower_page_first(by_score):
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5]])
    assert merge_ranked(scores, 3, by_score=by_score).tolist() == [1, 2, 3]
    assert merge_ranked(scores, 2, by_score=by_score).tolist() == [1, 2]  # a tie at the cut: the lower ids
    level = torch.full((3, 6), 4.0)
    level[:, 0] = float("nan")  # not a candidate
    level[:, 1] = float("inf")  # nor is an overflow, which must not take a finite page's place
    assert merge_ranked(level, 2, by_score=by_score).tolist() == [2, 3]


def test_merge_skips_unvisited_pages_and_handles_empty():
    scores = torch.tensor([[float("-inf"), 2.0, float("-inf")]])
    assert merge_ranked(scores, 3, by_score=False).tolist() == [1]
    assert merge_ranked(torch.zeros(2, 0), 4, by_score=False).numel() == 0


def test_merge_of_every_head_at_once_equals_one_head_at_a_time():
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(3, 4, 50, generator=g)  # [H, G, n]
    scores[1, :, 10:] = float("-inf")  # a head with few candidates
    scores[2] = float("-inf")  # and one with none
    for k in (1, 12, 60):
        for by_score in (False, True):
            batched = merge_ranked_heads(scores, k, by_score=by_score)
            assert [p.tolist() for p in batched] == [merge_ranked(s, k, by_score=by_score).tolist() for s in scores]
    assert [len(p) for p in merge_ranked_heads(scores, 12, by_score=False)] == [12, 10, 0]


def test_streaming_picks_the_most_recent_pages():
    sel = StreamingSelector(page_size=4)
    sel.build(0, torch.randn(2, 40, 8), base=8)  # 10 pages at positions 8..47
    picks = sel.select(0, torch.randn(4, 8), k=3)
    assert [p.tolist() for p in picks.per_head(2)] == [[9, 8, 7], [9, 8, 7]]
    assert picks.heads.tolist() == [0, 0, 0, 1, 1, 1] and picks.versions.tolist() == [0] * 6
    sel.insert(0, torch.randn(2, 4, 8))
    assert sel.select(0, torch.randn(4, 8), k=2).per_head(2)[0].tolist() == [10, 9]
    assert sel.page_positions(0, torch.tensor([0]), torch.tensor([10])).tolist() == [[48, 49, 50, 51]]


def test_quest_bound_is_an_upper_bound_and_finds_the_hot_page():
    torch.manual_seed(0)
    keys = torch.randn(1, 64, 8)
    keys[0, 37] = 10 * torch.ones(8)  # page 9 (positions 36..39) holds the hottest key
    sel = QuestSelector(page_size=4)
    sel.build(0, keys, base=0)
    q = torch.ones(2, 8)
    bounds = sel.upper_bounds(0, q)  # [Hq, 16]
    true_max = (q @ keys[0].T).view(2, 16, 4).amax(-1)
    assert bool((bounds >= true_max - 1e-5).all())
    assert sel.select(0, q, k=1).pages.tolist() == [9]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(policy="magic"), "unknown policy"),
        (dict(policy="icecache", budget=64, n_sink_pages=2, n_win_pages=2), "must exceed sink \\+ window"),
        (dict(policy="quest", budget=100), "not a multiple of the page size"),
        (dict(policy="icecache", budget=0), "budget must be >= 1"),
    ],
)
def test_bad_selection_settings(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        resolve(SelectionConfig(**kwargs))


def test_small_budgets_shrink_sink_and_window():
    plan = resolve(SelectionConfig(policy="icecache", budget=64))
    assert (plan.sink_pages, plan.window_pages, plan.selected_pages) == (1, 1, 2)
    assert resolve(SelectionConfig(policy="icecache", budget=256)).selected_pages == 12


def test_full_needs_no_selector():
    assert resolve(SelectionConfig(policy="full")).make_selector() is None
    assert resolve(SelectionConfig(policy="icecache_r")).make_selector().layer_reuse


@pytest.mark.parametrize("gqa_merge", ["head_order", "score_order"])
def test_icecache_exhaustive_search_picks_the_exact_top_pages(gqa_merge):
    from icekv.methods.icecache import IceCacheConfig

    g = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3000, 32, generator=g)  # [Hkv, n, D]
    q = torch.randn(6, 32, generator=g)  # 3 query heads per KV head
    configs = {s: IceCacheConfig(search=s, gqa_merge=gqa_merge) for s in ("walk", "exhaustive", "centroids")}
    every_page = dict(search="centroids", rerank=50, gqa_merge=gqa_merge)  # every page a candidate:
    configs["centroids_all"] = IceCacheConfig(**every_page)  # scored on the host,
    configs["centroids_device"] = IceCacheConfig(**every_page, centroid_scoring="device")  # or the device,
    configs["rescored_device"] = IceCacheConfig(**every_page, rescoring="device")  # rescored there too
    searches = {s: resolve(SelectionConfig(policy="icecache", budget=256, icecache=c)).make_selector() for s, c in configs.items()}
    for sel in searches.values():
        sel.build(2, keys, base=16)
    selections = {s: sel.select(2, q, 12) for s, sel in searches.items()}
    picks = {s: selection.per_head(2) for s, selection in selections.items()}
    picks_walk, picks_exact = picks["walk"], picks["exhaustive"]
    assert all(len(p) == 12 for p in picks["centroids"])
    for name in ("centroids_all", "centroids_device", "rescored_device"):
        assert [p.tolist() for p in picks[name]] == [p.tolist() for p in picks_exact], name
    for h, tree in enumerate(searches["exhaustive"].trees[2]):
        scores = torch.stack([(q[3 * h:3 * h + 3] @ keys[h, tree.page_tokens[p, : tree.page_len[p]]].T).amax(-1)
                              for p in range(tree.num_pages)], 1)  # [G, pages] brute force
        assert picks_exact[h].tolist() == merge_ranked(scores, 12, by_score=gqa_merge == "score_order").tolist()
        assert len(picks_walk[h]) == 12  # the walk picks as many, from the pages it visited
    # positions and versions of several heads' pages in one lookup, each from its own head's tree
    for name, selection in selections.items():  # every search hands over its pages' versions
        for h, p, v in zip(*(t.tolist() for t in (selection.heads, selection.pages, selection.versions))):
            assert v == int(searches[name].trees[2][h].page_version[p])
    heads, pages = selections["exhaustive"].heads, selections["exhaustive"].pages
    sel = searches["exhaustive"]
    positions = sel.page_positions(2, heads, pages)  # [n, P]
    for i, (h, p) in enumerate(zip(heads.tolist(), pages.tolist())):
        tree = sel.trees[2][h]
        toks = tree.page_tokens[p]
        assert positions[i].tolist() == torch.where(toks >= 0, toks + 16, -1).tolist()
    with pytest.raises(ConfigError, match="search"):
        IceCacheConfig(search="beam")


def test_the_gqa_merges_share_few_pages_differently():
    """2 pages for 3 query heads: head order serves heads 0 and 1, score order the best two heads' best."""
    from icekv.methods.icecache import IceCacheConfig

    g = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3000, 32, generator=g)  # [Hkv, n, D]
    q = torch.randn(6, 32, generator=g) * torch.tensor([1.0, 1.0, 4.0] * 2)[:, None]  # head 2 of each group sharpest
    picks = {}
    for merge in ("head_order", "score_order"):
        config = IceCacheConfig(search="exhaustive", gqa_merge=merge)
        sel = resolve(SelectionConfig(policy="icecache", budget=64, icecache=config)).make_selector()
        sel.build(2, keys, base=16)
        picks[merge] = [p.tolist() for p in sel.select(2, q, 2).per_head(2)]
    assert picks["head_order"] != picks["score_order"]
    with pytest.raises(ConfigError, match="gqa_merge"):
        IceCacheConfig(gqa_merge="max")


def test_index_memory_holds_each_key_about_once():
    keys = torch.randn(3, 4000, 64, generator=torch.Generator().manual_seed(3))  # [Hkv, n, D]
    key_bytes = keys.numel() * 4
    ice = resolve(SelectionConfig(policy="icecache", budget=256)).make_selector()
    ice.build(2, keys, base=16)
    # every key once, page-major (pages hold P/2..P tokens: some holes), plus a little headroom and
    # the trees' per-token arrays; a second full copy of the keys would already pass 2x
    assert key_bytes < ice.index_bytes() < 2 * key_bytes
    ice.insert(2, torch.randn(3, 16, 64))
    assert ice.index_bytes() < 2 * key_bytes  # an insert fits the headroom: no doubling
    quest = resolve(SelectionConfig(policy="quest", budget=256)).make_selector()
    quest.build(2, keys, base=16)
    assert quest.index_bytes() == 2 * 3 * (4000 // 16) * 64 * 4  # a min and a max key per page
    assert resolve(SelectionConfig(policy="streaming", budget=256)).make_selector().index_bytes() == 0
