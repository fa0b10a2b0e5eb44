"""Sparse paged decode attention on a CPU, compiled (numba): the CPU twin of the OpenAI-Triton
decode kernel, with :func:`icekv.attention.sparse.paged_prefix_attention` as its reference.

One decode query per head reads its KV head's sink, selected page slots and window in place (no
concatenated copies), two passes: scores and their max, then the weighted sum of values. At
decode sizes (a few hundred tokens per head) torch's dozen calls cost ~0.3 ms in dispatch; this
is one call. fp32 only (numba has no bf16); query heads run in parallel.
"""

from __future__ import annotations

import numba
import numpy as np
import torch


def sparse_decode_cpu(q: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, page_k: torch.Tensor,
                      page_v: torch.Tensor, page_len: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor) -> torch.Tensor:
    """q [Hq, D]; sink_k/v [Hkv, S, D]; page_k/v [Hkv, K, P, D], page_len [Hkv, K]; win_k/v
    [Hkv, W, D] (all fp32, CPU) -> [Hq, D]; query head ``h`` reads KV head ``h // (Hq / Hkv)``."""
    out = torch.empty_like(q)  # [Hq, D]
    # contiguous: one compiled layout (sink and window may be strided views of the pool, a few rows)
    args = (t.contiguous().numpy() for t in (q, sink_k, sink_v, page_k, page_v, page_len, win_k, win_v))
    _decode(*args, q.shape[-1] ** -0.5, out.numpy())
    return out


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, parallel=True)
def _decode(q, sink_k, sink_v, page_k, page_v, page_len, win_k, win_v, scale, out):
    hq, d = q.shape
    hkv, n_slots, page_size, _ = page_k.shape
    n_sink, n_win = sink_k.shape[1], win_k.shape[1]
    most = n_sink + n_slots * page_size + n_win
    for h in numba.prange(hq):
        kv = h // (hq // hkv)
        scores = np.empty(most, dtype=np.float32)  # [L] attended tokens: sink, pages, window
        n = 0
        for t in range(n_sink):
            scores[n] = _dot(q[h], sink_k[kv, t]) * scale
            n += 1
        for j in range(n_slots):
            for t in range(page_len[kv, j]):
                scores[n] = _dot(q[h], page_k[kv, j, t]) * scale
                n += 1
        for t in range(n_win):
            scores[n] = _dot(q[h], win_k[kv, t]) * scale
            n += 1
        top = -np.inf
        for i in range(n):
            top = max(top, scores[i])
        total = np.float32(0.0)
        for i in range(n):
            scores[i] = np.exp(scores[i] - top)
            total += scores[i]
        acc = np.zeros(d, dtype=np.float32)  # [D]
        n = 0
        for t in range(n_sink):
            _axpy(scores[n], sink_v[kv, t], acc)
            n += 1
        for j in range(n_slots):
            for t in range(page_len[kv, j]):
                _axpy(scores[n], page_v[kv, j, t], acc)
                n += 1
        for t in range(n_win):
            _axpy(scores[n], win_v[kv, t], acc)
            n += 1
        for i in range(d):
            out[h, i] = acc[i] / total


@numba.njit(inline="always", fastmath={"reassoc", "contract"})
def _dot(a, b):
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@numba.njit(inline="always", fastmath={"reassoc", "contract"})
def _axpy(w, x, acc):
    for i in range(acc.shape[0]):
        acc[i] += w * x[i]
