"""StreamingLLM as a prefix compressor: keep the sinks and the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icekv.compress.scoring import ScoringContext


@dataclass(frozen=True)
class StreamingCompressor:
    """StreamingLLM: the sinks and the most recent tokens."""

    def score_steps(self, ctx: ScoringContext):
        """One slice: no model pass."""
        yield
        recency = torch.arange(len(ctx.ids), dtype=torch.float32) / len(ctx.ids)  # [T]
        return recency.expand(ctx.num_layers, ctx.num_kv_heads, -1)
