"""Exact attention of new queries over a request's contiguous keys and values, within a sliding
window where a layer has one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def is_decode_step(q_positions: torch.Tensor, length: int) -> bool:
    """One query at the last of ``length`` positions: it sees every key given, no causal mask
    needed (a local layer gives it only its window's keys)."""
    return len(q_positions) == 1 and int(q_positions[0]) == length - 1


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One token's queries q [Hq, D] over k, v [Hkv, L, D]; mask [Hkv, L] (True = attend).

    GQA by reshaping the queries to [Hkv, G, D]: no copy of K/V per query head.
    """
    hkv, _, d = k.shape
    scores = torch.matmul(q.view(hkv, -1, d), k.transpose(1, 2)) * d**-0.5  # [Hkv, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.matmul(scores.softmax(-1), v).reshape(q.shape)  # [Hq, D]


def decode_attention_chunks(q: torch.Tensor, chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """:func:`decode_attention` over keys and values given in pieces [(k_i, v_i) [Hkv, L_i, D]]:
    one softmax across all of them, without concatenating K/V (only the scores are joined)."""
    if len(chunks) == 1:
        return decode_attention(q, *chunks[0])
    hkv, _, d = chunks[0][0].shape
    qg = q.view(hkv, -1, d)  # [Hkv, G, D]
    probs = torch.cat([torch.matmul(qg, k.transpose(1, 2)) for k, _ in chunks], -1).mul_(d**-0.5).softmax(-1)  # [Hkv, G, L]
    out, at = 0, 0
    for k, v in chunks:
        out = out + torch.matmul(probs[..., at : at + k.shape[1]], v)  # [Hkv, G, D]
        at += k.shape[1]
    return out.reshape(q.shape)  # [Hq, D]


def first_visible_key(first_query: int, window: int | None) -> int:
    """The first key position a query at ``first_query`` or later sees under a sliding ``window``
    (the tokens a query attends back, its own included; None: every token)."""
    return 0 if window is None else max(0, first_query - window + 1)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """q [N, Hq, D] at ``q_positions`` [N]; k, v [Hkv, L, D] for positions 0..L-1 -> [N, Hq, D].

    Query ``i`` sees keys ``0 .. q_positions[i]`` (ascending positions), only the last ``window``
    of them when a window is given; query heads share KV heads in groups (GQA).
    """
    length, n = k.shape[1], q.shape[0]
    if is_decode_step(q_positions, length) and (window is None or length <= window):
        return decode_attention(q[0], k, v)[None]
    chunk = int(q_positions[0]) == length - n and int(q_positions[-1]) == length - 1  # the last n positions
    if chunk and window is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        mask = causal_lower_right(n, length)  # the form flash attention takes (with GQA)
    else:
        keys, queries = torch.arange(length, device=q.device)[None, :], q_positions.to(q.device)[:, None]
        mask = keys <= queries  # [N, L]
        if window is not None:
            mask &= keys > queries - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                         enable_gqa=True)  # [1, Hq, N, D]: the fused kernels take 4-D
    return out[0].transpose(0, 1)
