"""Sparse paged decode attention on a CPU, compiled (numba): the CPU twin of the OpenAI-Triton
decode kernel, with :func:`icekv.attention.sparse.paged_prefix_attention` as its reference.

One decode query per head reads its KV head's selected page slots and its *tail* (sink and
window tokens) in place, two passes: scores and their max, then the weighted sum of values. The
tail is read straight from the request's pages in the host pool, by position ranges
(:func:`sparse_decode_pool_cpu`, the decode loop's path: no views or copies to build per layer),
or from given tensors (:func:`sparse_decode_cpu`). At decode sizes (a few hundred tokens per head)
torch's dozen calls cost ~0.3 ms in dispatch; this is one call. fp32 queries (numba has no
bf16); query heads run in parallel. Pages and pool may hold packed quantized rows
(:mod:`icekv.kv.quant`): each row is then decoded as it is read (int8 codes converted, fp8 codes
looked up in a table, times the row's scale) into one row of scratch, inside the loop (no
dequantized copy of the pages).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from icekv.kv.quant import KVFormat, as_words


def sparse_decode_cpu(q: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, page_k: torch.Tensor,
                      page_v: torch.Tensor, page_len: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
                      kv_format: KVFormat = KVFormat()) -> torch.Tensor:
    """q [Hq, D]; sink_k/v [Hkv, S, D]; page_k/v [Hkv, K, P, W] stored rows, page_len [Hkv, K];
    win_k/v [Hkv, W, D] (fp32 values, CPU; quantized here as the pool would hold them) -> [Hq, D];
    query head ``h`` reads KV head ``h // (Hq / Hkv)``."""
    tail = torch.stack([torch.cat([sink_k, win_k], 1), torch.cat([sink_v, win_v], 1)])  # [2, Hkv, S+W, D]
    tail = kv_format.pack(tail)  # [2, Hkv, S+W, W]
    n = tail.shape[2]
    ranges = np.array([[0, n]], dtype=np.int64)  # [1, 2] every tail row, as one page of n tokens
    return sparse_decode_pool_cpu(q, tail[:, :, None], torch.zeros(1, dtype=torch.long), ranges, page_k, page_v,
                                  page_len, kv_format)


def sparse_decode_pool_cpu(q: torch.Tensor, pool_layer: torch.Tensor, page_ids: torch.Tensor, ranges: np.ndarray,
                           page_k: torch.Tensor, page_v: torch.Tensor, page_len: torch.Tensor,
                           kv_format: KVFormat = KVFormat()) -> torch.Tensor:
    """q [Hq, D]; tail tokens: the positions in ``ranges`` [R, 2] (start, end) of a request whose
    page list is ``page_ids`` [pages] in pool_layer [2, Hkv, pool pages, P, W]; page_k/v [Hkv, K,
    P, W] slots with page_len [Hkv, K] valid tokens (0: not attended). Rows in ``kv_format`` (fp32
    when not quantized), CPU -> [Hq, D] fp32."""
    out = np.empty(q.shape, dtype=np.float32)  # [Hq, D]
    _decode(q.contiguous().numpy(), pool_layer.numpy(), _words(pool_layer, kv_format), page_ids.numpy(), ranges,
            page_k.numpy(), _words(page_k, kv_format), page_v.numpy(), _words(page_v, kv_format), page_len.numpy(),
            _code_table(kv_format), q.shape[-1] ** -0.5, out)
    return torch.from_numpy(out)


def _words(rows: torch.Tensor, kv_format: KVFormat) -> np.ndarray | None:
    """Packed rows as float32 words (each row's scale, read in place); None when not quantized:
    the kernels' signal to read plain values."""
    return as_words(rows).numpy() if kv_format.quantized else None


def _code_table(kv_format: KVFormat) -> np.ndarray | None:
    """The fp8 code table; None for int8 codes (converted directly) and plain values."""
    lut = kv_format.lut()
    return None if lut is None else lut.numpy()


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, parallel=True)
def _decode(q, pool, pool_w, page_ids, ranges, page_k, page_kw, page_v, page_vw, page_len, lut, scale, out):
    hq, d = q.shape
    hkv, n_slots, slot_size, _ = page_k.shape
    page_size = pool.shape[3]
    n_tail = 0
    for r in range(ranges.shape[0]):
        n_tail += max(ranges[r, 1] - ranges[r, 0], 0)
    for h in numba.prange(hq):
        kv = h // (hq // hkv)
        scores = np.empty(n_tail + n_slots * slot_size, dtype=np.float32)  # [L] attended tokens: tail, pages
        scratch = np.empty(d, dtype=np.float32)  # [D] a decoded row
        n = 0
        for r in range(ranges.shape[0]):
            for pos in range(ranges[r, 0], ranges[r, 1]):
                page, slot = page_ids[pos // page_size], pos % page_size
                if pool_w is None:  # plain values; the branch not taken is pruned per compiled signature
                    scores[n] = _dot(q[h], pool[0, kv, page, slot]) * scale
                else:
                    scores[n] = _dot(q[h], decode_row(pool[0, kv, page, slot], pool_w[0, kv, page, slot], lut, scratch)) * scale
                n += 1
        for j in range(n_slots):
            for t in range(page_len[kv, j]):
                if pool_w is None:
                    scores[n] = _dot(q[h], page_k[kv, j, t]) * scale
                else:
                    scores[n] = _dot(q[h], decode_row(page_k[kv, j, t], page_kw[kv, j, t], lut, scratch)) * scale
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
        for r in range(ranges.shape[0]):
            for pos in range(ranges[r, 0], ranges[r, 1]):
                page, slot = page_ids[pos // page_size], pos % page_size
                if pool_w is None:
                    _axpy(scores[n], pool[1, kv, page, slot], acc)
                else:
                    _axpy(scores[n], decode_row(pool[1, kv, page, slot], pool_w[1, kv, page, slot], lut, scratch), acc)
                n += 1
        for j in range(n_slots):
            for t in range(page_len[kv, j]):
                if pool_w is None:
                    _axpy(scores[n], page_v[kv, j, t], acc)
                else:
                    _axpy(scores[n], decode_row(page_v[kv, j, t], page_vw[kv, j, t], lut, scratch), acc)
                n += 1
        for i in range(d):
            out[h, i] = acc[i] / total


@numba.njit(inline="always")
def decode_row(row, words, lut, scratch):
    """scratch [D] = the values of a packed row: its codes (int8 values, or fp8 bytes decoded
    through ``lut`` [256]) times its scale (word D / 4 of ``words``, the row as float32 words).
    Returns scratch."""
    scale = words[scratch.shape[0] // 4]
    if lut is None:  # int8: the code is the value
        for i in range(scratch.shape[0]):
            scratch[i] = np.float32(row[i]) * scale
    else:
        for i in range(scratch.shape[0]):
            scratch[i] = lut[row[i] & 0xFF] * scale
    return scratch


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
