"""StreamingLLM as a prefix compressor: keep the sinks and the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StreamingCompressor:
    """StreamingLLM: the sinks and the most recent tokens."""

    def score_steps(self, engine, seq_id: int, ids: list[int], kv_budget: float):
        """One slice: no model pass."""
        yield
        a = engine.model.args
        recency = torch.arange(len(ids), dtype=torch.float32) / len(ids)  # [T]
        return recency.expand(a.num_layers, a.num_kv_heads, -1)
