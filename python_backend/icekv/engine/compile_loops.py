"""Compile the engine's numba loops at load time instead of in a request's first decode step.

The CPU paths of the page index (insertion bookkeeping, token placement, page rows, tree walk,
centroids search, MagicPIG's hashing and collision counts), of the transfer (slot plan, row
gather, the fused CPU fill), the sparse decode attention and the few-row linear loop are numba
functions compiled on first call (after an install, or from numba's disk cache afterwards): too
slow for a request's first token either way.
Running each once on tiny inputs of the dtypes a request will pass compiles exactly the
signatures the requests use (tested: a sparse decode after this compiles nothing).
"""

from __future__ import annotations

import numpy as np
import torch

from icekv.config.paging import PagingConfig
from icekv.methods.icecache import IceCacheConfig, SCORE_DTYPES
from icekv.index import DCITree
from icekv.index.device_rescoring import DeviceRescoring
from icekv.index.fused_search import candidate_search, centroid_search
from icekv.index.lsh import collision_counts, simhash
from icekv.kernels.cpu_decode import compiled_reads, paged_decode_cpu, sparse_decode_cpu
from icekv.kv import DevicePageCache, PagedKVCache
from icekv.kv.quant import KVFormat
from icekv.model.linear import compiled_linear


def compile_loops(kv_dtype: torch.dtype, kv_format: KVFormat = KVFormat()) -> None:
    """Run every compiled loop once; ``kv_dtype``: the model's K/V dtype, stored in ``kv_format``
    (rows are copied by width, decoded by format)."""
    g = torch.Generator().manual_seed(0)
    for score_dtype in (d for d in SCORE_DTYPES if d != "auto"):  # every format of the index's page keys
        tree = DCITree(torch.randn(40, 8, generator=g), 4, IceCacheConfig(score_dtype=score_dtype), torch.ones(9) / 3)
        tree.insert(torch.randn(4, 8, generator=g))  # parents, placement, page rows
        q = torch.randn(1, 2, 8, generator=g)
        centroid_search(tree.store, q, 4, 2, by_score=True)
        picks = np.zeros((1, 2, 4), dtype=np.int64)  # candidates scored on a GPU,
        candidate_search(tree.store, q, picks, 2, by_score=True)  # rescored on the host
        DeviceRescoring(tree.store, torch.device("cpu"), kv_dtype, 8).search(q, picks, 2, by_score=True)  # or there
        tree.store.positions(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), 0)  # selected pages' tokens
        tree.page_scores(q[0], 4)  # the walk
    codes = simhash(torch.randn(1, 2, 8, generator=g), torch.randn(8, 6, generator=g), 3)  # MagicPIG's buckets
    collision_counts(codes, codes[:, :1])  # and a query's collisions with them
    cache = PagedKVCache(1, 1, 8, PagingConfig(page_size=4, pool_tokens=8), kv_dtype, kv_format=kv_format)
    cache.add(0)
    cache.extend(0, 4)
    cache.pool.zero_()
    one = torch.zeros(1, dtype=torch.long)
    cache.gather_tokens(0, 0, one, torch.zeros(1, 4, dtype=torch.long))  # row gather
    width, storage = cache.pool.shape[-1], cache.pool.dtype
    DevicePageCache(1, 1, 4, width, storage).plan(one, one, one)  # slot plan
    DevicePageCache(1, 1, 4, width, storage).fill_from_pool(one, one, one, torch.zeros(1, 4, dtype=torch.long),
                                                            cache.pool[0], cache.page_ids(0))  # plan + copy
    # the decode kernels read the model's dtype where they take it (fp32, bf16; else fp32 values)
    dtype = kv_dtype if compiled_reads(kv_dtype, kv_format.storage_dtype(kv_dtype), kv_format) else torch.float32
    pool = torch.zeros_like(cache.pool[0], dtype=kv_format.storage_dtype(dtype))  # [2, Hkv, pages, P, W]
    rows = torch.zeros(1, 1, 8, dtype=dtype)  # [Hkv, 1, D]
    # decode attention (also the pool tail), then the full decode
    sparse_decode_cpu(torch.zeros(2, 8, dtype=dtype), rows, rows, pool[0, :, :1], pool[1, :, :1],
                      torch.ones(1, 1, dtype=torch.long), rows, rows, kv_format)
    one_page = torch.zeros(1, dtype=torch.long)
    paged_decode_cpu(torch.zeros(1, 2, 8, dtype=dtype), pool, one_page, one_page, one_page + 1, kv_format)
    for weight_dtype in (torch.float32, torch.int8):  # a decode step's products: float32 weights, int8 codes
        compiled_linear(torch.zeros(1, 4), torch.zeros(4, 4, dtype=weight_dtype), None)
