"""Full decode attention of a batch of requests over their pages in the pool, compiled (numba).

One call per layer for every request of an engine step that decodes under full attention: each
query head of each request reads its whole sequence in place, page by page, through the batch's
page table (FlashInfer's CSR form: request ``b`` owns ``page_ids[starts[b] : starts[b] + pages_b]``).
Replaces a dozen torch calls per request and layer, which dominate at decode sizes; its reference
is :func:`icekv.kernels.reference.paged_decode_reference`. fp32 only; (request, head) pairs run in
parallel, and each pair's arithmetic does not depend on the other requests in the batch.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from icekv.kernels.cpu_decode import _axpy, _dot


def paged_decode_cpu(q: torch.Tensor, pool_layer: torch.Tensor, page_ids: torch.Tensor, starts: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D]; pool_layer [2, Hkv, pool pages, P, D]; page_ids [total pages] and starts [B]
    (request b's pages begin at ``page_ids[starts[b]]``), lengths [B] >= 1 tokens -> [B, Hq, D]."""
    out = np.empty(q.shape, dtype=np.float32)  # [B, Hq, D]
    _paged_decode(q.contiguous().numpy(), pool_layer.numpy(), page_ids.numpy(), starts.numpy(), lengths.numpy(),
                  q.shape[-1] ** -0.5, out)
    return torch.from_numpy(out)


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, parallel=True)
def _paged_decode(q, pool, page_ids, starts, lengths, scale, out):
    b, hq, d = q.shape
    hkv, page_size = pool.shape[1], pool.shape[3]
    for row in numba.prange(b * hq):
        i, h = row // hq, row % hq
        kv, n, first = h // (hq // hkv), lengths[i], starts[i]
        scores = np.empty(n, dtype=np.float32)  # [L]
        top = -np.inf
        for pos in range(n):
            scores[pos] = _dot(q[i, h], pool[0, kv, page_ids[first + pos // page_size], pos % page_size]) * scale
            top = max(top, scores[pos])
        total = np.float32(0.0)
        for pos in range(n):
            scores[pos] = np.exp(scores[pos] - top)
            total += scores[pos]
        acc = np.zeros(d, dtype=np.float32)  # [D]
        for pos in range(n):
            _axpy(scores[pos], pool[1, kv, page_ids[first + pos // page_size], pos % page_size], acc)
        for t in range(d):
            out[i, h, t] = acc[t] / total
