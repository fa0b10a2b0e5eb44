"""Quest: contiguous pages ranked by an upper bound of q.k from per-page key min/max."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from icekv.methods.base import Policy
from icekv.methods.gqa import merge_ranked
from icekv.methods.selector import Selection, SequencePages, SequenceSelection

if TYPE_CHECKING:
    from icekv.model import ModelArgs
    from icekv.policies import PolicyPlan


@dataclass
class QuestSelector(SequenceSelection):
    """Page score = sum over dims of max(q_d * min_d, q_d * max_d) >= q.k of any key in the page."""

    page_size: int = 16
    pages: SequencePages = field(init=False)
    key_min: dict = field(init=False, default_factory=dict)  # layer -> [Hkv, n_pages, D]
    key_max: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.pages = SequencePages(self.page_size)

    def build(self, layer, keys, base):
        keys = keys.cpu()  # the bounds are kept and scored on the host
        self.pages.add_region(layer, keys.shape[1], base)
        paged = self.pages.paged(keys.float())  # [Hkv, m, P, D]
        self.key_min[layer], self.key_max[layer] = paged.amin(2), paged.amax(2)

    def insert(self, layer, keys):
        self.pages.grow(layer, keys.shape[1])
        paged = self.pages.paged(keys.cpu().float())  # [Hkv, m, P, D]
        self.key_min[layer] = torch.cat([self.key_min[layer], paged.amin(2)], 1)
        self.key_max[layer] = torch.cat([self.key_max[layer], paged.amax(2)], 1)

    def upper_bounds(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [Hq, D] -> page score bounds [Hq, n_pages]."""
        kmin, kmax = self.key_min[layer], self.key_max[layer]  # [Hkv, n, D]
        group = q.shape[0] // kmin.shape[0]
        kmin, kmax = kmin.repeat_interleave(group, 0), kmax.repeat_interleave(group, 0)  # [Hq, n, D]
        qf = q.float()[:, None, :]  # [Hq, 1, D]
        return torch.maximum(qf * kmin, qf * kmax).sum(-1)

    def select(self, layer, q, k):
        bounds = self.upper_bounds(layer, q.cpu())  # [Hq, n] the bounds are on the host
        hkv = self.key_min[layer].shape[0]
        # Quest's authors rank each head alone (MHA models): a KV head's query heads merge in head order
        merged = [merge_ranked(g, k, by_score=False) for g in bounds.chunk(hkv, dim=0)]
        return Selection.ranked(merged)  # pages never change

    def index_bytes(self) -> int:
        return sum(t.nbytes for t in (*self.key_min.values(), *self.key_max.values()))


def _index_bytes(plan: PolicyPlan, args: ModelArgs, tokens: int, dtype: str) -> int:
    """An fp32 min and max key per full page, per sparse layer and KV head."""
    layers = len(plan.sparse_layers(args))
    return layers * args.num_kv_heads * (tokens // plan.page_size) * 2 * args.head_dim * 4


POLICY = Policy("quest", selector=lambda plan: QuestSelector(plan.page_size), index_bytes=_index_bytes,
                extends_index=True)
