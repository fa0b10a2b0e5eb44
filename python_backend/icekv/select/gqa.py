"""Merge the page rankings of the query heads that share one KV head."""

from __future__ import annotations

import torch


def merge_ranked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [G, n] (``-inf`` = not a candidate) -> up to ``k`` page ids [k'] .

    Each query head ranks its pages; the lists are interleaved by rank (every head's best, then
    every head's second, ...), duplicates dropped, and the first ``k`` kept.
    """
    g, n = scores.shape
    if n == 0 or k == 0:
        return torch.zeros(0, dtype=torch.long)
    top = scores.topk(min(k, n), dim=-1)  # [G, k]
    ids = top.indices.T.flatten()  # [k*G] rank-major
    ids = ids[torch.isfinite(top.values.T.flatten())]
    if len(ids) == 0:
        return ids
    uniq, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((len(uniq),), len(ids)).scatter_reduce(0, inverse, torch.arange(len(ids)), "amin")
    return ids[first.sort().values[:k]]
