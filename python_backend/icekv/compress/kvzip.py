"""KVzip: score tokens by the attention a full re-read of the context pays them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icekv.compress.scoring import refeed_steps

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


@dataclass(frozen=True)
class KVzipCompressor:
    """KVzip: re-feed the whole context behind a 'repeat' prompt; score = attention it pays."""

    chunk: int = 256

    def score_steps(self, engine, seq_id, ids, kv_budget):
        fed = engine.tokenizer.encode(REPEAT_PROMPT) + list(ids)
        t = len(ids)
        return (yield from refeed_steps(engine.model, engine.cache, seq_id, fed, list(range(t, t + len(fed))),
                                        torch.ones(t, dtype=torch.bool), self.chunk))
