"""KVzip: score tokens by the attention a full re-read of the context pays them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icekv.compress.scoring import ScoringContext

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


@dataclass(frozen=True)
class KVzipCompressor:
    """KVzip: re-feed the whole context behind a 'repeat' prompt; score = attention it pays."""

    chunk: int = 256

    def score_steps(self, ctx: ScoringContext):
        fed = ctx.encode(REPEAT_PROMPT) + list(ctx.ids)
        t = len(ctx.ids)
        return (yield from ctx.refeed(fed, list(range(t, t + len(fed))), torch.ones(t, dtype=torch.bool),
                                      chunk=self.chunk))
