"""DCI-tree invariants, exactness of the walk when it sees everything, and dynamic insertion."""

import pytest
import torch

from icekv.methods.icecache import IceCacheConfig
from icekv.errors import ConfigError
from icekv.index import DCITree, promotion_levels
from icekv.index.dci_tree import balanced_cut
from icekv.index.score_rows import decode, encode


def _keys(n, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * 3  # varied norms


def _tree(keys, page=16, cfg=IceCacheConfig()):
    u = torch.randn(keys.shape[1] + 1, generator=torch.Generator().manual_seed(1))
    return DCITree(keys, page, cfg, u / u.norm())


def assert_invariants(tree, page=16):
    pages = tree.page_tokens[: tree.num_pages]
    members = pages[pages >= 0]
    assert sorted(members.tolist()) == list(range(tree.n)), "every token in exactly one page"
    lens = tree.page_len[: tree.num_pages]
    assert torch.equal((pages >= 0).sum(-1), lens)
    assert int(lens.min()) >= 1 and int(lens.max()) <= page
    # a page holds children of one node: its owner is every member's parent
    owner = tree.page_owner[: tree.num_pages]
    parents = tree.parent[pages.clamp_min(0)]
    assert bool(((parents == owner[:, None]) | (pages < 0)).all())
    # a parent is always at a higher level than its child
    has_parent = tree.parent[: tree.n] >= 0
    assert bool((tree.level[tree.parent[: tree.n][has_parent]] > tree.level[: tree.n][has_parent]).all())


@pytest.mark.parametrize("n", [1, 15, 16, 17, 200, 3000])
def test_build_invariants(n):
    assert_invariants(_tree(_keys(n)))


def test_pages_cut_from_large_groups_are_at_least_half_full():
    rank = torch.arange(50)
    page, slot, m = balanced_cut(rank, torch.full((50,), 50), 16)
    sizes = torch.bincount(page)
    assert int(m[0]) == 4 and sizes.tolist() == [13, 12, 13, 12]
    assert int(slot.max()) < 16


def test_levels_follow_the_ratio_schedule():
    cfg = IceCacheConfig(ratio_1=0.02, ratio_2=0.2, max_level=4)
    level = promotion_levels(torch.arange(100_000), cfg)
    assert int(level[0]) == 4
    counts = [(level >= k).sum().item() for k in range(1, 5)]
    assert counts == [2000, 400, 80, 16]


@pytest.mark.parametrize("n", [40, 1000, 2500])
def test_walk_with_full_field_of_view_is_exact(n):
    keys = _keys(n)
    tree = _tree(keys)
    q = torch.randn(3, keys.shape[1])
    scores = tree.page_scores(q, field_of_view=10**9)  # [G, pages]
    toks = tree.page_tokens[: tree.num_pages]
    exact = (q @ keys.T)[:, toks.clamp_min(0)].masked_fill(toks[None] < 0, float("-inf")).amax(-1)
    torch.testing.assert_close(scores, exact)
    k = min(12, tree.num_pages)
    assert torch.equal(scores.topk(k).indices.sort().values, exact.topk(k).indices.sort().values)


def test_small_field_of_view_visits_a_subset():
    tree = _tree(_keys(3000))
    scores = tree.page_scores(torch.randn(2, 32), field_of_view=5)
    visited = torch.isfinite(scores).sum(-1)
    assert bool((visited > 0).all()) and bool((visited < tree.num_pages).all())


def test_insertion_keeps_invariants_and_exactness():
    keys = _keys(600)
    tree = _tree(keys)
    extra = _keys(800, seed=5) * 2.5  # larger norms: M^2 must grow
    for chunk in extra.split(16):
        changed = tree.insert(chunk)
        assert changed
    assert tree.n == 1400 and tree.max_norm2 >= float(extra.pow(2).sum(-1).max()) - 1e-3
    assert_invariants(tree)
    all_keys = torch.cat([keys, extra])
    q = torch.randn(3, 32)
    scores = tree.page_scores(q, field_of_view=10**9)
    toks = tree.page_tokens[: tree.num_pages]
    exact = (q @ all_keys.T)[:, toks.clamp_min(0)].masked_fill(toks[None] < 0, float("-inf")).amax(-1)
    torch.testing.assert_close(scores, exact)


def test_a_full_page_splits_and_versions_change():
    tree = _tree(_keys(17))  # token 0 under the root; tokens 1..16 its children: one full page
    assert tree.num_pages == 2
    full = int(torch.nonzero(tree.page_len[:2] == 16)[0])
    before = tree.page_version[full].item()
    changed = tree.insert(_keys(1, seed=9))
    assert tree.num_pages == 3 and changed == {full, 2}
    assert tree.page_version[full].item() > before
    assert sorted(tree.page_len[[full, 2]].tolist()) == [8, 9]
    assert_invariants(tree)


def test_empty_tree_selects_nothing():
    tree = _tree(torch.zeros(0, 32))
    assert tree.num_pages == 0
    assert tree.page_scores(torch.randn(3, 32), 30).shape == (3, 0)
    tree.insert(_keys(3))
    assert_invariants(tree)


def test_exhaustive_scores_equal_an_unlimited_walk_after_inserts():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(700, 32, generator=g)
    tree = _tree(keys[:500])
    tree.insert(keys[500:600])
    tree.insert(keys[600:])
    q = torch.randn(3, 32, generator=g)
    exact = tree.exact_page_scores(q)  # [G, pages]
    assert exact.shape == (3, tree.num_pages) and torch.isfinite(exact).all()
    torch.testing.assert_close(exact, tree.page_scores(q, field_of_view=10**9))
    brute = torch.stack([(q @ keys[tree.page_tokens[p, : tree.page_len[p]]].T).amax(-1) for p in range(tree.num_pages)], 1)
    torch.testing.assert_close(exact, brute)


def test_centroid_search_rescores_the_best_pages_by_centroid_exactly():
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(900, 32, generator=g)
    tree = _tree(keys[:600])
    tree.insert(keys[600:750])  # centroids must follow inserts and splits
    tree.insert(keys[750:])
    m = tree.num_pages
    members = [keys[tree.page_tokens[p, : tree.page_len[p]]] for p in range(m)]
    torch.testing.assert_close(tree.page_centroid[:m], torch.stack([k.mean(0) for k in members]))
    q = torch.randn(3, 32, generator=g)
    exact = tree.exact_page_scores(q)  # [G, pages]
    some = tree.centroid_page_scores(q, candidates=20)
    finite = torch.isfinite(some)
    assert bool((finite.sum(-1) >= 20).all()) and bool((finite.sum(-1) < m).all())
    torch.testing.assert_close(some[finite], exact[finite])  # candidates are scored exactly
    estimate = q @ tree.page_centroid[:m].T  # [G, pages]
    for head in range(3):  # each head's candidates are its best pages by centroid
        assert bool(finite[head, estimate[head].topk(20).indices].all())
    torch.testing.assert_close(tree.centroid_page_scores(q, candidates=m), exact)
    assert _tree(torch.zeros(0, 32)).centroid_page_scores(q, 8).shape == (3, 0)


@pytest.mark.parametrize("score_dtype, tol", [("bfloat16", 0.15), ("int8", 0.25)])  # |q.k| ~ 20-40
def test_narrow_page_keys_score_within_their_rounding_and_keep_the_tree(score_dtype, tol):
    keys = _keys(900)
    q = torch.randn(3, 32, generator=torch.Generator().manual_seed(9))
    exact = _tree(keys)
    narrow = _tree(keys, cfg=IceCacheConfig(score_dtype=score_dtype))
    narrow.insert(_keys(40, seed=4))
    exact.insert(_keys(40, seed=4))
    assert narrow.page_keys.dtype == getattr(torch, score_dtype)
    assert torch.equal(narrow.page_tokens, exact.page_tokens)  # same pages: only scoring changes
    want = exact.exact_page_scores(q)
    for got in (narrow.exact_page_scores(q), narrow.page_scores(q, field_of_view=10**9),
                narrow.centroid_page_scores(q, candidates=10**9)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=tol)  # bf16: ~3 digits; int8: 1/254 of the largest entry
        assert not torch.equal(got, want)  # the keys were rounded
    with pytest.raises(ConfigError, match="score_dtype"):
        IceCacheConfig(score_dtype="float16")


@pytest.mark.parametrize("kv_dtype, want", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.bfloat16)])
def test_the_default_page_keys_are_as_wide_as_the_kv_they_index(kv_dtype, want):
    tree = _tree(_keys(300).to(kv_dtype))  # score_dtype "auto"
    assert tree.page_keys.dtype == want
    assert IceCacheConfig().page_keys(kv_dtype) == str(want).removeprefix("torch.")
    assert IceCacheConfig(score_dtype="int8").page_keys(torch.bfloat16) == "int8"  # an explicit choice stays


@pytest.mark.parametrize("n, group, fov, score_dtype", [(900, 3, 10, "float32"), (900, 1, 1, "float32"),
                                                       (300, 4, 30, "float32"), (2000, 3, 200, "float32"),
                                                       (40, 2, 10**9, "float32"), (900, 3, 10, "int8")])
def test_compiled_walk_equals_the_numpy_walk(n, group, fov, score_dtype):
    keys = _keys(n, seed=n)
    tree = _tree(keys[: n * 3 // 4], cfg=IceCacheConfig(score_dtype=score_dtype))
    tree.insert(keys[n * 3 // 4 :])  # inserted pages and splits are walked too
    q = torch.randn(group, 32, generator=torch.Generator().manual_seed(group))
    got, want = tree.page_scores(q, fov), tree.page_scores_reference(q, fov)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))  # the same pages visited
    torch.testing.assert_close(got, want)
    assert int(torch.isfinite(got).sum()) > 0
    if fov <= 10:
        assert int(torch.isfinite(got).sum()) < group * tree.num_pages  # a narrow walk skips pages


@pytest.mark.parametrize("score_dtype", ["bfloat16", "int8"])
def test_compiled_walk_over_narrow_keys_is_exact_with_an_unlimited_view(score_dtype):
    keys = _keys(500, seed=3)
    tree = _tree(keys, cfg=IceCacheConfig(score_dtype=score_dtype))
    q = torch.randn(3, 32)
    got = tree.page_scores(q, field_of_view=10**9)
    toks = tree.page_tokens[: tree.num_pages]
    widened = decode(encode(keys, getattr(torch, score_dtype)))  # fp32 q against the stored keys
    exact = (q @ widened.T)[:, toks.clamp_min(0)].masked_fill(toks[None] < 0, float("-inf")).amax(-1)
    torch.testing.assert_close(got, exact)


def test_parents_are_found_in_row_blocks_exactly_as_in_one_product(monkeypatch):
    """The build's one bulk product (tokens against the level above) runs in blocks of rows, on the
    keys' device: the blocks give each token the parent one product over all rows gives."""
    from icekv.index import dci_tree

    keys = _keys(3000)
    whole = _tree(keys).parent.clone()
    monkeypatch.setattr(dci_tree, "NEAREST_ROWS", 7)  # many blocks, the last one partial
    assert torch.equal(_tree(keys).parent, whole)
    brute = _tree(keys)  # and each parent is the nearest node of the level above, by the transform
    level = brute.level[: brute.n]
    below = torch.nonzero(level == 0).flatten()
    above = torch.nonzero(level == 1).flatten()
    aug = brute._aug(brute.norm2[: brute.n])
    sim = keys[below] @ keys[above].T + aug[below, None] * aug[above][None, :]
    assert torch.equal(brute.parent[below], above[sim.argmax(-1)])
