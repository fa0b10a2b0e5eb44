"""Merge the page rankings of the query heads that share one KV head."""

from __future__ import annotations

import numpy as np
import torch


def merge_ranked(scores: torch.Tensor, k: int, *, by_score: bool) -> torch.Tensor:
    """scores [G, n] (``-inf`` = not a candidate) -> up to ``k`` page ids [k'] (long).

    Each query head ranks its pages (equal scores: lower page id first); the lists are interleaved
    by rank (every head's best, then every head's second, ...), duplicates dropped, and the first
    ``k`` kept. Within a rank the heads come in head order, or ``by_score``: best score first (ties
    in head order). The compiled searches (:mod:`icekv.index.fused_search`) merge the same way.
    """
    return merge_ranked_heads(scores[None], k, by_score=by_score)[0]


def merge_ranked_heads(scores: torch.Tensor, k: int, *, by_score: bool) -> list[torch.Tensor]:
    """:func:`merge_ranked` for every KV head at once: scores [H, G, n] -> per head [k_h] ids.

    Runs in numpy and ranks all heads in one pass: it is called per layer every step, on arrays
    small enough for call overhead to dominate.
    """
    s = scores.float().numpy()
    s = np.where(np.isfinite(s), s, -np.inf)  # NaN or inf: not a candidate (as the compiled search)
    h, g, n = s.shape
    if n == 0 or k == 0:
        return [torch.zeros(0, dtype=torch.long) for _ in range(h)]
    kk = min(k, n)
    top = _best_lowest_first(s, kk)  # [H, G, kk] the best, ascending ids
    vals = np.take_along_axis(s, top, 2)
    order = np.argsort(-vals, axis=2, kind="stable")  # best first within each query head, ties by id
    top, vals = np.take_along_axis(top, order, 2), np.take_along_axis(vals, order, 2)
    if by_score:  # within each rank, the query heads best score first
        heads = np.argsort(-vals, axis=1, kind="stable")  # [H, G, kk]
        top, vals = np.take_along_axis(top, heads, 1), np.take_along_axis(vals, heads, 1)
    top, finite = top.transpose(0, 2, 1).reshape(h, -1), np.isfinite(vals.transpose(0, 2, 1).reshape(h, -1))
    picks = []
    for ids, ok in zip(top, finite):  # rank-major per KV head, candidates only
        ids = ids[ok]
        _, first = np.unique(ids, return_index=True)
        picks.append(torch.from_numpy(ids[np.sort(first)[:k]].astype(np.int64)))
    return picks


def _best_lowest_first(s: np.ndarray, kk: int) -> np.ndarray:
    """s [..., n] -> the indices [..., kk] of each row's ``kk`` best, ascending; of the entries
    equal to the ``kk``-th best, the lowest indices (argpartition's choice among them is arbitrary)."""
    n = s.shape[-1]
    cut = np.partition(s, n - kk, axis=-1)[..., n - kk, None]  # [..., 1] the kk-th best
    above = s > cut
    tied = s == cut
    room = kk - above.sum(-1, keepdims=True)  # [..., 1] how many of the tied are taken
    keep = above | (tied & (np.cumsum(tied, -1) <= room))  # exactly kk per row
    return np.nonzero(keep.reshape(-1, n))[1].reshape(*s.shape[:-1], kk)
