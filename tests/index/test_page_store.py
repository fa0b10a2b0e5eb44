"""The shared page store of a layer's trees: batched searches equal per-head ones."""

import pytest
import torch
from icekv.methods.icecache import IceCacheConfig
from icekv.index import DCITree, PageStore
from icekv.index.score_rows import decode, encode
from icekv.methods.gqa import merge_ranked_heads


def _layer(sizes, d=32, dtype=torch.float32):
    """One tree per head over ``sizes`` tokens, sharing a store; keys per head [n_h, D]."""
    g = torch.Generator().manual_seed(2)
    u = torch.randn(d + 1, generator=g)
    store = PageStore(len(sizes), 16, d, dtype)
    keys = [torch.randn(n, d, generator=g) * 2 for n in sizes]
    cfg = IceCacheConfig()
    return store, [DCITree(k, 16, cfg, u / u.norm(), store, h) for h, k in enumerate(keys)], keys


def test_heads_with_uneven_page_counts_score_alone_and_batched_alike():
    store, trees, keys = _layer([700, 90, 0])  # an empty head too
    extra = torch.randn(48, 32)
    for chunk in extra.split(16):  # inserts grow one head past the others
        trees[1].insert(chunk)
    keys[1] = torch.cat([keys[1], extra])
    counts = [t.num_pages for t in trees]
    assert store.num_pages.tolist() == counts and counts[2] == 0
    q = torch.randn(3, 4, 32)  # [H, G, D]
    exact = store.exact_scores(q)  # [H, G, most pages]
    assert exact.shape == (3, 4, max(counts))
    for h, tree in enumerate(trees):
        alone = tree.exact_page_scores(q[h])  # [G, pages_h]
        torch.testing.assert_close(exact[h, :, : counts[h]], alone)
        assert bool(torch.isneginf(exact[h, :, counts[h]:]).all())
        toks = tree.page_tokens[: counts[h]]
        members = [keys[h][toks[p][toks[p] >= 0]] for p in range(counts[h])]
        if members:
            torch.testing.assert_close(alone, torch.stack([(q[h] @ k.T).amax(-1) for k in members], 1))
    some = store.centroid_scores(q, candidates=10)
    for h, tree in enumerate(trees):
        torch.testing.assert_close(some[h, :, : counts[h]], tree.centroid_page_scores(q[h], 10))
        finite = torch.isfinite(some[h])
        torch.testing.assert_close(some[h][finite], exact[h][finite])  # candidates exact
        assert min(10, counts[h]) <= int(finite.any(0).sum()) <= counts[h]
        assert bool(torch.isneginf(some[h, :, counts[h]:]).all())
    assert int(torch.isfinite(some[2]).sum()) == 0


def test_store_grows_for_every_head_and_keeps_rows():
    store, trees, keys = _layer([40, 40])
    before = store.keys[0, : trees[0].num_pages].clone()
    cap = store.capacity
    extra = torch.randn(16 * cap, 32)
    for chunk in extra.split(16):
        trees[1].insert(chunk)
    all_keys = torch.cat([keys[1], extra])
    assert store.capacity > cap and store.keys.shape[:2] == (2, store.capacity)
    assert torch.equal(store.keys[0, : trees[0].num_pages], before)
    t = trees[1]
    toks = t.page_tokens[: t.num_pages]
    members = [all_keys[toks[p][toks[p] >= 0]] for p in range(t.num_pages)]
    want = torch.stack([k.mean(0) for k in members])
    torch.testing.assert_close(store.centroid[1, : t.num_pages], want)
    for p, k in enumerate(members):  # every key in its page's row, moved with it through splits
        assert torch.equal(store.keys[1, p, : len(k)], k) and torch.equal(store.pad[1, p, : len(k)], torch.zeros(len(k)))


def test_compact_candidates_rank_like_the_dense_scores():
    store, trees, _ = _layer([900, 300, 600])
    q = torch.randn(3, 3, 32, generator=torch.Generator().manual_seed(8))
    ids, cand = store.centroid_candidates(q, candidates=12)  # [H, c], [H, G, c]
    dense = store.centroid_scores(q, candidates=12)  # [H, G, m]
    for h in range(3):
        real = ids[h] >= 0
        assert torch.equal(ids[h][real], torch.isfinite(dense[h]).any(0).nonzero().flatten())  # ascending
        torch.testing.assert_close(cand[h][:, real], dense[h][:, ids[h][real]])
        assert bool(torch.isneginf(cand[h][:, ~real]).all())
    compact = [row[p] for row, p in zip(ids, merge_ranked_heads(cand, 8, by_score=False))]
    assert [p.tolist() for p in compact] == [p.tolist() for p in merge_ranked_heads(dense, 8, by_score=False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_compiled_rewrite_equals_writing_the_members_keys(dtype):
    """rewrite (old members from their rows, new ones from new_keys) == write of the gathered keys."""
    g = torch.Generator().manual_seed(6)
    store, loc = PageStore(2, 4, 8, dtype), torch.full((12,), -1)
    store.reserve(5)
    old = torch.randn(8, 8, generator=g) * 3  # tokens 0..7 in pages 0, 1 of head 1
    store.tokens[1, :2] = torch.arange(8).view(2, 4)
    store.rewrite(1, torch.tensor([0, 1]), loc, old, 0)
    assert loc[:8].tolist() == list(range(8))
    new = torch.randn(4, 8, generator=g)  # tokens 8..11; the members move: a split, holes, an emptied page
    store.tokens[1, :4] = torch.tensor([[7, 2, 8, -1], [1, 3, 9, 10], [-1, -1, -1, -1], [0, 11, 4, 5]])
    pages = torch.tensor([0, 1, 2, 3])
    keys = torch.cat([old, new])
    toks = store.tokens[1, :4]
    want = PageStore(2, 4, 8, dtype)
    want.reserve(5)
    want.write(1, pages, decode(encode(keys, dtype))[toks.clamp_min(0)], toks >= 0)  # old rows as stored
    store.rewrite(1, pages, loc, new, 8)
    assert torch.equal(store.keys[1, :4], want.keys[1, :4]) and torch.equal(store.pad[1, :4], want.pad[1, :4])
    # means: the rewrite averages the new keys before rounding them, the write after
    rounding = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}  # a bf16 digit, an int8 step
    torch.testing.assert_close(decode(store.centroid[1, :4]), decode(want.centroid[1, :4]), equal_nan=True, **rounding)
    assert bool(torch.isnan(decode(store.centroid[1, 2])).all())  # no members: no mean
    placed = toks >= 0
    assert torch.equal(loc[toks[placed]], (pages[:, None] * 4 + torch.arange(4))[placed])
    assert not store.keys[0].any()  # the other head untouched
