"""Exact attention of new queries over a request's contiguous keys and values."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor
) -> torch.Tensor:
    """q [N, Hq, D] at ``q_positions`` [N]; k, v [Hkv, L, D] for positions 0..L-1 -> [N, Hq, D].

    Query ``i`` sees keys ``0 .. q_positions[i]``; query heads share KV heads in groups (GQA).
    """
    n, length = q.shape[0], k.shape[1]
    mask = None
    if n > 1 or int(q_positions[-1]) != length - 1:
        mask = torch.arange(length)[None, :] <= q_positions[:, None]  # [N, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True
    )  # [Hq, N, D]
    return out.transpose(0, 1)
