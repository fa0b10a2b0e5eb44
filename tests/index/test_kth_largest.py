"""The compiled top-k rules (cut + ties, lowest index first) against numpy's stable sort, on rows
full of ties: the search's candidate union and rank merge rely on them being exact."""

import numpy as np
import pytest

from icekv.index.fused_search import _ranked, _union
from icekv.index.kth_largest import cut_and_ties, kth_largest, top_k_finite


def _rows(seed, m):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 5, size=(4, m)).astype(np.float32)  # few distinct values: ties everywhere
    rows[1, ::3] = -np.inf  # holes
    rows[2] = -np.inf  # nothing to pick
    return rows


def _stable_top(row, k):
    """Ids of the k best finite entries, best first, ties lowest index first."""
    order = np.argsort(-row, kind="stable")
    return [int(i) for i in order[:k] if np.isfinite(row[i])]


@pytest.mark.parametrize("m", [1, 7, 50])
@pytest.mark.parametrize("k", [0, 1, 3, 20, 60])
def test_top_k_picks_the_stable_sort_s_first_k(m, k):
    for row in _rows(m + k, m):
        assert np.nonzero(top_k_finite(row, k))[0].tolist() == sorted(_stable_top(row, k))
        cut, ties = cut_and_ties(row, k)
        assert int((row > cut).sum()) + ties == len(_stable_top(row, k))


@pytest.mark.parametrize("m, k", [(1, 1), (30, 4), (30, 40)])
def test_union_of_rows_equals_each_row_s_picks_or_ed(m, k):
    rows = _rows(m, m)
    rules = [cut_and_ties(row, k) for row in rows]
    cut = np.array([c for c, _ in rules], dtype=np.float32)
    ties = np.array([t for _, t in rules], dtype=np.int64)
    out = np.full(m, -1, dtype=np.int64)
    n = _union(rows, cut, ties, out)
    want = np.nonzero(np.any([top_k_finite(row, k) for row in rows], axis=0))[0]
    assert out[:n].tolist() == want.tolist()


@pytest.mark.parametrize("m, k", [(1, 1), (30, 4), (30, 40), (8, 0)])
def test_ranked_orders_best_first_ties_lowest_index_first(m, k):
    for row in _rows(7 * m, m):
        out = np.zeros(k, dtype=np.int64)
        _ranked(row, k, out)
        want = _stable_top(row, k)
        assert out.tolist() == want + [-1] * (k - len(want))


@pytest.mark.parametrize("m, k", [(2000, 96), (400, 100), (1000, 8), (97, 96), (5000, 1000)])
def test_kth_largest_is_exact_on_long_rows(m, k):
    """Long rows take the sampled-threshold path; sorted rows, heavy ties and -inf included."""
    rng = np.random.default_rng(m + k)
    rows = [rng.standard_normal(m).astype(np.float32),
            np.sort(rng.standard_normal(m)).astype(np.float32),  # ascending: the sample sees the tail
            np.sort(rng.standard_normal(m))[::-1].astype(np.float32).copy(),
            rng.integers(0, 3, m).astype(np.float32),  # ties at the cut
            np.where(rng.random(m) < 0.9, -np.inf, 1.0).astype(np.float32)]  # mostly -inf
    for row in rows:
        assert kth_largest(row, k) == np.sort(row)[::-1][k - 1]
