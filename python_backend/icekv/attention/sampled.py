"""Attention estimated from importance-weighted samples, merged with an exact part (MagicPIG).

Softmax attention over a set S of keys is sum_i e^{s_i} v_i / sum_i e^{s_i}. Over a sample where
key i was drawn with probability w_i, the terms weighted by 1/w_i estimate both sums; adding
-log w_i to each score does exactly that. The exact part (sink and window) and the sampled part
(the indexed region) are two partial softmaxes over disjoint keys, merged by their log-sum-exp.
"""

from __future__ import annotations

import torch


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
                  valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Hq, D] over per-head keys k, v [Hq, M, D] (``bias`` [Hq, M] added to the scaled scores,
    ``valid`` [Hq, M] masks) -> (out [Hq, D], log-sum-exp [Hq]); a head with no key gets out 0
    and lse -inf, so it drops out of a merge."""
    scores = torch.einsum("hd,hmd->hm", q.float(), k.float()) * q.shape[-1] ** -0.5  # [Hq, M]
    if bias is not None:
        scores = scores + bias
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [Hq]
    probs = torch.exp(scores - lse[:, None].clamp_min(torch.finfo(torch.float32).min)).nan_to_num(0.0)
    return torch.einsum("hm,hmd->hd", probs, v.float()), lse


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Two partial softmax attentions over disjoint keys ([Hq, D] and [Hq] each) -> the attention
    over their union [Hq, D]."""
    lse = torch.logaddexp(lse_a, lse_b)  # [Hq]
    wa, wb = torch.exp(lse_a - lse).nan_to_num(0.0), torch.exp(lse_b - lse).nan_to_num(0.0)
    return wa[:, None] * out_a + wb[:, None] * out_b
