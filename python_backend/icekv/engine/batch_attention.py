"""The model's attention backend for one engine step over a batch of requests.

Rows ``bounds[i]:bounds[i+1]`` of the flat token batch belong to request ``i``. Decode tokens of
requests that attend a layer in full over their own pages (full attention, and a sparse policy's
unlimited layers) go through one batched paged decode per layer (the batch's page table, one
kernel call) when the pool is on the compute device; every other request's rows go to its own
backend. A request whose backend fails is failed alone: its rows get zeros for the rest of the
step and the others go on.
"""

from __future__ import annotations

import time

import torch

from icekv.engine.sequence import Phase, Sequence
from icekv.kernels import paged_decode_attention
from icekv.kv import PagedKVCache


class PagedDecodeBatch:
    """The page table of a step's decoding requests (their pages and lengths after this step's
    token) and where each one's new token goes in the pool; :meth:`rows` picks a subset."""

    def __init__(self, cache: PagedKVCache, seqs: list[Sequence], rows: list[int]):
        ids = [cache.page_ids(s.seq_id) for s in seqs]
        self.page_ids = torch.cat(ids)  # [total pages]
        self.starts = torch.tensor([0] + [len(i) for i in ids[:-1]]).cumsum(0)  # [B]
        self.lengths = torch.tensor([cache.length(s.seq_id) for s in seqs])  # [B]
        new = self.lengths - 1  # [B] position of each request's new token
        self.pages = self.page_ids[self.starts + new // cache.page_size]  # [B]
        self.slots = new % cache.page_size  # [B]
        self.batch_rows = torch.tensor(rows)  # [B] each request's row in the step's flat batch
        self._subsets: dict[tuple[int, ...], tuple] = {}

    def rows(self, members: tuple[int, ...]) -> tuple:
        """(flat rows, pages, slots, starts, lengths) of requests ``members`` (indices into the
        batch), made once per distinct subset: the layers of a step mostly share one."""
        if members not in self._subsets:
            index = torch.tensor(members)  # [G]
            self._subsets[members] = tuple(t[index] for t in (self.batch_rows, self.pages, self.slots,
                                                               self.starts, self.lengths))
        return self._subsets[members]


class BatchAttention:
    def __init__(self, seqs: list[Sequence], sizes: list[int], cache: PagedKVCache):
        self.seqs, self.cache = seqs, cache
        self.bounds = [0]
        for n in sizes:
            self.bounds.append(self.bounds[-1] + n)
        self.failed: dict[int, BaseException] = {}  # index in seqs -> its error
        self.decoding = [i for i, seq in enumerate(seqs)
                         if seq.phase is Phase.DECODE and seq.backend.source.context is None]
        self.table = PagedDecodeBatch(cache, [seqs[i] for i in self.decoding],
                                      [self.bounds[i] for i in self.decoding]) if self.decoding else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k, v [N, Hkv, D] of the whole batch -> [N, Hq, D]."""
        out = torch.empty_like(q)  # [N, Hq, D]
        pooled = self._pooled_decode(layer, q, k, v, out)
        for i, seq in enumerate(self.seqs):
            a, b = self.bounds[i], self.bounds[i + 1]
            if i in pooled:
                continue
            if i not in self.failed:
                try:
                    out[a:b] = seq.backend.attend(layer, q[a:b], k[a:b], v[a:b])  # [n_i, Hq, D]
                    continue
                except Exception as e:  # this request fails; the step goes on for the others
                    self.failed[i] = e
            out[a:b] = 0
        return out

    def _pooled_decode(self, layer, q, k, v, out) -> set[int]:
        """One paged decode for the requests attending ``layer`` in full; the requests it served."""
        group = tuple(j for j, i in enumerate(self.decoding)
                      if i not in self.failed and self.seqs[i].backend.attends_all(layer))
        if not group or not self.cache.pool_on_compute:  # a host pool: each request moves its pages
            return set()
        rows, pages, slots, starts, lengths = self.table.rows(group)  # [G] each
        t0 = time.perf_counter()
        self.cache.write_rows(layer, pages, slots, k[rows], v[rows])
        out[rows] = paged_decode_attention(q[rows], self.cache.pool[layer], self.table.page_ids, starts,
                                           lengths, kv_format=self.cache.kv_format)  # [G, Hq, D]
        members = [self.decoding[j] for j in group]
        share = (time.perf_counter() - t0) / len(members)
        for i in members:
            self.seqs[i].backend.timings["attention_s"] += share
        return set(members)
