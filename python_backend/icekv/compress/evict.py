"""One global threshold over every (layer, KV head, token) score: per-layer, per-head budgets."""

from __future__ import annotations

import torch

from icekv.errors import ConfigError

CONTEXT_SINKS = 4  # a compressed context's first tokens, kept in every layer and head (attention sinks)


def evict(scores: torch.Tensor, kv_budget: float, n_sinks: int = CONTEXT_SINKS) -> torch.Tensor:
    """scores [L, Hkv, T] -> keep mask [L, Hkv, T] with exactly round(kv_budget * L*Hkv*T) kept.

    The first ``n_sinks`` tokens of every head are always kept (they count against the budget);
    ties are broken by position, so the result is deterministic.
    """
    if not (0.0 < kv_budget <= 1.0):
        raise ConfigError(f"kv_budget must be in (0, 1], got {kv_budget}")
    n_layers, n_heads, length = scores.shape
    n_keep = max(round(kv_budget * scores.numel()), min(n_sinks, length) * n_layers * n_heads)
    ranked = scores.float().clone()
    ranked[..., :n_sinks] = float("inf")
    flat = ranked.flatten()
    order = torch.argsort(flat, descending=True, stable=True)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[order[:n_keep]] = True
    return keep.view(n_layers, n_heads, length)
