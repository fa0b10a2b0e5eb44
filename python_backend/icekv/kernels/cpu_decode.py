"""Decode attention on a CPU, compiled (numba): the sparse paged decode (the CPU twin of the
OpenAI-Triton decode kernel, with :func:`icekv.attention.sparse.paged_prefix_attention` as its
reference) and the full paged decode of a batch (:func:`paged_decode_cpu`).

One decode query per head reads its KV head's selected page slots and its *tail* (sink and
window tokens) in place, two passes: scores and their max, then the weighted sum of values. The
tail is read straight from the request's pages in the host pool, by position ranges
(:func:`sparse_decode_pool_cpu`, the decode loop's path: no views or copies to build per layer),
or from given tensors (:func:`sparse_decode_cpu`). At decode sizes (a few hundred tokens per head)
torch's dozen calls cost more in dispatch than in arithmetic; this is one call. Queries and the
result are fp32 inside (numba has no bf16: bf16 queries are widened, the result narrowed back);
bf16 pages are read as their 16-bit words and widened as they are read. KV heads run in parallel,
each reading (and decoding) its rows once for all the query heads that share it (GQA), at the
price of leaving cores idle where there are more cores than KV heads (the call is short: a few
hundred rows per head). Pages and pool may hold packed quantized rows (:mod:`icekv.kv.quant`):
each row is then decoded as it is read (int8 codes converted, fp8 codes
moved into fp16 bits, times the row's scale) into one row of scratch, inside the loop (no
dequantized copy of the pages).

:func:`paged_decode_cpu` serves the requests of an engine step that attend a layer in full, in one
call: each reads its whole sequence (in a sliding-window layer, its window) in place, page by
page, through the batch's page table (FlashInfer's CSR form: request ``b`` owns
``page_ids[starts[b] : starts[b] + pages_b]``); its reference is
:func:`icekv.kernels.reference.paged_decode_reference`. (request, KV head) pairs run in parallel,
and each pair's arithmetic does not depend on the other requests in the batch.

:func:`block_rows_decode_cpu` is the vLLM plugin's decode: one request's rows read in place from
vLLM's CPU cache through its block table, each value at the offset vLLM's cache writer put it
(its reference is :func:`icekv.vllm.request_index.attend_reference`).

The kernels share their row reader and softmax steps, and live in this one module: numba's disk
cache of a compiled function is invalidated by its own file's changes only.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba.core import types
from llvmlite import ir
from numba.extending import intrinsic, overload

from icekv.kv.quant import KVFormat, as_words


def compiled_reads(query_dtype: torch.dtype, rows_dtype: torch.dtype, kv_format: KVFormat) -> bool:
    """Whether these kernels take queries of ``query_dtype`` over stored rows of ``rows_dtype``:
    fp32 or bf16 queries over values of their own dtype, or over packed quantized rows."""
    return query_dtype in (torch.float32, torch.bfloat16) and (kv_format.quantized or rows_dtype == query_dtype)


def sparse_decode_cpu(q: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, page_k: torch.Tensor,
                      page_v: torch.Tensor, page_len: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
                      kv_format: KVFormat = KVFormat()) -> torch.Tensor:
    """q [Hq, D]; sink_k/v [Hkv, S, D]; page_k/v [Hkv, K, P, W] stored rows, page_len [Hkv, K];
    win_k/v [Hkv, W, D] (values in q's dtype, CPU; quantized here as the pool would hold them) -> [Hq, D];
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
    when not quantized), CPU -> [Hq, D] in q's dtype."""
    out = np.empty(q.shape, dtype=np.float32)  # [Hq, D]
    _decode(_queries(q), _rows(pool_layer, kv_format), _words(pool_layer, kv_format), page_ids.numpy(),
            ranges, _rows(page_k, kv_format), _words(page_k, kv_format), _rows(page_v, kv_format),
            _words(page_v, kv_format), page_len.numpy(), q.shape[-1] ** -0.5, out)
    return torch.from_numpy(out).to(q.dtype)


def paged_decode_cpu(q: torch.Tensor, pool_layer: torch.Tensor, page_ids: torch.Tensor, starts: torch.Tensor,
                     lengths: torch.Tensor, kv_format: KVFormat = KVFormat(),
                     first_visible: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; pool_layer [2, Hkv, pool pages, P, W] rows in ``kv_format``; page_ids [total
    pages] and starts [B] (request b's pages begin at ``page_ids[starts[b]]``), lengths [B] >= 1
    tokens; first_visible [B] (a sliding window's first position, < lengths; None: 0) -> [B, Hq, D]
    in q's dtype."""
    out = np.empty(q.shape, dtype=np.float32)  # [B, Hq, D]
    seen = first_visible.to(lengths.dtype) if first_visible is not None else torch.zeros_like(lengths)  # [B]
    _paged_decode(_queries(q), _rows(pool_layer, kv_format), _words(pool_layer, kv_format),
                  page_ids.numpy(), starts.numpy(), lengths.numpy(), seen.numpy(), q.shape[-1] ** -0.5, out)
    return torch.from_numpy(out).to(q.dtype)


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, parallel=True)
def _paged_decode(q, pool, pool_w, page_ids, starts, lengths, first_visible, scale, out):
    b, hq, d = q.shape
    hkv, page_size = pool.shape[1], pool.shape[3]
    group = hq // hkv
    for row in numba.prange(b * hkv):  # each (request, KV head) reads its keys and values once
        i, kv = row // hkv, row % hkv
        n, first, seen = lengths[i], starts[i], first_visible[i]
        qs = q[i, kv * group : (kv + 1) * group]  # [G, D]
        scores = np.empty((group, n - seen), dtype=np.float32)  # [G, L]
        scratch = np.empty(d, dtype=np.float32)  # [D] a decoded row
        for pos in range(seen, n):
            page, slot = page_ids[first + pos // page_size], pos % page_size
            _score(qs, stored_row(pool[0, kv, page, slot], pool_w, (0, kv, page, slot), scratch), scale, scores,
                   pos - seen)
        totals = _softmax(scores, n - seen)  # [G]
        acc = np.zeros((group, d), dtype=np.float32)  # [G, D]
        for pos in range(seen, n):
            page, slot = page_ids[first + pos // page_size], pos % page_size
            _accumulate(scores, pos - seen, stored_row(pool[1, kv, page, slot], pool_w, (1, kv, page, slot), scratch),
                        acc)
        _normalized(acc, totals, out[i, kv * group : (kv + 1) * group])


def block_rows_decode_cpu(q: torch.Tensor, tiles: torch.Tensor, block_table: torch.Tensor, key_at: torch.Tensor,
                          value_at: torch.Tensor, ranges: np.ndarray, heads: torch.Tensor, picked: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Decode attention over one request's tokens in vLLM's CPU cache of one layer, read in place.

    q [Hq, D] (fp32 or bf16); tiles [nb, Hkv, 2 * bs * D] (fp32 or bf16): each (block, KV head)
    tile holds its rows' K value ``j`` at ``key_at[row, j]`` and V value at ``value_at[row, j]``
    ([bs, D] flat offsets each); block_table [blocks] the request's. Every KV head attends the
    positions in ``ranges`` [R, 2] (start, end: sink and window) and the positions ``picked[i]``
    [n, P] of the selected pages ``i`` with ``heads[i]`` == its index (-1: an empty slot) -> [Hq, D]
    in q's dtype. Reference: :func:`icekv.vllm.request_index.attend_reference`."""
    held = block_table.shape[0] * key_at.shape[0]  # tokens the request's blocks hold
    last = max(int(ranges[:, 1].max(initial=0)), int(picked.max()) + 1 if picked.numel() else 0)
    if last > held:  # the kernel reads without bounds checks
        raise IndexError(f"position {last - 1} is past the request's {held} tokens of blocks")
    out = np.empty(q.shape, dtype=np.float32)  # [Hq, D]
    _block_rows_decode(_queries(q), _rows(tiles, KVFormat()), block_table.long().numpy(), key_at.numpy(),
                       value_at.numpy(), ranges, heads.long().numpy(), picked.long().numpy(), scale, out)
    return torch.from_numpy(out).to(q.dtype)


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, parallel=True)
def _block_rows_decode(q, tiles, block_table, key_at, value_at, ranges, heads, picked, scale, out):
    hq, d = q.shape
    hkv = tiles.shape[1]
    group = hq // hkv
    n_fixed = 0
    for r in range(ranges.shape[0]):
        n_fixed += max(ranges[r, 1] - ranges[r, 0], 0)
    for kv in numba.prange(hkv):  # each KV head reads (and widens) its rows once for its query heads
        qs = q[kv * group : (kv + 1) * group]  # [G, D]
        attended = np.empty(n_fixed + picked.shape[0] * picked.shape[1], dtype=np.int64)  # [most] its positions
        n = 0
        for r in range(ranges.shape[0]):
            for pos in range(ranges[r, 0], ranges[r, 1]):
                attended[n] = pos
                n += 1
        for i in range(picked.shape[0]):
            if heads[i] == kv:
                for pos in picked[i]:
                    if pos >= 0:
                        attended[n] = pos
                        n += 1
        scores = np.empty((group, max(n, 1)), dtype=np.float32)  # [G, n]
        raw = np.empty(d, dtype=tiles.dtype)  # [D] a row's stored values, gathered from its tile
        scratch = np.empty(d, dtype=np.float32)  # [D] the row widened
        for i in range(n):
            _score(qs, _tile_row(tiles, block_table, kv, attended[i], key_at, raw, scratch), scale, scores, i)
        totals = _softmax(scores, n)  # [G]
        acc = np.zeros((group, d), dtype=np.float32)  # [G, D]
        for i in range(n):
            _accumulate(scores, i, _tile_row(tiles, block_table, kv, attended[i], value_at, raw, scratch), acc)
        _normalized(acc, totals, out[kv * group : (kv + 1) * group])


@numba.njit(inline="always")
def _tile_row(tiles, block_table, kv, pos, offsets_at, raw, scratch):
    """The values [D] of KV head ``kv``'s row at ``pos``, its stored values (fp32, or bf16 as int16
    words) at ``offsets_at[pos % block size]`` in its block's tile."""
    block_size = offsets_at.shape[0]
    tile = tiles[block_table[pos // block_size], kv]
    offsets = offsets_at[pos % block_size]
    for j in range(offsets.shape[0]):
        raw[j] = tile[offsets[j]]
    return stored_row(raw, None, 0, scratch)


def _words(rows: torch.Tensor, kv_format: KVFormat) -> np.ndarray | None:
    """Packed rows as float32 words (each row's scale, read in place); None when not quantized:
    the kernels' signal to read plain values."""
    return as_words(rows).numpy() if kv_format.quantized else None


def _queries(q: torch.Tensor) -> np.ndarray:
    """The queries as the kernels read them: fp32."""
    return q.float().contiguous().numpy()


def _rows(rows: torch.Tensor, kv_format: KVFormat) -> np.ndarray:
    """Stored rows as the kernels read them: the element type names the reader (fp32 values, bf16
    values as int16 words, int8 codes, or fp8 codes as uint8 bytes)."""
    if kv_format.name == "fp8_e4m3":
        return rows.view(torch.uint8).numpy()
    return (rows.view(torch.int16) if rows.dtype == torch.bfloat16 else rows).numpy()


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, parallel=True)
def _decode(q, pool, pool_w, page_ids, ranges, page_k, page_kw, page_v, page_vw, page_len, scale, out):
    hq, d = q.shape
    hkv, n_slots, slot_size, _ = page_k.shape
    group = hq // hkv
    page_size = pool.shape[3]
    n_tail = 0
    for r in range(ranges.shape[0]):
        n_tail += max(ranges[r, 1] - ranges[r, 0], 0)
    for kv in numba.prange(hkv):  # each KV head reads (and decodes) its rows once for its query heads
        qs = q[kv * group : (kv + 1) * group]  # [G, D]
        scores = np.empty((group, n_tail + n_slots * slot_size), dtype=np.float32)  # [G, L] tail, then pages
        scratch = np.empty(d, dtype=np.float32)  # [D] a decoded row
        n = 0
        for r in range(ranges.shape[0]):
            for pos in range(ranges[r, 0], ranges[r, 1]):
                page, slot = page_ids[pos // page_size], pos % page_size
                _score(qs, stored_row(pool[0, kv, page, slot], pool_w, (0, kv, page, slot), scratch), scale, scores, n)
                n += 1
        for j in range(n_slots):
            for t in range(page_len[kv, j]):
                _score(qs, stored_row(page_k[kv, j, t], page_kw, (kv, j, t), scratch), scale, scores, n)
                n += 1
        totals = _softmax(scores, n)  # [G]
        acc = np.zeros((group, d), dtype=np.float32)  # [G, D]
        n = 0
        for r in range(ranges.shape[0]):
            for pos in range(ranges[r, 0], ranges[r, 1]):
                page, slot = page_ids[pos // page_size], pos % page_size
                _accumulate(scores, n, stored_row(pool[1, kv, page, slot], pool_w, (1, kv, page, slot), scratch), acc)
                n += 1
        for j in range(n_slots):
            for t in range(page_len[kv, j]):
                _accumulate(scores, n, stored_row(page_v[kv, j, t], page_vw, (kv, j, t), scratch), acc)
                n += 1
        _normalized(acc, totals, out[kv * group : (kv + 1) * group])


def stored_row(row, words, at, scratch):
    """The values [D] of a stored row: the row itself when plain fp32 (``words`` None), scratch [D]
    filled with its values widened when plain bf16 (int16 words), else scratch filled with its
    codes (int8 values, or fp8 bytes when the row is uint8) times its scale, word D / 4 of
    ``words[at]`` (the row as float32 words). Compiled callers get the variant of their argument
    types (:func:`_stored_row_variant`): one kernel source serves plain and packed pools."""
    if words is None:
        return _bf16_row(row, scratch) if row.dtype == np.int16 else row
    scale = words[at][scratch.shape[0] // 4]
    return _fp8_row(row, scale, scratch) if row.dtype == np.uint8 else _int8_row(row, scale, scratch)


@overload(stored_row, inline="always")
def _stored_row_variant(row, words, at, scratch):
    """stored_row for compiled callers: the plain fp32, bf16, int8 or fp8 reader, by argument types."""
    if isinstance(words, types.NoneType):
        if row.dtype == types.int16:
            return lambda row, words, at, scratch: _bf16_row(row, scratch)
        return lambda row, words, at, scratch: row
    if row.dtype == types.uint8:
        return lambda row, words, at, scratch: _fp8_row(row, words[at][scratch.shape[0] // 4], scratch)
    return lambda row, words, at, scratch: _int8_row(row, words[at][scratch.shape[0] // 4], scratch)


@numba.njit(inline="always")
def _bf16_row(row, scratch):
    """scratch [D] = the bf16 values whose bits are the row's int16 words: each word is the upper
    half of its fp32."""
    for i in range(scratch.shape[0]):
        scratch[i] = _bits_to_float(np.uint32(np.uint16(row[i])) << np.uint32(16))
    return scratch


@numba.njit(inline="always")
def _int8_row(row, scale, scratch):
    """scratch [D] = int8 codes (the row's first D bytes) times scale."""
    for i in range(scratch.shape[0]):
        scratch[i] = np.float32(row[i]) * scale
    return scratch


@numba.njit(inline="always")
def _fp8_row(row, scale, scratch):
    """scratch [D] = fp8 e4m3 codes (the row's first D bytes, uint8) times scale.

    A code's sign, exponent and mantissa moved into an fp16's places (shifted by 8 and 7) make the
    fp16 whose value is the code's times 2^-8: both formats have subnormals, so every code, 0 and
    the subnormals included, converts exactly, and the 2^8 joins the scale. fp16 to fp32 is one
    instruction on x86 (F16C) and ARM, which vectorizes where a table lookup per element does not.
    The NaN codes (0x7F, 0xFF) are never stored (the quantizer clamps to +-448)."""
    scale = scale * np.float32(256.0)
    for i in range(scratch.shape[0]):
        code = np.uint32(row[i])
        scratch[i] = _half_to_float(((code & 0x80) << 8) | ((code & 0x7F) << 7)) * scale
    return scratch


@intrinsic
def _half_to_float(typingctx, bits):
    """The fp16 whose bit pattern is the low 16 bits of ``bits`` (uint32), as float32."""
    def codegen(context, builder, signature, args):
        half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.fpext(half, ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_to_float(typingctx, bits):
    """The float32 whose bit pattern is ``bits`` (uint32)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@numba.njit(inline="always", fastmath={"reassoc", "contract"})
def _score(qs, key, scale, scores, n):
    """scores[:, n] = each query head's q . key, scaled."""
    for g in range(qs.shape[0]):
        scores[g, n] = _dot(qs[g], key) * scale


@numba.njit(inline="always", fastmath={"reassoc", "contract"})
def _softmax(scores, n):
    """Each row of scores[:, :n] exponentiated from its max, in place -> the rows' sums [G]."""
    totals = np.empty(scores.shape[0], dtype=np.float32)
    for g in range(scores.shape[0]):
        top = -np.inf
        for i in range(n):
            top = max(top, scores[g, i])
        total = np.float32(0.0)
        for i in range(n):
            scores[g, i] = np.exp(scores[g, i] - top)
            total += scores[g, i]
        totals[g] = total
    return totals


@numba.njit(inline="always", fastmath={"reassoc", "contract"})
def _accumulate(scores, n, value, acc):
    """acc[g] += scores[g, n] * value for each query head g."""
    for g in range(acc.shape[0]):
        _axpy(scores[g, n], value, acc[g])


@numba.njit(inline="always", fastmath={"reassoc", "contract"})
def _normalized(acc, totals, out):
    """out [G, D] = each query head's weighted sum acc[g] over its softmax total."""
    for g in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            out[g, j] = acc[g, j] / totals[g]


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
