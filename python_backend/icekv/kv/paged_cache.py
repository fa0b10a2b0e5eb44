"""A preallocated paged KV pool shared by the requests of one engine.

Layout ``[num_layers, 2, n_kv_heads, num_pages, page_size, head_dim]``: one page id names the
same token slots in every layer and head (as in vLLM / nano-vllm). Head-major rather than
FlashInfer's page-major ``[num_pages, 2, H, P, D]``: every consumer here works per KV head
(IceCache's pages, selections and device slots are per head), and gathering a request's pages
for one layer is then a single ``index_select`` whose result is already ``[H, tokens, D]``.

With a quantized ``kv_format`` the last dimension holds packed rows (``D`` codes and a scale, see
:mod:`icekv.kv.quant`): writes quantize, the value readers (``gather*``, ``view*``) decode, and
:meth:`PagedKVCache.gather_tokens` and the ``pool`` tensor itself give stored rows, for the copies
and kernels that carry or decode them.
"""

from __future__ import annotations

import torch

from icekv.config.paging import PagingConfig
from icekv.errors import CacheFullError
from icekv.kv.allocator import PageAllocator
from icekv.kv.page_list import PageList
from icekv.kv.page_table import PageTable
from icekv.kv.pinned import pinned_empty
from icekv.kv.prefix_cache import PrefixCache
from icekv.kv.quant import KVFormat
from icekv.kv.token_rows import as_bits, copy_rows, gather_tokens_reference


class PagedKVCache:
    """Owns the pool tensor and the page lists of live requests.

    The pool lives on ``device``; attention runs on ``compute`` (default: the same device). A
    host pool serving a GPU is pinned (one preallocated block), so pages copy to the GPU
    asynchronously; readers move what they attend with :meth:`to_compute` (a no-op when the two
    are one device, as on a CPU).

    With a ``prefix`` cache, a request's full pages join it (its prompt's once prefilled, the rest
    when it ends) and a later request whose prompt starts with their tokens holds them instead of
    prefilling them again; idle ones are evicted, least recently used first, when an allocation
    needs room."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        paging: PagingConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        compute: str | torch.device | None = None,
        prefix: PrefixCache | None = None,
        kv_format: KVFormat = KVFormat(),
        layer_windows: tuple[int | None, ...] = (),
    ):
        if layer_windows and len(layer_windows) != num_layers:
            raise ValueError(f"{len(layer_windows)} layer windows for {num_layers} layers")
        self.paging = paging
        self.layer_windows = layer_windows  # per layer: the tokens each query attends back (None: all; () none)
        self.page_size = paging.page_size
        self.num_layers = num_layers
        self.dtype, self.kv_format = dtype, kv_format  # values read back are ``dtype``; rows stored in kv_format
        self.compute = torch.device(compute or device)
        device = torch.device(device)
        shape = (num_layers, 2, num_kv_heads, paging.num_pages, paging.page_size, kv_format.row_width(head_dim))
        storage = kv_format.storage_dtype(dtype)
        if device.type == "cpu" and self.compute.type == "cuda":  # locked in memory: sized for what the host can lock
            self.pool = pinned_empty(shape, storage, owner=self)  # [L, 2, Hkv, num_pages, P, W]
        else:  # the OS maps pages lazily, so an unused pool costs address space, not RAM
            self.pool = torch.empty(shape, dtype=storage, device=device)  # [L, 2, Hkv, num_pages, P, W]
        self.allocator = PageAllocator(paging.num_pages)
        self.prefix = prefix
        self._seqs: dict[int, PageList] = {}

    def window(self, layer: int) -> int | None:
        """The tokens a query of ``layer`` attends back, its own included; None: every token."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def pool_on_compute(self) -> bool:
        """Does attention read the pool in place (no copy to another device)?"""
        return self.pool.device == self.compute

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (read from the pool) on the compute device."""
        return t.to(self.compute, non_blocking=True)

    def to_pool(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (new K/V from the model, or indices) on the pool's device."""
        return t.to(self.pool.device)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """Values x [..., D] from the model as stored rows [..., W] on the pool's device."""
        return self.to_pool(self.kv_format.pack(x))

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """Values x [..., D] as reading them back from the pool gives them (:meth:`KVFormat.as_stored`)."""
        return self.kv_format.as_stored(x)

    def _values(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows [..., W] as values [..., D] in the model's dtype (the rows themselves, no
        copy, when not quantized)."""
        return self.kv_format.unpack(rows, self.dtype)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers (K and V)."""
        return self.pool[:, :, :, 0].numel() * self.pool.element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_page // self.page_size

    @property
    def value_bytes_per_token(self) -> int:
        """Bytes of one token's K and V in every layer as values in the model's dtype: what a
        device copy of them takes (attention's dense reads, the sink and window), whatever the
        pool's ``kv_format``."""
        _, _, hkv, _, _, width = self.pool.shape
        return self.num_layers * 2 * hkv * self.kv_format.head_dim(width) * self.dtype.itemsize

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    @property
    def pages_available(self) -> int:
        """Pages an allocation may take: the free ones and the cached ones no request holds."""
        return self.allocator.num_free + (self.prefix.evictable if self.prefix is not None else 0)

    def add(self, seq_id: int, prompt: list[int] = (), most_cached: int = 0) -> int:
        """Start a request's cache; with a prefix cache, holding the cached pages of the longest
        prefix of ``prompt`` within ``most_cached`` tokens. Returns the tokens it starts with."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has a cache")
        seq = self._seqs[seq_id] = PageList()
        if self.prefix is not None and most_cached > 0:
            seq.set_pages(self.prefix.match(list(prompt), most_cached))
            seq.shared, seq.length = len(seq.pages), len(seq.pages) * self.page_size
        return seq.length

    def publish(self, seq_id: int, tokens: list[int]) -> None:
        """With a prefix cache, the request's full pages of ``tokens`` (from position 0, written
        and final) join it now, held by the request, for the requests that start while it runs."""
        if self.prefix is not None:
            seq = self._seqs[seq_id]
            seq.shared = self.prefix.publish(tokens[: seq.length], seq.pages, seq.shared)

    def free(self, seq_id: int, cache_tokens: list[int] | None = None, retention_s: float = 0.0) -> None:
        """Hand back the request's pages; with ``cache_tokens`` (the tokens its pages hold, from
        position 0) and a prefix cache, its full pages stay cached instead (retained
        ``retention_s`` seconds ahead of the LRU order)."""
        seq = self._seqs.pop(seq_id)
        own = seq.pages[seq.shared:]
        if self.prefix is not None:  # its own pages first, then the shared head: the LRU drops a chain's tail first
            if cache_tokens is not None:
                own = self.prefix.insert(cache_tokens[: seq.length], seq.pages, seq.shared, retention_s)
            self.prefix.release(seq.pages[: seq.shared], retention_s if cache_tokens is not None else 0.0)
        self.allocator.free(own)

    def has(self, seq_id: int) -> bool:
        """Does the request have a cache (its prefill has started)?"""
        return seq_id in self._seqs

    def allocate_pages(self, n: int) -> list[int]:
        """``n`` pages for the prefix cache's own use (pages read back from its lower tier)."""
        return self._allocate(n, None)

    def _allocate(self, n: int, after: int | None) -> list[int]:
        """``n`` pages, evicting idle cached ones when too few are free."""
        short = n - self.allocator.num_free
        if short > 0 and self.prefix is not None:
            self.allocator.free(self.prefix.evict(short))
        return self.allocator.allocate(n, after=after)

    def pages_held(self, seq_id: int) -> int:
        """Pages the request holds now (0 for one without a cache)."""
        seq = self._seqs.get(seq_id)
        return len(seq.pages) if seq is not None else 0

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def pages_needed(self, seq_id: int, n_new: int) -> int:
        seq = self._seqs[seq_id]
        return -(-(seq.length + n_new) // self.page_size) - len(seq.pages)

    def extend(self, seq_id: int, n_new: int) -> int:
        """Make room for ``n_new`` more tokens; returns the position of the first of them."""
        seq = self._seqs[seq_id]
        need = self.pages_needed(seq_id, n_new)
        if need > self.pages_available:
            raise CacheFullError(
                f"KV cache full: {seq.length + n_new} tokens need {need} more pages of "
                f"{self.page_size}, {self.pages_available} free"
            )
        if need:
            seq.set_pages(seq.pages + self._allocate(need, after=seq.pages[-1] if seq.pages else None))
        start, seq.length = seq.length, seq.length + n_new
        return start

    def write(self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] of positions ``start .. start+T-1``."""
        if k.shape[0] == 1:  # a decode step: plain indexing (every layer, every step)
            page, slot = self._seqs[seq_id].pages[start // self.page_size], start % self.page_size
            self.pool[layer, :, :, page, slot] = self._rows(torch.stack([k[0], v[0]]))  # [2, Hkv, W]
            return
        pos = torch.arange(start, start + k.shape[0])  # [T]
        self.write_rows(layer, self._seqs[seq_id].ids()[pos // self.page_size], pos % self.page_size, k, v)

    def write_rows(self, layer: int, pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at pool page ``pages[t]``, slot ``slots[t]`` ([T] each): one copy
        for tokens of any requests (a batch's decode tokens)."""
        pages, slots = self.to_pool(pages), self.to_pool(slots)
        self.pool[layer, :, :, pages, slots] = self._rows(torch.stack([k, v])).transpose(1, 2)  # indexed view: [2, Hkv, T, W]

    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's keys and values in sequence order: two [Hkv, length, D] tensors."""
        seq = self._seqs[seq_id]
        return self.gather_range(layer, seq_id, 0, seq.length)

    def gather_range(self, layer: int, seq_id: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``start .. end-1``: two [Hkv, end-start, D] tensors."""
        kv = self._values(self.gather_rows(layer, seq_id, start, end))  # [2, Hkv, end-start, D]
        return kv[0], kv[1]

    def gather_rows(self, layer: int, seq_id: int, start: int, end: int) -> torch.Tensor:
        """The stored rows (K, V) of positions ``start .. end-1``: [2, Hkv, end-start, W]."""
        index = self.to_pool(self._seqs[seq_id].ids()[start // self.page_size : -(-end // self.page_size)])
        kv = self.pool[layer].index_select(2, index).flatten(2, 3)  # [2, Hkv, n*P, W]
        offset = start % self.page_size
        return kv[:, :, offset : offset + end - start]

    def view_runs(self, layer: int, seq_id: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Positions ``start .. end-1`` as views of the pool, one (K, V) pair [Hkv, n_i, D] per run
        of consecutive page ids, in sequence order. No copy (a decoded one when quantized): read
        them, never write them, and do not keep them past the request's next write."""
        if end <= start:
            return []
        p, out = self.page_size, []
        for page, n, p0 in self._seqs[seq_id].runs(start // p, -(-end // p) - 1):
            lo, hi = max(start, page * p), min(end, (page + n) * p)  # token range of this run
            kv = self.pool[layer, :, :, p0 : p0 + n].flatten(2, 3)  # [2, Hkv, n*P, W] a view
            kv = self._values(kv[:, :, lo - page * p : hi - page * p])  # [2, Hkv, hi-lo, D]
            out.append((kv[0], kv[1]))
        return out

    def view_range(self, layer: int, seq_id: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Like :meth:`gather_range`, but a view of the pool (no copy) when the range's pages are
        consecutive ids, the usual case; the same read-only rules as :meth:`view_runs`."""
        runs = self.view_runs(layer, seq_id, start, end)
        if len(runs) == 1:
            return runs[0]
        return self.gather_range(layer, seq_id, start, end)

    def page_ids(self, seq_id: int) -> torch.Tensor:
        """The request's pages in sequence order [pages] (position ``t`` is in ``page_ids[t // P]``)."""
        return self._seqs[seq_id].ids()

    def gather_tokens(self, layer: int, seq_id: int, heads: torch.Tensor, positions: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """K/V of arbitrary tokens, one KV head per row: heads [n], positions [n, P] (-1 = none)
        -> one [2, n, P, W] tensor of stored rows (K, V), zero where the position is -1: a staging
        buffer (``out``, when given: a pinned one, say) for slots that store the same rows.

        A compiled row copy for a pool in CPU memory (one call instead of six torch ones: these
        are a few dozen rows per layer and step); :func:`gather_tokens_reference` elsewhere."""
        ids = self._seqs[seq_id].ids()
        if self.pool.device.type != "cpu":
            rows = gather_tokens_reference(self.pool[layer], ids, heads, positions)
            return rows if out is None else out.copy_(rows)
        if out is None:
            out = self.pool.new_empty((2, *positions.shape, self.pool.shape[-1]))  # [2, n, P, W]
        copy_rows(as_bits(self.pool[layer]), ids.numpy(), heads.numpy(), positions.numpy(), as_bits(out))
        return out

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget every token from ``length`` on and free the pages no longer needed."""
        seq = self._seqs[seq_id]
        keep, whole, shared = -(-length // self.page_size), length // self.page_size, seq.shared
        pages = list(seq.pages)
        if whole < shared:  # back into the cached prefix: the pages from ``whole`` on are the cache's
            if keep > whole:  # the last kept page, partly kept, is written next: a copy of its own
                [copy] = self._allocate(1, after=None)
                self.pool[:, :, :, copy] = self.pool[:, :, :, pages[whole]]
                pages[whole] = copy
            self.prefix.release(seq.pages[whole:shared])
            seq.shared = whole
        self.allocator.free(seq.pages[max(keep, shared):])
        seq.set_pages(pages[:keep])
        seq.length = min(seq.length, length)

    def page_table(self, seq_ids: list[int]) -> PageTable:
        seqs = [self._seqs[s] for s in seq_ids]
        return PageTable.build([s.pages for s in seqs], [s.length for s in seqs], self.page_size)

    def sequence_bytes(self, seq_id: int) -> int:
        """Bytes of the pages this request holds (page-granular), all layers."""
        return len(self._seqs[seq_id].pages) * self.bytes_per_page

    def held_bytes(self, seq_ids) -> int:
        """Bytes of the pages these requests hold together: a page they share counted once."""
        return len({page for s in seq_ids for page in self._seqs[s].pages}) * self.bytes_per_page
