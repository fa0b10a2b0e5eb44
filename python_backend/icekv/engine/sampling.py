"""Pick the next token from logits: greedy, or temperature + nucleus sampling with a seed."""

from __future__ import annotations

import torch

from icekv.config import SamplingConfig


def sample_next(
    logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None
) -> int:
    """logits [V] -> a token id. Greedy when ``cfg.temperature == 0``."""
    if cfg.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)  # [V]
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)  # [V]
        outside = torch.cumsum(sorted_p, 0) - sorted_p > cfg.top_p  # [V] mass before >= top_p
        sorted_p[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
