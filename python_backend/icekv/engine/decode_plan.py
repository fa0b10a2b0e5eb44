"""One engine step's attention: planned once per step, then run layer by layer.

Rows ``bounds[i]:bounds[i+1]`` of the flat token batch belong to request ``i``. The plan holds the
step's one page table (CSR, :class:`icekv.kv.PageTable`) of the requests decoding over their own
pages, and where each one's new token goes. In each layer (:meth:`DecodePlan.attend`):

1. the decode tokens of the requests attending the layer in full over their own pages (full
   attention, a sparse policy's unlimited layers) are written and attended in one batched paged
   decode, when the pool is on the compute device (in a local layer, each over its window);
2. the requests that select pages in the layer select together: their queries move to where
   they are searched in one copy (one host sync per layer), and the searches run one after
   another or on ``search_threads`` threads (the compiled searches release the GIL);
3. every other request's rows (prefill chunks, selected-page decodes) go to its own backend.

A request whose backend fails is failed alone: its rows get zeros for the rest of the step and
the others go on. On a CPU and on CUDA the plan is the same; they differ inside the kernels and
copies only.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numba
import torch

from icekv.attention import first_visible_key
from icekv.engine.sequence import Phase, Sequence
from icekv.kernels import paged_decode_attention
from icekv.kv import PagedKVCache
from icekv.methods.selector import Selection


class SearchThreads:
    """Worker threads for the page searches of a layer's selecting requests (none: the caller's
    thread). Each worker's compiled loops run single-threaded: the requests are the parallelism."""

    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="icekv-search",
                                        initializer=numba.set_num_threads, initargs=(1,)) if threads > 1 else None

    def map(self, fn, items: list) -> list:
        if self._pool is None or len(items) < 2:
            return [fn(x) for x in items]
        return list(self._pool.map(_in_inference_mode(fn), items))


def _in_inference_mode(fn):
    """``fn`` under torch's inference mode (a per-thread state: the workers start without it)."""
    def run(x):
        with torch.inference_mode():
            return fn(x)
    return run


class DecodePlan:
    """The step's attention over ``seqs`` (their token counts ``sizes``, in batch order)."""

    def __init__(self, seqs: list[Sequence], sizes: list[int], cache: PagedKVCache, searches: SearchThreads):
        self.seqs, self.cache, self.searches = seqs, cache, searches
        self.bounds = [0]
        for n in sizes:
            self.bounds.append(self.bounds[-1] + n)
        self.failed: dict[int, BaseException] = {}  # index in seqs -> its error
        self.decoding = [i for i, seq in enumerate(seqs)
                         if seq.phase is Phase.DECODE and seq.backend.source.context is None]
        self.table = cache.page_table([seqs[i].seq_id for i in self.decoding]) if self.decoding else None
        if self.table is not None:
            self.new_pages, self.new_slots = self.table.last_tokens()  # [B] each: where the new tokens go
            self.rows = torch.tensor([self.bounds[i] for i in self.decoding])  # [B] their rows in the batch
        self._first_visible: dict[int, torch.Tensor] = {}  # window -> [B] each one's first visible position

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k, v [N, Hkv, D] of the whole batch -> [N, Hq, D]."""
        out = torch.empty_like(q)  # [N, Hq, D]
        pooled = self._pooled_decode(layer, q, k, v, out)
        selections = self._select(layer, q, pooled)
        for i, seq in enumerate(self.seqs):
            a, b = self.bounds[i], self.bounds[i + 1]
            if i in pooled:
                continue
            if i not in self.failed:
                try:
                    out[a:b] = seq.backend.attend(layer, q[a:b], k[a:b], v[a:b], selections.get(i))  # [n_i, Hq, D]
                    continue
                except Exception as e:  # this request fails; the step goes on for the others
                    self.failed[i] = e
            out[a:b] = 0
        return out

    def _pooled_decode(self, layer, q, k, v, out) -> set[int]:
        """One paged decode for the requests attending ``layer`` in full (in a local layer, each its
        window); the requests it served."""
        group = tuple(j for j, i in enumerate(self.decoding)
                      if i not in self.failed and self.seqs[i].backend.attends_all(layer))
        if not group or not self.cache.pool_on_compute:  # a host pool: each request moves its pages
            return set()
        index = torch.tensor(group)  # [G]
        rows = self.rows[index]  # [G]
        window = self.cache.window(layer)
        first_visible = None if window is None else self._window_starts(window)[index]  # [G]
        t0 = time.perf_counter()
        self.cache.write_rows(layer, self.new_pages[index], self.new_slots[index], k[rows], v[rows])
        out[rows] = paged_decode_attention(q[rows], self.cache.pool[layer], self.table.subset(group),
                                           kv_format=self.cache.kv_format, first_visible=first_visible)  # [G, Hq, D]
        members = [self.decoding[j] for j in group]
        share = (time.perf_counter() - t0) / len(members)
        for i in members:
            self.seqs[i].backend.timings["attention_s"] += share
        return set(members)

    def _window_starts(self, window: int) -> torch.Tensor:
        """[B] where each decoding request's query (its last token) starts seeing under ``window``:
        the same for every layer of that window, so made once per step."""
        if window not in self._first_visible:
            self._first_visible[window] = torch.tensor(
                [first_visible_key(int(n) - 1, window) for n in self.table.lengths])
        return self._first_visible[window]

    def _select(self, layer: int, q: torch.Tensor, pooled: set[int]) -> dict[int, Selection]:
        """The pages of every decoding request selecting in ``layer`` (over its own pages or a
        compressed context), searched together."""
        members = [i for i, seq in enumerate(self.seqs) if seq.phase is Phase.DECODE
                   and i not in pooled and i not in self.failed and seq.backend.selects(layer)]
        if not members:
            return {}
        queries = q[[self.bounds[i + 1] - 1 for i in members]]  # [S, Hq, D] each one's decode query
        wanted = [self.seqs[i].backend.query_device for i in members]
        host = torch.device("cpu")
        on_host = queries.cpu() if host in wanted else None  # one copy for the selectors searching on the host
        picked = self.searches.map(
            lambda j: self._select_one(layer, members[j], on_host[j] if wanted[j] == host else queries[j]),
            list(range(len(members))))
        return {i: s for i, s in zip(members, picked) if s is not None}

    def _select_one(self, layer: int, i: int, q: torch.Tensor) -> Selection | None:
        try:
            return self.seqs[i].backend.select(layer, q)
        except Exception as e:
            self.failed[i] = e
            return None
