"""Exact attention of new queries over a request's contiguous keys and values."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One token's queries q [Hq, D] over k, v [Hkv, L, D]; mask [Hkv, L] (True = attend).

    GQA by reshaping the queries to [Hkv, G, D]: no copy of K/V per query head.
    """
    hkv, _, d = k.shape
    scores = torch.matmul(q.view(hkv, -1, d), k.transpose(1, 2)) * d**-0.5  # [Hkv, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.matmul(scores.softmax(-1), v).reshape(q.shape)  # [Hq, D]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor
) -> torch.Tensor:
    """q [N, Hq, D] at ``q_positions`` [N]; k, v [Hkv, L, D] for positions 0..L-1 -> [N, Hq, D].

    Query ``i`` sees keys ``0 .. q_positions[i]``; query heads share KV heads in groups (GQA).
    """
    n, length = q.shape[0], k.shape[1]
    if n == 1 and int(q_positions[0]) == length - 1:  # a decode step sees everything
        return decode_attention(q[0], k, v)[None]
    mask = torch.arange(length)[None, :] <= q_positions[:, None]  # [N, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True
    )  # [Hq, N, D]
    return out.transpose(0, 1)
