"""KV²: a cheap proxy picks a few tokens per chunk; re-fed, their attention scores the chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icekv.compress.evict import CONTEXT_SINKS
from icekv.compress.scoring import keydiff_scores, refeed_steps
from icekv.errors import ConfigError


@dataclass(frozen=True)
class KV2Compressor:
    """KV²: per chunk, a KeyDiff proxy picks ``rho`` of the tokens; only those are re-fed (after the
    context) and their attention over [sinks | chunk | re-fed] scores the chunk.

    ``rho`` None means the KV budget (the paper's default); ``rounds`` > 1 uses a round's scores
    as the next round's proxy.
    """

    rho: float | None = None
    rounds: int = 1
    chunk: int = 4096
    n_sinks: int = CONTEXT_SINKS

    def __post_init__(self) -> None:
        if self.rho is not None and not (0 < self.rho <= 1):
            raise ConfigError(f"rho must be in (0, 1], got {self.rho}")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")

    def score_steps(self, engine, seq_id, ids, kv_budget):
        a = engine.model.args
        t = len(ids)
        rho = self.rho if self.rho is not None else kv_budget
        proxy = keydiff_scores(engine.cache, seq_id, a.num_layers, self.chunk).mean(dim=(0, 1))  # [T]
        scores = torch.zeros(a.num_layers, a.num_kv_heads, t)
        for _ in range(self.rounds):
            for start in range(0, t, self.chunk):
                end = min(start + self.chunk, t)
                n_feed = max(1, round(rho * (end - start)))
                picked = (proxy[start:end].topk(n_feed).indices + start).sort().values.tolist()
                allowed = torch.zeros(t, dtype=torch.bool)
                allowed[: self.n_sinks] = True
                allowed[start:end] = True
                s = yield from refeed_steps(engine.model, engine.cache, seq_id, [ids[i] for i in picked],
                                            list(range(t, t + n_feed)), allowed)
                scores[..., start:end] = s[..., start:end]
            proxy = scores.mean(dim=(0, 1))
        scores[..., : self.n_sinks] = 1.0
        return scores
