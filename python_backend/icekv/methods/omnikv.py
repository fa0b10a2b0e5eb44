"""OmniKV: filter layers attend in full, and their query picks the tokens the next layers attend.

No token is dropped: every decode step, at each filter layer (dense), the current query scores
the layer's indexed keys (q.k / sqrt(d), the maximum over all query heads: the authors' "last"
selector), and the best tokens form one set that every KV head of every budgeted layer up to the
next filter attends (besides the sink and the window). The filter layers' keys are kept here
(in OmniKV they stay on the device with the rest of those layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from icekv.errors import ConfigError
from icekv.methods.base import Policy, layers_outside, scale_layers
from icekv.methods.tokens import TokenPages, TokenSelection, top_tokens

if TYPE_CHECKING:
    from icekv.model import ModelArgs
    from icekv.policies import PolicyPlan


@dataclass(frozen=True)
class OmniKVConfig:
    """OmniKV (antgroup/OmniKV): a few filter layers attend in full and pick the tokens the layers
    after them attend. Filter layers are given for a 32-layer model and scaled to the depth."""

    filter_layers: tuple[int, ...] = (2, 8, 18)  # do_select_layers of the authors' Llama-3-8B config
    reference_depth: int = 32
    wait_layers: int = 1  # num_wait_load_layers: dense layers after each filter

    def __post_init__(self) -> None:
        if not self.filter_layers or min(self.filter_layers) < 1 or self.wait_layers < 0:
            raise ConfigError("omnikv needs filter layers >= 1 and wait_layers >= 0")

    def filters(self, num_layers: int) -> tuple[int, ...]:
        """The filter layers of a ``num_layers``-deep model (sorted, distinct; never layer 0)."""
        return tuple(f for f in scale_layers(self.filter_layers, self.reference_depth, num_layers) if f > 0) or (1,)

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        """Layers before the first filter, every filter and its wait layers."""
        filters = self.filters(num_layers)
        dense = set(range(filters[0]))
        for f in filters:
            dense.update(range(f, min(f + self.wait_layers + 1, num_layers)))
        return frozenset(dense)


def filter_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [Hq, D], a filter layer's keys [Hkv, n, D] -> token scores [n]: each query head's scaled
    q.k against its KV head, the maximum over query heads."""
    hkv, n, d = keys.shape
    qh = q.to(keys.dtype).view(hkv, -1, d)  # [Hkv, G, D]
    scores = qh @ keys.transpose(1, 2) * d**-0.5  # [Hkv, G, n]
    return scores.reshape(q.shape[0], n).amax(0).float()


@dataclass
class OmniKVSelector(TokenSelection):
    page_size: int = 16
    tokens: TokenPages = field(init=False)
    keys: dict = field(init=False, default_factory=dict)  # filter layer -> its indexed keys [Hkv, n, D]
    base: dict = field(init=False, default_factory=dict)  # filter layer -> position of local token 0
    _scores: torch.Tensor | None = field(init=False, default=None)  # the latest filter's token scores [n]
    _chosen: tuple | None = field(init=False, default=None)  # (k, per KV head positions) from those scores
    _filter: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.tokens = TokenPages(self.page_size)

    def build(self, layer, keys, base):
        self.keys[layer], self.base[layer] = keys.clone(), base  # where the keys are: the filter layer's device

    def insert(self, layer, keys):
        self.keys[layer] = torch.cat([self.keys[layer], keys.to(self.keys[layer].device, self.keys[layer].dtype)], 1)

    def observe(self, layer, q):
        """A filter layer's decode query [Hq, D]: the budgeted layers after it attend its best tokens."""
        self._scores, self._chosen, self._filter = filter_scores(q.to(self.keys[layer].device), self.keys[layer]).cpu(), None, layer

    def select(self, layer, q, k):
        if self._scores is None:
            raise ValueError(f"omnikv layer {layer} is budgeted but no filter layer ran before it")
        if self._chosen is None or self._chosen[0] != k:
            ids = top_tokens(self._scores[None], k * self.page_size)[0]
            self._chosen = (k, self.base[self._filter] + ids)
        hkv = self.keys[self._filter].shape[0]
        return self.tokens.select(layer, [self._chosen[1]] * hkv)


    def index_bytes(self) -> int:
        return 0

    def device_bytes(self) -> int:
        return sum(t.nbytes for t in self.keys.values())  # the filter layers' keys


def _budgeted(plan: PolicyPlan, num_layers: int) -> tuple[int, ...]:
    """Every layer but OmniKV's dense ones (:meth:`OmniKVConfig.dense_layers`)."""
    return layers_outside(plan.selection.omnikv.dense_layers(num_layers), num_layers)


def _filters(plan: PolicyPlan, num_layers: int) -> tuple[int, ...]:
    return plan.selection.omnikv.filters(num_layers)


def _device_index_bytes(plan: PolicyPlan, args: ModelArgs, tokens: int, device_type: str, dtype_bytes: int) -> int:
    """The filter layers' keys, kept where their query scores them."""
    return len(plan.index_layers(args)) * args.num_kv_heads * tokens * args.head_dim * dtype_bytes


POLICY = Policy("omnikv", selector=lambda plan: OmniKVSelector(plan.page_size), budgeted_layers=_budgeted,
                indexed_layers=_filters, device_index_bytes=_device_index_bytes)
