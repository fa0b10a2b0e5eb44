"""SnapKV without a question: the context's last tokens observe, their attention scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icekv.compress.scoring import ScoringContext


@dataclass(frozen=True)
class SnapKVCompressor:
    """SnapKV, query-agnostic: the context's own last ``window`` tokens are the observers."""

    window: int = 32
    pool_kernel: int = 7

    def score_steps(self, ctx: ScoringContext):
        ids = ctx.ids
        t = len(ids)
        w = min(self.window, t - 1)
        allowed = torch.arange(t) < t - w  # the window re-attends the context before it
        s = yield from ctx.refeed(ids[t - w :], list(range(t - w, t)), allowed)
        s = torch.nn.functional.max_pool1d(s, self.pool_kernel, stride=1, padding=self.pool_kernel // 2)
        s[..., t - w :] = float("inf")  # the observers themselves stay
        return s
