"""The prefix compressors, one small dataclass each: settings are fields, ``score`` does the work.

Every method maps a prefilled context to scores S [layer, KV head, token]; :func:`evict` turns
them into a physically smaller cache. None of them sees the future questions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icekv.compress.scoring import keydiff_scores, refeed_scores
from icekv.errors import ConfigError

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


@dataclass(frozen=True)
class StreamingCompressor:
    """StreamingLLM: the sinks and the most recent tokens."""

    def score(self, engine, seq_id: int, ids: list[int], kv_budget: float) -> torch.Tensor:
        a = engine.model.args
        recency = torch.arange(len(ids), dtype=torch.float32) / len(ids)  # [T]
        return recency.expand(a.num_layers, a.num_kv_heads, -1)


@dataclass(frozen=True)
class KeyDiffCompressor:
    """KeyDiff: keep tokens whose keys differ most from the chunk's mean key direction."""

    chunk: int = 4096

    def score(self, engine, seq_id, ids, kv_budget):
        return keydiff_scores(engine.cache, seq_id, engine.model.args.num_layers, self.chunk)


@dataclass(frozen=True)
class SnapKVCompressor:
    """SnapKV, query-agnostic: the context's own last ``window`` tokens are the observers."""

    window: int = 32
    pool_kernel: int = 7

    def score(self, engine, seq_id, ids, kv_budget):
        t = len(ids)
        w = min(self.window, t - 1)
        allowed = torch.arange(t) < t - w  # the window re-attends the context before it
        s = refeed_scores(engine.model, engine.cache, seq_id, ids[t - w :], list(range(t - w, t)), allowed)
        s = torch.nn.functional.max_pool1d(s, self.pool_kernel, stride=1, padding=self.pool_kernel // 2)
        s[..., t - w :] = float("inf")  # the observers themselves stay
        return s


@dataclass(frozen=True)
class KVzipCompressor:
    """KVzip: re-feed the whole context behind a 'repeat' prompt; score = attention it pays."""

    chunk: int = 256

    def score(self, engine, seq_id, ids, kv_budget):
        fed = engine.tokenizer.encode(REPEAT_PROMPT) + list(ids)
        t = len(ids)
        return refeed_scores(engine.model, engine.cache, seq_id, fed, list(range(t, t + len(fed))),
                             torch.ones(t, dtype=torch.bool), self.chunk)


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
    n_sinks: int = 4

    def __post_init__(self) -> None:
        if self.rho is not None and not (0 < self.rho <= 1):
            raise ConfigError(f"rho must be in (0, 1], got {self.rho}")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")

    def score(self, engine, seq_id, ids, kv_budget):
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
                s = refeed_scores(engine.model, engine.cache, seq_id, [ids[i] for i in picked],
                                  list(range(t, t + n_feed)), allowed)
                scores[..., start:end] = s[..., start:end]
            proxy = scores.mean(dim=(0, 1))
        scores[..., : self.n_sinks] = 1.0
        return scores


COMPRESSORS = {
    "kv2": KV2Compressor,
    "kvzip": KVzipCompressor,
    "snapkv": SnapKVCompressor,
    "keydiff": KeyDiffCompressor,
    "streaming": StreamingCompressor,
}


def make_compressor(method: str, **settings):
    if method not in COMPRESSORS:
        raise ConfigError(f"unknown compression method {method!r}; choose from {', '.join(COMPRESSORS)}")
    return COMPRESSORS[method](**settings)
