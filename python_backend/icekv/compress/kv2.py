"""KV²: a cheap proxy picks a few tokens per chunk; re-fed, their attention scores the chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icekv.compress.evict import CONTEXT_SINKS
from icekv.compress.scoring import ScoringContext
from icekv.compress.snapkv import SnapKVCompressor
from icekv.errors import ConfigError

ATTEND = ("chunk", "context")
PROXIES = ("keydiff", "snapkv")


@dataclass(frozen=True)
class KV2Compressor:
    """KV²: per chunk of the context, a proxy picks a share of its tokens; only those are re-fed
    (after the context) and the attention they pay over [sinks | chunk | re-fed] scores the chunk.

    rho: the share of each chunk re-fed; None: ``rho_scale`` times the KV budget (at most all).
        The default re-feeds 10x the budget (chosen by a sweep: docs/engine.md, "Why these
        defaults"); the authors' ablation also favours a share larger than the budget.
    rounds: > 1 uses a round's scores as the next round's proxy.
    normalize: KV²+ scores, each attention weight scaled by ||W_o v_j|| / ||h_i||.
    attend: what the re-fed tokens' outputs attend: "chunk" (sinks + their chunk, as scored) or
        "context" (the whole context, as the authors' code does; only the scores stay per chunk).
    proxy: "keydiff" (keys that stand out from their chunk's mean key) or "snapkv" (the attention
        of the context's last tokens).
    chunk: tokens per scored chunk.
    n_sinks: the context's first tokens, which every re-fed token attends besides its chunk.
    """

    rho: float | None = None
    rho_scale: float = 10.0
    rounds: int = 1
    normalize: bool = False
    attend: str = "chunk"
    proxy: str = "keydiff"
    chunk: int = 4096
    n_sinks: int = CONTEXT_SINKS

    def __post_init__(self) -> None:
        if self.rho is not None and not (0 < self.rho <= 1):
            raise ConfigError(f"rho must be in (0, 1], got {self.rho}")
        if not self.rho_scale > 0:
            raise ConfigError(f"rho_scale must be > 0, got {self.rho_scale}")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if self.attend not in ATTEND:
            raise ConfigError(f"attend must be one of {', '.join(ATTEND)}, got {self.attend!r}")
        if self.proxy not in PROXIES:
            raise ConfigError(f"proxy must be one of {', '.join(PROXIES)}, got {self.proxy!r}")
        if self.chunk < 1:
            raise ConfigError(f"chunk must be >= 1, got {self.chunk}")
        if self.n_sinks < 0:
            raise ConfigError(f"n_sinks must be >= 0, got {self.n_sinks}")

    def refeed_share(self, kv_budget: float) -> float:
        """The share of each chunk re-fed at ``kv_budget``."""
        return self.rho if self.rho is not None else min(1.0, self.rho_scale * kv_budget)

    def _proxy_steps(self, ctx: ScoringContext):
        """The proxy's per-token scores [T] (a generator: SnapKV's costs a model pass)."""
        if self.proxy == "keydiff":
            return ctx.keydiff(self.chunk).mean(dim=(0, 1))
        s = yield from SnapKVCompressor().score_steps(ctx)  # [L, Hkv, T]
        s = s.mean(dim=(0, 1))  # [T]; its own window scores +inf
        finite = s[torch.isfinite(s)]
        return s.nan_to_num(posinf=float(finite.max()) if finite.numel() else 0.0)

    def score_steps(self, ctx: ScoringContext):
        ids = ctx.ids
        t = len(ids)
        rho = self.refeed_share(ctx.kv_budget)
        proxy = yield from self._proxy_steps(ctx)  # [T]
        scores = torch.zeros(ctx.num_layers, ctx.num_kv_heads, t)
        everything = torch.ones(t, dtype=torch.bool)
        for _ in range(self.rounds):
            for start in range(0, t, self.chunk):
                end = min(start + self.chunk, t)
                n_feed = max(1, round(rho * (end - start)))
                picked = (proxy[start:end].topk(n_feed).indices + start).sort().values.tolist()
                scored = torch.zeros(t, dtype=torch.bool)
                scored[: self.n_sinks] = True
                scored[start:end] = True
                s = yield from ctx.refeed([ids[i] for i in picked], list(range(t, t + n_feed)), scored,
                                          visible=everything if self.attend == "context" else None,
                                          normalize=self.normalize)
                scores[..., start:end] = s[..., start:end]
            proxy = scores.mean(dim=(0, 1))
        return scores  # the sinks are kept by eviction whatever they score
