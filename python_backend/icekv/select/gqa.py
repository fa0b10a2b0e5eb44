"""Merge the page rankings of the query heads that share one KV head."""

from __future__ import annotations

import numpy as np
import torch


def merge_ranked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [G, n] (``-inf`` = not a candidate) -> up to ``k`` page ids [k'] (long).

    Each query head ranks its pages; the lists are interleaved by rank (every head's best, then
    every head's second, ...), duplicates dropped, and the first ``k`` kept. Runs in numpy: it is
    called per KV head and layer every step, on arrays small enough for call overhead to dominate.
    """
    s = scores.float().numpy()
    g, n = s.shape
    if n == 0 or k == 0:
        return torch.zeros(0, dtype=torch.long)
    kk = min(k, n)
    top = np.argpartition(s, n - kk, axis=1)[:, n - kk:]  # [G, kk] the best, unordered
    vals = np.take_along_axis(s, top, 1)
    order = np.argsort(-vals, axis=1, kind="stable")  # best first within each head
    top, vals = np.take_along_axis(top, order, 1), np.take_along_axis(vals, order, 1)
    ids = top.T.ravel()[np.isfinite(vals.T.ravel())]  # rank-major, candidates only
    _, first = np.unique(ids, return_index=True)
    return torch.from_numpy(ids[np.sort(first)[:k]].astype(np.int64))
