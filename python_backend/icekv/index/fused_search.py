"""The centroids page search of one layer in a single compiled pass (numba), for a CPU.

Same result as :meth:`PageStore.centroid_candidates` followed by :func:`merge_ranked_heads` (the
reference, tested against this over awkward shapes): per KV head, every query head ranks the
pages by ``q.centroid``, the union of each query head's best ``candidates`` is rescored exactly
(best ``q.k`` over the page's tokens), and the query heads' exact rankings are interleaved by rank
(a rank's heads in head order, or best score first: ``by_score``) into ``k`` distinct pages,
handed back flat (heads, pages, versions) for the slot plan. In torch and numpy that is about
twenty calls on arrays of a few thousand entries, each costing more in dispatch than in
arithmetic; here it is one call that reads the centroids once and only the candidates' keys.
In the decode loop the index comes from DRAM (the dense layers evict it): the bytes of centroids
and candidate keys a layer reads, not arithmetic, set its time.

Two stages, each one compiled call: the candidates by centroid (:func:`_candidates`), then the
exact rescoring and the merge (:func:`_rescore`). :func:`candidate_search` runs the second alone,
for candidates picked on the compute device (:mod:`icekv.index.device_centroids`), so the host
reads only the candidates' keys: the centroid reads grow with the context, the candidates' do not.

Compiled on first call and cached on disk (numba ``cache=True``): only the first process after an
install pays the compile. A bf16 or int8 store (``score_dtype``) is read as raw rows
(:func:`icekv.index.score_rows.dots`): bf16 rows are widened a page at a time; int8 rows are
multiplied as they are and scaled once per product, reading a quarter of fp32's bytes.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from icekv.index.kth_largest import cut_and_ties, top_k_finite
from icekv.index.page_store import PageStore
from icekv.index.score_rows import dots, widen_page

_jit = numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})  # no nnan/ninf: -inf marks holes


def centroid_search(store: PageStore, q: torch.Tensor, candidates: int, k: int, *,
                    by_score: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [H, G, D] -> (heads [n], pages [n], versions [n]) int64: up to ``k`` page ids per KV
    head, grouped by head, each head's in the merge's order, with the pages' versions."""
    if not store.num_pages.shape[0] or k <= 0:
        return _nothing()
    qf = q.float().contiguous().numpy()
    centroid, keys, pad, num_pages, version = store.search_views()
    parts = numba.get_num_threads()
    cand, n_cand = _candidates(qf, centroid, num_pages, candidates, parts)
    return _rescore(qf, keys, pad, version, cand, n_cand, k, by_score, parts)


def candidate_search(store: PageStore, q: torch.Tensor, picks: np.ndarray, k: int, *,
                     by_score: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`centroid_search` with each query head's candidates already picked (by scoring the
    centroids elsewhere: on the compute device): q [H, G, D], picks [H, G, c] page ids (-1: none).
    Only the candidates' keys are read here."""
    if not store.num_pages.shape[0] or k <= 0:
        return _nothing()
    _, keys, pad, _, version = store.search_views()
    cand, n_cand = union_of_picks(np.ascontiguousarray(picks, dtype=np.int64))
    return _rescore(q.float().contiguous().numpy(), keys, pad, version, cand, n_cand, k, by_score,
                    numba.get_num_threads())


def merge_ranked_picks(ranked: np.ndarray, scores: np.ndarray, version: np.ndarray, k: int, *,
                       by_score: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each query head's pages already ranked exactly (elsewhere: on the compute device), ranked
    [H, G, kk] page ids best first (-1: none) with their scores [H, G, kk], version [H, cap] ->
    (heads, pages, versions) as :func:`centroid_search` returns them: the query heads' rankings
    interleaved into ``k`` pages, a rank's heads in head order or ``by_score`` best first."""
    if ranked.shape[0] == 0 or k <= 0:
        return _nothing()
    return _interleave_heads(np.ascontiguousarray(ranked, dtype=np.int64),
                             np.ascontiguousarray(scores, dtype=np.float32), version, k, by_score)


def _nothing() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, parallel=True)
def _candidates(q, centroid, num_pages, candidates, parts):
    """q [H, G, D], centroid [H, cap, W] (rows of the score dtype), num_pages [H] -> (cand [H, m],
    n_cand [H]): per KV head, the union of its query heads' best ``candidates`` pages by
    q.centroid, ascending, in ``cand[h, :n_cand[h]]``.

    The centroid reads are split into ``parts`` slices per head and the slices of all heads run in
    parallel (a few KV heads do not spread evenly over the cores), and so do the query heads'
    candidate cuts (a heap pass over every estimate each)."""
    h_n, g_n, _ = q.shape
    most = max(num_pages.max(), 1)
    estimate = np.empty((h_n, g_n, most), dtype=np.float32)  # [H, G, m]
    for task in numba.prange(h_n * parts):
        h, lo, hi = _slice(task, parts, num_pages)
        _scores(q[h], centroid[h], lo, hi, estimate[h])
    cut = np.empty((h_n, g_n), dtype=np.float32)  # [H, G] each query head's candidate rule
    ties = np.empty((h_n, g_n), dtype=np.int64)  # [H, G]
    for task in numba.prange(h_n * g_n):
        h, g = task // g_n, task % g_n
        cut[h, g], ties[h, g] = cut_and_ties(estimate[h, g, : num_pages[h]], candidates)
    cand = np.empty((h_n, most), dtype=np.int64)  # [H, m] each head's candidates first, ascending
    n_cand = np.zeros(h_n, dtype=np.int64)  # [H]
    for h in numba.prange(h_n):
        n_cand[h] = _union(estimate[h, :, : num_pages[h]], cut[h], ties[h], cand[h])
    return cand, n_cand


@_jit
def union_of_picks(picks):
    """picks [H, G, c] page ids (-1: none) -> (cand [H, G * c], n_cand [H]): each head's distinct
    ids, ascending, in ``cand[h, :n_cand[h]]`` (the layout :func:`_candidates` returns)."""
    h_n = picks.shape[0]
    cand = np.empty((h_n, max(picks.shape[1] * picks.shape[2], 1)), dtype=np.int64)  # [H, G * c]
    n_cand = np.zeros(h_n, dtype=np.int64)  # [H]
    for h in range(h_n):
        ids = np.sort(picks[h].ravel())
        for i in range(ids.shape[0]):
            if ids[i] >= 0 and (n_cand[h] == 0 or ids[i] != cand[h, n_cand[h] - 1]):
                cand[h, n_cand[h]] = ids[i]
                n_cand[h] += 1
    return cand, n_cand


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, parallel=True)
def _rescore(q, keys, pad, version, cand, n_cand, k, by_score, parts):
    """q [H, G, D], keys [H, cap, P, W], pad [H, cap, P], version [H, cap], each head's candidates
    ``cand[h, :n_cand[h]]`` ascending -> (heads [n], pages [n], versions [n]): the candidates
    rescored exactly (best q.k over the page's tokens, the reads split like the centroids') and
    the query heads' rankings merged into up to ``k`` pages per head."""
    h_n, g_n, _ = q.shape
    exact = np.full((h_n, g_n, max(n_cand.max(), 1)), -np.inf, dtype=np.float32)  # [H, G, c] candidates' scores
    for task in numba.prange(h_n * parts):
        h, lo, hi = _slice(task, parts, n_cand)
        page = np.empty((keys.shape[2], q.shape[2]), dtype=np.float32)  # [P, D] a page's keys widened
        for i in range(lo, hi):
            _best_token(q[h], widen_page(keys[h, cand[h, i]], page), pad[h, cand[h, i]], exact[h, :, i])
    ids = np.empty((h_n, k), dtype=np.int64)  # [H, k]
    counts = np.zeros(h_n, dtype=np.int64)  # [H]
    for h in numba.prange(h_n):
        counts[h] = _merge(exact[h, :, : n_cand[h]], cand[h, : n_cand[h]], by_score, ids[h])
    return _flatten(ids, counts, version)


@_jit
def _interleave_heads(ranked, scores, version, k, by_score):
    """ranked [H, G, kk] page ids best first (-1: none), their scores [H, G, kk] -> (heads, pages,
    versions): each head's query heads' rankings interleaved into up to ``k`` pages (see
    :func:`_interleave`)."""
    h_n = ranked.shape[0]
    ids = np.empty((h_n, k), dtype=np.int64)  # [H, k]
    counts = np.zeros(h_n, dtype=np.int64)  # [H]
    for h in range(h_n):
        counts[h] = _interleave(ranked[h], scores[h], by_score, ids[h])
    return _flatten(ids, counts, version)


@_jit
def _flatten(ids, counts, version):
    """ids [H, k] of which each head's first counts[h] are its pages -> (heads, pages, versions)
    [n] each, grouped by head."""
    h_n = ids.shape[0]
    heads = np.empty(counts.sum(), dtype=np.int64)  # [n]
    pages = np.empty(counts.sum(), dtype=np.int64)  # [n]
    versions = np.empty(counts.sum(), dtype=np.int64)  # [n]
    at = 0
    for h in range(h_n):
        for r in range(counts[h]):
            heads[at], pages[at], versions[at] = h, ids[h, r], version[h, ids[h, r]]
            at += 1
    return heads, pages, versions


@_jit
def _slice(task, parts, sizes):
    """Task -> (head, lo, hi): the task's share of its head's ``sizes[head]`` items."""
    h, part = task // parts, task % parts
    return h, sizes[h] * part // parts, sizes[h] * (part + 1) // parts


@_jit
def _scores(qh, rows, lo, hi, out):
    """qh [G, D], rows [m, W] -> out[:, lo:hi] [G, hi - lo]: the products with rows lo..hi-1; a
    non-finite one (an emptied page) -> -inf."""
    buf = np.empty(qh.shape[1], dtype=np.float32)  # [D]
    products = np.empty(qh.shape[0], dtype=np.float32)  # [G]
    for j in range(lo, hi):
        dots(qh, rows[j], buf, products)
        for g in range(qh.shape[0]):
            s = products[g]
            out[g, j] = s if np.isfinite(s) else -np.inf


@_jit
def _best_token(qh, page_keys, page_pad, best):
    """qh [G, D], page_keys [P, W], page_pad [P] (0 or -inf): raises best [G] to the best q.k over
    the page's tokens."""
    buf = np.empty(qh.shape[1], dtype=np.float32)  # [D]
    products = np.empty(qh.shape[0], dtype=np.float32)  # [G]
    for slot in range(page_keys.shape[0]):
        if page_pad[slot] != 0.0:
            continue
        dots(qh, page_keys[slot], buf, products)
        for g in range(qh.shape[0]):
            best[g] = max(best[g], products[g])


@_jit
def _union(estimate, cut, ties, out):
    """estimate [G, m], each row's rule (cut [G], ties [G], see ``cut_and_ties``) -> writes the
    ascending ids of the union of the rows' picks to out and returns how many."""
    left = ties.copy()  # [G]
    n = 0
    for j in range(estimate.shape[1]):
        picked = False
        for g in range(estimate.shape[0]):  # every row, so each counts its own ties
            if estimate[g, j] > cut[g]:
                picked = True
            elif estimate[g, j] == cut[g] and left[g] > 0:
                left[g] -= 1
                picked = True
        if picked:
            out[n] = j
            n += 1
    return n


@_jit
def _merge(exact, cand, by_score, out):
    """exact [G, n] scores of pages cand [n] -> out [k]: each query head's ranking of the pages
    (:func:`_ranked`), interleaved (:func:`_interleave`). Returns how many it wrote."""
    g_n, n = exact.shape
    kk = min(out.shape[0], n)
    order = np.empty((g_n, kk), dtype=np.int64)  # [G, kk] best first; ties keep page order; -1: none
    ranked = np.full((g_n, kk), -1, dtype=np.int64)  # [G, kk] the same as page ids
    score = np.full((g_n, kk), -np.inf, dtype=np.float32)  # [G, kk] and their scores
    for g in range(g_n):
        _ranked(exact[g], kk, order[g])
        for r in range(kk):
            if order[g, r] >= 0:
                ranked[g, r], score[g, r] = cand[order[g, r]], exact[g, order[g, r]]
    return _interleave(ranked, score, by_score, out)


@_jit
def _interleave(ranked, score, by_score, out):
    """ranked [G, kk] page ids best first (-1: none), their scores [G, kk] -> out [k]: the query
    heads' rankings interleaved by rank (every head's best, then every head's second, ...), a
    rank's heads in head order or, ``by_score``, best score first (ties in head order); duplicates
    dropped. Returns how many it wrote."""
    g_n, kk = ranked.shape
    k = out.shape[0]
    count = 0
    heads = np.arange(g_n)
    for r in range(kk):
        if count == k:
            break
        if by_score:
            heads = np.argsort(-score[:, r], kind="mergesort")
        for g in heads:
            page = ranked[g, r]
            if count == k or page < 0:
                continue
            taken = False
            for i in range(count):  # k is small: a scan beats a set
                taken = taken or out[i] == page
            if not taken:
                out[count] = page
                count += 1
    return count


@_jit
def _ranked(scores, kk, out):
    """scores [n] -> out [kk]: the indices of the ``kk`` best finite scores, best first (ties:
    lower index first), -1 past the finite ones. An insertion sort of the few picked."""
    out[:] = -1
    pick = np.nonzero(top_k_finite(scores, kk))[0]  # ascending
    for a in range(pick.shape[0]):
        i = pick[a]
        b = a
        while b > 0 and scores[out[b - 1]] < scores[i]:
            out[b] = out[b - 1]
            b -= 1
        out[b] = i
