"""OmniKV: filter layers attend in full, and their query picks the tokens the next layers attend.

No token is dropped: every decode step, at each filter layer (dense), the current query scores
the layer's indexed keys (q.k / sqrt(d), the maximum over all query heads: the authors' "last"
selector), and the best tokens form one set that every KV head of every budgeted layer up to the
next filter attends (besides the sink and the window). The filter layers' keys are kept here
(in OmniKV they stay on the device with the rest of those layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from icekv.select.tokens import TokenPages, TokenSelection, top_tokens


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
