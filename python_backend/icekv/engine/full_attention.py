"""The attention backend for full attention over one request's paged cache."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from icekv.attention import causal_attention, decode_attention_chunks, is_decode_step
from icekv.compress import CompressedContext
from icekv.engine.results import KVStats
from icekv.kv import PagedKVCache


def request_kv_stats(cache: PagedKVCache, seq_id: int, resident_bytes: int, context: CompressedContext | None = None,
                     **transfer) -> KVStats:
    """One request's :class:`KVStats`: its own pages, plus the full size of a compressed context it
    continues (what the uncompressed cache would hold), and the backend's transfer counters."""
    own = cache.sequence_bytes(seq_id)
    total = own + (context.full_bytes if context is not None else 0)
    return KVStats(resident_bytes, total, own // cache.bytes_per_page, **transfer)


class FullCacheAttention:
    """Writes each layer's new K/V into the request's pages and attends over all of them.

    Call :meth:`begin_step` before each forward pass; it reserves the pages for the step.
    """

    def __init__(self, cache: PagedKVCache, seq_id: int):
        self.cache, self.seq_id = cache, seq_id
        self.start = 0
        self.positions = torch.zeros(0, dtype=torch.long)
        self.timings: dict[str, float] = defaultdict(float)  # attention_s: gather + attend, all layers

    def begin_step(self, n_tokens: int) -> torch.Tensor:
        """Reserve room for ``n_tokens`` new tokens; returns their positions [n_tokens]."""
        self.start = self.cache.extend(self.seq_id, n_tokens)
        self.positions = torch.arange(self.start, self.start + n_tokens)
        return self.positions

    def end_step(self) -> None:
        """Called after every layer has run the step; full attention has nothing to do."""

    def kv_stats(self) -> KVStats:
        """Everything is resident under full attention."""
        return request_kv_stats(self.cache, self.seq_id, self.cache.sequence_bytes(self.seq_id))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.seq_id, self.start, k, v)
        t0 = time.perf_counter()
        length = self.cache.length(self.seq_id)
        if is_decode_step(self.positions, length):  # read the pages in place, run by run
            out = decode_attention_chunks(q[0], self.cache.view_runs(layer, self.seq_id, 0, length))[None]
        else:
            keys, values = self.cache.view_range(layer, self.seq_id, 0, length)  # [Hkv, L, D]
            out = causal_attention(q, keys, values, self.positions)
        self.timings["attention_s"] += time.perf_counter() - t0
        return out
