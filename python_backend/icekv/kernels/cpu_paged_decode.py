"""Full decode attention of a batch of requests over their pages in the pool, compiled (numba).

One call per layer for every request of an engine step that decodes under full attention: each
query head of each request reads its whole sequence in place, page by page, through the batch's
page table (FlashInfer's CSR form: request ``b`` owns ``page_ids[starts[b] : starts[b] + pages_b]``).
Replaces a dozen torch calls per request and layer, which dominate at decode sizes; its reference
is :func:`icekv.kernels.reference.paged_decode_reference`. fp32 queries over an fp32 pool, or a
pool of packed quantized rows (:mod:`icekv.kv.quant`, decoded inside the loop as in
:mod:`icekv.kernels.cpu_decode`); (request, KV head) pairs run in parallel, each reading its keys and values once for all the query heads that share them (GQA),
and each pair's arithmetic does not depend on the other requests in the batch.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from icekv.kernels.cpu_decode import _accumulate, _code_table, _score, _softmax, _words, stored_row
from icekv.kv.quant import KVFormat


def paged_decode_cpu(q: torch.Tensor, pool_layer: torch.Tensor, page_ids: torch.Tensor, starts: torch.Tensor,
                     lengths: torch.Tensor, kv_format: KVFormat = KVFormat()) -> torch.Tensor:
    """q [B, Hq, D]; pool_layer [2, Hkv, pool pages, P, W] rows in ``kv_format``; page_ids [total
    pages] and starts [B] (request b's pages begin at ``page_ids[starts[b]]``), lengths [B] >= 1
    tokens -> [B, Hq, D]."""
    out = np.empty(q.shape, dtype=np.float32)  # [B, Hq, D]
    _paged_decode(q.contiguous().numpy(), pool_layer.numpy(), _words(pool_layer, kv_format), page_ids.numpy(),
                  starts.numpy(), lengths.numpy(), _code_table(kv_format), q.shape[-1] ** -0.5, out)
    return torch.from_numpy(out)


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, parallel=True)
def _paged_decode(q, pool, pool_w, page_ids, starts, lengths, lut, scale, out):
    b, hq, d = q.shape
    hkv, page_size = pool.shape[1], pool.shape[3]
    group = hq // hkv
    for row in numba.prange(b * hkv):  # each (request, KV head) reads its keys and values once
        i, kv = row // hkv, row % hkv
        n, first = lengths[i], starts[i]
        qs = q[i, kv * group : (kv + 1) * group]  # [G, D]
        scores = np.empty((group, n), dtype=np.float32)  # [G, L]
        scratch = np.empty(d, dtype=np.float32)  # [D] a decoded row
        for pos in range(n):
            page, slot = page_ids[first + pos // page_size], pos % page_size
            _score(qs, stored_row(pool[0, kv, page, slot], pool_w, (0, kv, page, slot), lut, scratch), scale, scores, pos)
        totals = _softmax(scores, n)  # [G]
        acc = np.zeros((group, d), dtype=np.float32)  # [G, D]
        for pos in range(n):
            page, slot = page_ids[first + pos // page_size], pos % page_size
            _accumulate(scores, pos, stored_row(pool[1, kv, page, slot], pool_w, (1, kv, page, slot), lut, scratch), acc)
        for g in range(group):
            for t in range(d):
                out[i, kv * group + g, t] = acc[g, t] / totals[g]
