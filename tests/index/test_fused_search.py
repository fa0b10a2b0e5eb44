"""The compiled centroids search against its reference (PageStore.centroid_candidates + merge)."""

import pytest
import torch

from icekv.methods.icecache import IceCacheConfig
from icekv.index import DCITree, PageStore
from icekv.index.fused_search import centroid_search
from icekv.index.score_rows import decode
from icekv.methods.selector import Selection
from icekv.methods.gqa import merge_ranked_heads


def _layer(sizes, d=32, page_size=16, seed=2, dtype=torch.float32):
    """One tree per head over ``sizes`` tokens (random keys: no ties), sharing a store."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d + 1, generator=g)
    cfg = IceCacheConfig(score_dtype=str(dtype).removeprefix("torch."))
    store = PageStore(len(sizes), page_size, d, dtype)
    trees = [DCITree(torch.randn(n, d, generator=g) * 2, page_size, cfg, u / u.norm(), store, h)
             for h, n in enumerate(sizes)]
    return store, trees


def _search(store, q, candidates, k, by_score=False):
    """The compiled search's picks per KV head."""
    heads, pages, versions = centroid_search(store, q, candidates, k, by_score=by_score)
    assert heads.dtype == pages.dtype == versions.dtype == "int64" and (heads[1:] >= heads[:-1]).all()  # by head
    assert versions.tolist() == store.version[heads, pages].tolist()
    return Selection(*map(torch.from_numpy, (heads, pages, versions))).per_head(q.shape[0])


def _reference(store, q, candidates, k, by_score):
    """The torch/numpy search, on an fp32 copy of the store (bf16 and int8 pages decoded: what the
    compiled search computes with; the reference would round q to bf16 instead)."""
    heads, _, page_size = store.pad.shape
    wide = PageStore(heads, page_size, q.shape[-1])
    wide.keys, wide.centroid = decode(store.keys), decode(store.centroid)
    wide.pad, wide.num_pages = store.pad, store.num_pages
    ids, scores = wide.centroid_candidates(q, candidates)  # [H, c], [H, G, c]
    return [row[p] for row, p in zip(ids, merge_ranked_heads(scores, k, by_score=by_score))]


@pytest.mark.parametrize("sizes, group, candidates, k", [
    ([700, 90, 0], 3, 10, 4),  # uneven heads, one empty
    ([1, 5, 17], 1, 8, 3),  # one-token and partial pages, MHA (one query head per KV head)
    ([400, 400], 4, 96, 12),  # candidates above the pages: every page exact
    ([600, 300], 2, 5, 1),  # one page selected
    ([300, 200], 3, 6, 40),  # k above the candidates' union: only candidates come back
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("by_score", [False, True])
def test_compiled_search_equals_the_reference(sizes, group, candidates, k, dtype, by_score):
    store, trees = _layer(sizes, dtype=dtype)
    for tree in trees[:1]:  # inserts leave partial pages and spare capacity behind
        tree.insert(torch.randn(24, 32, generator=torch.Generator().manual_seed(5)))
    q = torch.randn(len(sizes), group, 32, generator=torch.Generator().manual_seed(9))  # [H, G, D]
    fused = _search(store, q, candidates, k, by_score)
    want = _reference(store, q, candidates, k, by_score)
    assert [p.tolist() for p in fused] == [p.tolist() for p in want]
    for picks, n in zip(fused, store.num_pages.tolist()):
        assert picks.dtype == torch.long and len(picks) <= min(k, n) and len(set(picks.tolist())) == len(picks)
    if 0 in sizes:
        assert len(fused[sizes.index(0)]) == 0


@pytest.mark.parametrize("by_score", [False, True])
def test_equal_scores_take_the_lower_page_ids(by_score):
    """Every key equal: every page scores the same for a query head, and the compiled search, like
    the reference, takes the lowest page ids."""
    u = torch.ones(33) / 33 ** 0.5
    store = PageStore(2, 16, 32, torch.float32)
    for h in range(2):
        DCITree(torch.ones(200, 32), 16, IceCacheConfig(), u, store, h)
    q = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(3))  # [H, G, D]
    fused = _search(store, q, 96, 4, by_score)
    assert [p.tolist() for p in fused] == [p.tolist() for p in _reference(store, q, 96, 4, by_score)]
    assert [sorted(p.tolist()) for p in fused] == [[0, 1, 2, 3]] * 2


def test_nothing_to_select():
    store, _ = _layer([50, 60])
    q = torch.randn(2, 3, 32)
    assert [len(p) for p in _search(store, q, 8, 0)] == [0, 0]
    empty = PageStore(2, 16, 32)
    assert [len(p) for p in _search(empty, q, 8, 4)] == [0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_page_without_tokens_is_never_selected(dtype):
    store, _ = _layer([64], dtype=dtype)
    page = 0
    store.write(0, torch.tensor([page]), torch.zeros(1, 16, 32), torch.zeros(1, 16, dtype=torch.bool))
    assert bool(torch.isnan(decode(store.centroid[0, page])).all())  # its mean key is 0/0
    q = torch.randn(1, 2, 32)
    picks = _search(store, q, 100, 100)[0].tolist()
    assert page not in picks and len(picks) == store.num_pages.item() - 1
