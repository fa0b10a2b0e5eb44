"""Copying single tokens' K/V rows out of the pool: a compiled loop for a pool in CPU memory, and
its torch reference (any device)."""

from __future__ import annotations

import numba
import numpy as np
import torch


def as_bits(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as same-width integers in numpy: for copying values of any dtype (bf16
    included, which numpy lacks) without reading them."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()


def gather_tokens_reference(pool_layer: torch.Tensor, page_ids: torch.Tensor, heads: torch.Tensor,
                            positions: torch.Tensor) -> torch.Tensor:
    """:meth:`PagedKVCache.gather_tokens` in torch (any device): pool_layer [2, Hkv, pages, P, D],
    the request's page_ids [pages], heads [n], positions [n, P] -> [2, n, P, D]."""
    _, _, num_pages, page_size, d = pool_layer.shape
    valid = positions >= 0  # [n, P]
    pos = positions.clamp_min(0)
    pages = page_ids.to(pos.device)[pos // page_size]  # [n, P]
    rows = (heads[:, None] * num_pages + pages) * page_size + pos % page_size  # [n, P] into [Hkv*pages*P]
    rows = rows.to(pool_layer.device)
    kv = pool_layer.reshape(2, -1, d).index_select(1, rows.flatten()).view(2, *rows.shape, d)  # [2, n, P, D]
    return kv.masked_fill_(~valid.to(kv.device)[None, :, :, None], 0)


@numba.njit(cache=True, nogil=True, parallel=True)  # rows in parallel: each is a cache miss
def copy_rows(pool_layer, page_ids, heads, positions, out):
    """out[:, i, j] = the K/V row of position positions[i, j] of head heads[i], 0 where it is -1."""
    n, p = positions.shape
    for row in numba.prange(n * p):
        i, j = row // p, row % p
        copy_token(pool_layer, page_ids, heads[i], positions[i, j], out[0, i, j], out[1, i, j])


@numba.njit(cache=True, nogil=True)
def copy_token(pool_layer, page_ids, head, pos, k_row, v_row):
    """k_row, v_row [D] = the K/V of position ``pos`` of ``head`` in pool_layer [2, Hkv, pages, P,
    D] (page list ``page_ids``), zeros when pos is -1. Element loops: numba copies explicit loops
    several times faster than row slices."""
    if pos < 0:
        for t in range(k_row.shape[0]):
            k_row[t] = 0
            v_row[t] = 0
        return
    k_src, v_src = pool_row(pool_layer, 0, page_ids, head, pos), pool_row(pool_layer, 1, page_ids, head, pos)
    for t in range(k_row.shape[0]):
        k_row[t] = k_src[t]
        v_row[t] = v_src[t]


@numba.njit(cache=True, nogil=True, inline="always")
def pool_row(pool_layer, kv, page_ids, head, pos):
    """The K (kv = 0) or V (kv = 1) row [D] of position ``pos`` of ``head`` in pool_layer [2, Hkv,
    pages, P, D] of a request whose page list is ``page_ids``: a view, not a copy."""
    page_size = pool_layer.shape[3]
    return pool_layer[kv, head, page_ids[pos // page_size], pos % page_size]
