"""Reference sparse paged attention: one decode query over [sink | selected pages | window]."""

from __future__ import annotations

import torch

from icekv.attention.dense import decode_attention


def sparse_paged_attention(
    q: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    page_k: torch.Tensor,
    page_v: torch.Tensor,
    page_len: torch.Tensor,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
) -> torch.Tensor:
    """Attention of one token's queries over each KV head's own page selection.

    q [Hq, D]; sink_k/v [Hkv, S, D]; page_k/v [Hkv, K, P, D] with ``page_len`` [Hkv, K] valid
    tokens per page (0 = an empty slot, masked out); win_k/v [Hkv, W, D]. Query head ``h``
    reads KV head ``h // (Hq / Hkv)``. Returns [Hq, D]. Order of keys does not matter: the decode
    query may see every cached token, so no causal mask is needed.
    """
    hkv, n_pages, page_size, d = page_k.shape
    keys = torch.cat([sink_k, page_k.reshape(hkv, n_pages * page_size, d), win_k], dim=1)  # [Hkv, L, D]
    values = torch.cat([sink_v, page_v.reshape(hkv, n_pages * page_size, d), win_v], dim=1)
    slot = torch.arange(page_size)  # [P]
    page_mask = (slot[None, None, :] < page_len[:, :, None]).reshape(hkv, n_pages * page_size)
    mask = torch.cat(
        [
            torch.ones(hkv, sink_k.shape[1], dtype=torch.bool),
            page_mask,
            torch.ones(hkv, win_k.shape[1], dtype=torch.bool),
        ],
        dim=1,
    )  # [Hkv, L]
    return decode_attention(q, keys.to(q.dtype), values.to(q.dtype), mask)
