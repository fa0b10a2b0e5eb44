"""SnapKV at decode time: the prompt's last queries vote once for the tokens every step attends.

The observation window is the prompt's last ``window`` queries (with a question at the end of the
prompt, the question's). Their attention over the prompt (softmax over every prompt key, causal
within the window) is summed over the window and average-pooled along the sequence (``kernel``);
the query heads of a KV group are averaged (the GQA rule of kvpress's SnapKV: the authors' code
repeats K/V per query head). Each KV head keeps its best indexed tokens for the whole decode.
Tokens that leave the window during decode are kept too, ahead of the prompt's lowest-voted
(SnapKV appends every generated token; under a fixed budget they displace the weakest votes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from icekv.errors import ConfigError
from icekv.methods.base import Policy
from icekv.methods.tokens import TokenPages, TokenSelection, top_tokens

if TYPE_CHECKING:
    from icekv.model import ModelArgs
    from icekv.policies import PolicyPlan


@dataclass(frozen=True)
class SnapKVConfig:
    """SnapKV (FasterDecoding/SnapKV) at decode time: the prompt's last ``window`` queries vote."""

    window: int = 32  # window_size: the observation window (the prompt's last tokens)
    kernel: int = 5  # kernel_size of the 1-D pooling over the votes

    def __post_init__(self) -> None:
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError("snapkv needs window >= 1 and an odd kernel >= 1")


def window_votes(queries: torch.Tensor, keys: torch.Tensor, kernel: int) -> torch.Tensor:
    """queries [W, Hq, D] of the prompt's last W tokens, keys [Hkv, T, D] of the whole prompt ->
    pooled votes per KV head for every prompt token [Hkv, T]."""
    w, hq, d = queries.shape
    hkv, t, _ = keys.shape
    qh = queries.float().permute(1, 0, 2).reshape(hkv, -1, d)  # [Hkv, G*W, D]
    scores = (qh @ keys.float().transpose(1, 2) * d**-0.5).view(hkv, hq // hkv, w, t)  # [Hkv, G, W, T]
    own = torch.arange(t - w, t)  # the window's own positions
    scores = scores.masked_fill(torch.arange(t)[None, :] > own[:, None], float("-inf"))  # causal in the window
    votes = scores.softmax(-1).sum(2)  # [Hkv, G, T]
    pooled = F.avg_pool1d(votes, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return pooled.mean(1)  # [Hkv, T]


@dataclass
class SnapKVSelector(TokenSelection):
    page_size: int = 16
    config: SnapKVConfig = field(default_factory=SnapKVConfig)
    tokens: TokenPages = field(init=False)
    votes: dict = field(init=False, default_factory=dict)  # layer -> votes of the indexed tokens [Hkv, n]
    _prompt_votes: dict = field(init=False, default_factory=dict)  # layer -> votes of every prompt token [Hkv, T]
    base: dict = field(init=False, default_factory=dict)
    _chosen: dict = field(init=False, default_factory=dict)  # layer -> (k, n, selection)

    def __post_init__(self) -> None:
        self.tokens = TokenPages(self.page_size)

    def observe_prompt(self, layer, queries, keys):
        """The prompt's last queries [W, Hq, D] (up to the window the prefill kept) and its keys
        [Hkv, T, D]."""
        self._prompt_votes[layer] = window_votes(queries.cpu(), keys.cpu(), self.config.kernel)

    def build(self, layer, keys, base):
        n = keys.shape[1]
        self.base[layer] = base
        self.votes[layer] = self._prompt_votes.pop(layer)[:, base: base + n].contiguous()

    def insert(self, layer, keys):
        hkv, p, _ = keys.shape
        n = self.votes[layer].shape[1]
        # above any prompt vote (a sum of at most ``window`` probabilities), the newest highest
        flushed = self.config.window + 1.0 + torch.arange(n, n + p, dtype=torch.float32)
        self.votes[layer] = torch.cat([self.votes[layer], flushed.expand(hkv, p)], 1)

    def select(self, layer, q, k):
        n = self.votes[layer].shape[1]
        chosen = self._chosen.get(layer)
        if chosen is None or chosen[:2] != (k, n):  # the votes change only when the window flushes
            per_head = [self.base[layer] + ids for ids in top_tokens(self.votes[layer], k * self.page_size)]
            chosen = self._chosen[layer] = (k, n, per_head)
        return self.tokens.select(layer, chosen[2])


    def index_bytes(self) -> int:
        return sum(t.nbytes for t in self.votes.values())


def _index_bytes(plan: PolicyPlan, args: ModelArgs, tokens: int, dtype: str) -> int:
    """An fp32 vote per token, per budgeted layer and KV head."""
    return len(plan.sparse_layers(args)) * args.num_kv_heads * tokens * 4


POLICY = Policy("snapkv", selector=lambda plan: SnapKVSelector(plan.page_size, plan.selection.snapkv),
                index_bytes=_index_bytes, window_queries=lambda selection: selection.snapkv.window)
