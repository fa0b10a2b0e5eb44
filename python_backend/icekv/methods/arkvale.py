"""ArkVale: contiguous pages ranked by a digest bound; the best resident pages stay on the device.

A page's digest is its keys' box shrunk to the mean distance from its centre: per dimension,
centre c = (max + min) / 2 and d = mean |k - c|, bounds c +- d. A query scores a page by
sum_d max(q_d (c_d + d_d), q_d (c_d - d_d)) (no softmax scaling, as in the authors' estimate
kernel), averaged over the query heads of each group of KV heads (one group: one ranking per
layer). Each step the top ``topk_share`` of the slots are refilled from the ranking and the rest
keep the best-scoring pages already resident, so a page is recalled from the host only when it
outranks a resident one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from icekv.errors import ConfigError
from icekv.methods.base import Policy
from icekv.methods.selector import Selection, SequencePages, SequenceSelection

if TYPE_CHECKING:
    from icekv.model import ModelArgs
    from icekv.policies import PolicyPlan


@dataclass(frozen=True)
class ArkValeConfig:
    """ArkVale (pku-liang/ArkVale): a page digest (its keys' box, shrunk to the mean distance from
    its centre) bounds q.k; the top pages are recalled, the best resident ones stay."""

    groups: int = 1  # n_groups: KV heads ranked together (1: one ranking per layer, the authors' default)
    topk_share: float = 0.5  # page_topks = budget // 2: the share of slots refilled from the ranking each step

    def __post_init__(self) -> None:
        if self.groups < 1 or not 0 < self.topk_share <= 1:
            raise ConfigError("arkvale needs groups >= 1 and topk_share in (0, 1]")


def page_digests(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [Hkv, n, P, D] -> the digests' upper and lower bounds [Hkv, n, D] each."""
    centre = (pages.amax(2) + pages.amin(2)) / 2  # [Hkv, n, D]
    spread = (pages - centre[:, :, None]).abs().mean(2)  # [Hkv, n, D]
    return centre + spread, centre - spread


def digest_scores(q: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, groups: int) -> torch.Tensor:
    """q [Hq, D], bounds [Hkv, n, D] -> page scores [groups, n]: each query head against its KV
    head's digests, averaged over the query heads of each group. As upper >= lower, the bound
    max(q_d u_d, q_d l_d) is q_d u_d where q_d >= 0 and q_d l_d elsewhere: two products."""
    hkv = upper.shape[0]
    qh = q.float().view(hkv, -1, q.shape[-1])  # [Hkv, G, D]
    per_head = qh.clamp_min(0) @ upper.transpose(1, 2) + qh.clamp_max(0) @ lower.transpose(1, 2)  # [Hkv, G, n]
    return per_head.reshape(groups, hkv // groups * qh.shape[1], -1).mean(1)  # [groups, n]


def digest_scores_reference(q: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, groups: int) -> torch.Tensor:
    """:func:`digest_scores` as the authors write it, dimension by dimension."""
    hkv = upper.shape[0]
    qh = q.float().view(hkv, -1, 1, q.shape[-1])  # [Hkv, G, 1, D]
    per_head = torch.maximum(qh * upper[:, None], qh * lower[:, None]).sum(-1)  # [Hkv, G, n]
    return per_head.reshape(groups, hkv // groups * qh.shape[1], -1).mean(1)


@dataclass
class ArkValeSelector(SequenceSelection):
    page_size: int = 16
    config: ArkValeConfig = field(default_factory=ArkValeConfig)
    pages: SequencePages = field(init=False)
    upper: dict = field(init=False, default_factory=dict)  # layer -> [Hkv, n_pages, D]
    lower: dict = field(init=False, default_factory=dict)
    resident: dict = field(init=False, default_factory=dict)  # layer -> per group the pages held [k]

    def __post_init__(self) -> None:
        self.pages = SequencePages(self.page_size)

    def build(self, layer, keys, base):
        keys = keys.cpu().float()  # the digests are kept and scored on the host
        hkv, n, _ = keys.shape
        if hkv % self.config.groups:
            raise ValueError(f"arkvale groups ({self.config.groups}) must divide the KV heads ({hkv})")
        self.pages.add_region(layer, n, base)
        self.upper[layer], self.lower[layer] = page_digests(self.pages.paged(keys))
        self.resident[layer] = [torch.zeros(0, dtype=torch.long)] * self.config.groups

    def insert(self, layer, keys):
        self.pages.grow(layer, keys.shape[1])
        upper, lower = page_digests(self.pages.paged(keys.cpu().float()))
        self.upper[layer] = torch.cat([self.upper[layer], upper], 1)
        self.lower[layer] = torch.cat([self.lower[layer], lower], 1)

    def select(self, layer, q, k):
        scores = digest_scores(q.cpu(), self.upper[layer], self.lower[layer], self.config.groups)  # [groups, n]
        n = scores.shape[1]
        k = min(k, n)
        fresh = max(1, int(self.config.topk_share * k)) if k else 0
        picks = []
        for g, row in enumerate(scores):
            top = row.topk(fresh).indices  # [fresh] best first
            kept = self.resident[layer][g]
            kept = kept[~torch.isin(kept, top)]
            kept = kept[row[kept].argsort(descending=True)][: k - fresh]  # the best resident pages stay
            chosen = torch.cat([top, kept])
            if len(chosen) < k:  # too few resident: the ranking fills the rest
                rest = row.clone()
                rest[chosen] = float("-inf")
                chosen = torch.cat([chosen, rest.topk(k - len(chosen)).indices])
            self.resident[layer][g] = chosen
            picks.append(chosen)
        per_kv_head = len(self.upper[layer]) // self.config.groups
        return Selection.ranked([picks[h // per_kv_head] for h in range(len(self.upper[layer]))])

    def index_bytes(self) -> int:
        return sum(t.nbytes for t in (*self.upper.values(), *self.lower.values()))


def _index_bytes(plan: PolicyPlan, args: ModelArgs, tokens: int, dtype: str) -> int:
    """Two fp32 digest bounds per full page, per budgeted layer and KV head."""
    layers = len(plan.sparse_layers(args))
    return layers * args.num_kv_heads * (tokens // plan.page_size) * 2 * args.head_dim * 4


POLICY = Policy("arkvale", selector=lambda plan: ArkValeSelector(plan.page_size, plan.selection.arkvale),
                index_bytes=_index_bytes)
