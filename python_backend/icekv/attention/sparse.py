"""Sparse paged attention: one decode query over [sink | selected pages | window].

The torch reference is the specification; on CUDA (or when ``ICEKV_KERNELS=triton``)
:func:`sparse_paged_attention` runs icekv's OpenAI-Triton kernel instead, on a CPU (fp32) its
compiled twin (:mod:`icekv.kernels.cpu_decode`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from icekv.kv.quant import KVFormat


def paged_prefix_attention(
    q: torch.Tensor,
    page_k: torch.Tensor,
    page_v: torch.Tensor,
    page_len: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
) -> torch.Tensor:
    """The last N tokens of a request attend to per-head pages plus a contiguous tail.

    q [N, Hq, D] are the queries of the tail's last N tokens; page_k/v [Hkv, K, P, D] with
    ``page_len`` [Hkv, K] valid tokens per page (0 = empty) are visible to every query; tail_k/v
    [Hkv, W, D] are visible causally (query i sees tail tokens 0 .. W-N+i). Returns [N, Hq, D].
    """
    hkv, n_pages, page_size, d = page_k.shape
    n, w = q.shape[0], tail_k.shape[1]
    keys = torch.cat([page_k.reshape(hkv, n_pages * page_size, d), tail_k], dim=1).to(q.dtype)  # [Hkv, L, D]
    values = torch.cat([page_v.reshape(hkv, n_pages * page_size, d), tail_v], dim=1).to(q.dtype)
    at = torch.arange(max(page_size, w), device=q.device)
    page_mask = (at[None, None, :page_size] < page_len.to(q.device)[:, :, None]).reshape(hkv, 1, -1)  # [Hkv, 1, K*P]
    tail_mask = at[None, :w] <= at[w - n : w, None]  # [N, W]
    mask = torch.cat([page_mask.expand(hkv, n, -1), tail_mask.expand(hkv, n, w)], dim=2)  # [Hkv, N, L]
    qh = q.permute(1, 0, 2).reshape(hkv, -1, d)  # [Hkv, G*N, D] (no K/V copy per query head)
    scores = torch.bmm(qh, keys.transpose(1, 2)).view(hkv, -1, n, keys.shape[1]) * d**-0.5  # [Hkv, G, N, L]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.bmm(scores.softmax(-1).view(hkv, -1, keys.shape[1]), values)  # [Hkv, G*N, D]
    return out.reshape(-1, n, d).transpose(0, 1)  # [N, Hq, D]


def sparse_paged_attention(
    q: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    page_k: torch.Tensor,
    page_v: torch.Tensor,
    page_len: torch.Tensor,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    kv_format: KVFormat = KVFormat(),
) -> torch.Tensor:
    """Attention of one token's queries over each KV head's own page selection.

    q [Hq, D]; sink_k/v [Hkv, S, D]; page_k/v [Hkv, K, P, W] stored rows in ``kv_format`` with
    ``page_len`` [Hkv, K] valid tokens per page (0 = an empty slot, masked out); win_k/v [Hkv, W,
    D] values (quantized like the pool's when the pages are). Query head ``h`` reads KV head
    ``h // (Hq / Hkv)``. Returns [Hq, D]. Order of keys does not matter: the decode query may see
    every cached token, so no causal mask is needed.
    """
    from icekv.kernels import kernel_backend, sparse_decode_attention
    from icekv.kernels.cpu_decode import compiled_reads, sparse_decode_cpu

    backend = kernel_backend(q.device)
    if backend == "numba" and compiled_reads(q.dtype, page_k.dtype, kv_format):
        return sparse_decode_cpu(q, sink_k, sink_v, page_k, page_v, page_len, win_k, win_v, kv_format)
    tail_k, tail_v = torch.cat([sink_k, win_k], dim=1), torch.cat([sink_v, win_v], dim=1)  # order is free
    tail_k, tail_v = kv_format.pack(tail_k), kv_format.pack(tail_v)  # [Hkv, S+W, W] stored rows
    if backend != "triton":
        values = lambda t: kv_format.unpack(t, q.dtype)
        return paged_prefix_attention(q[None], values(page_k), values(page_v), page_len, values(tail_k),
                                      values(tail_v))[0]
    pages_k, pages_v, lens = _append_tail_pages(page_k, page_v, page_len, tail_k, tail_v)
    ids = torch.arange(pages_k.shape[1], dtype=torch.int32, device=q.device).expand(1, *lens.shape)
    out, _ = sparse_decode_attention(q[None], pages_k, pages_v, ids.contiguous(), lens[None].int().contiguous(),
                                     kv_format=kv_format)
    return out[0]


def _append_tail_pages(page_k, page_v, page_len, tail_k, tail_v):
    """The contiguous tail (stored rows, as the pages) cut into pages after the slots, so one
    kernel reads everything: [Hkv, K + T', P, W] twice and lens [Hkv, K + T'] (the last tail page
    may be partial)."""
    hkv, _, page_size, d = page_k.shape
    n = tail_k.shape[1]
    pad = (-n) % page_size
    as_pages = lambda t: F.pad(t, (0, 0, 0, pad)).view(hkv, -1, page_size, d).to(page_k.dtype)  # [Hkv, T', P, W]
    full = torch.full(((n + pad) // page_size,), page_size, dtype=page_len.dtype, device=page_len.device)
    if pad:
        full[-1] = page_size - pad
    lens = torch.cat([page_len, full.expand(hkv, -1)], dim=1)  # [Hkv, K + T']
    return torch.cat([page_k, as_pages(tail_k)], 1), torch.cat([page_v, as_pages(tail_v)], 1), lens
