"""The DCI tree's deterministic shape: which tokens are promoted to which level (in sequence
order, by ``ratio_1`` and ``ratio_2``), and how a node's ranked children are cut into pages."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # a name only: the settings live with the method that uses the index
    from icekv.methods.icecache import IceCacheConfig


def promotion_step(cfg: IceCacheConfig) -> int:
    """Every ``promotion_step``-th token (local index) is promoted to level 1 or above."""
    return max(round(1 / cfg.ratio_1), 1)


def upper_step(cfg: IceCacheConfig) -> int:
    """Every ``upper_step``-th token of a level >= 1 is promoted one level higher."""
    return max(round(1 / cfg.ratio_2), 2)


def promotion_levels(j: torch.Tensor, cfg: IceCacheConfig) -> torch.Tensor:
    """Level of the tokens with local indices ``j`` [n]: a deterministic schedule in sequence order.

    Every ``1/ratio_1``-th token reaches level 1, every ``1/ratio_2``-th of those level 2, and so
    on up to ``max_level``; token 0 always sits at the top level.
    """
    step1, step2 = promotion_step(cfg), upper_step(cfg)
    level = torch.zeros_like(j)
    promoted = j % step1 == 0
    q = j // step1
    for up in range(cfg.max_level):
        level += promoted.long()
        promoted = promoted & (q % step2 ** (up + 1) == 0)
    return level


def balanced_cut(rank: torch.Tensor, count: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each group of ``count`` ranked items into ``ceil(count/P)`` near-equal pages.

    rank, count [n] -> (page index within the group [n], slot within the page [n], pages per
    group [n]). Pages hold between ``floor(count/m)`` and ``ceil(count/m) <= P`` items, so at
    least ``P/2`` once a group has ``P`` or more items.
    """
    m = (count + page_size - 1) // page_size  # [n]
    page = rank * m // count  # [n]
    first = (page * count + m - 1) // m  # [n] rank of the page's first item
    return page, rank - first, m
