"""A preallocated paged KV pool shared by the requests of one engine.

Layout ``[num_layers, num_pages, 2, n_kv_heads, page_size, head_dim]``: one page id names the
same token slots in every layer (as in vLLM / nano-vllm), and within a layer FlashInfer's
``[num_pages, 2, H, P, D]`` ("HND") layout, so a page's keys for one head are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from icekv.config import PagingConfig
from icekv.errors import CacheFullError
from icekv.kv.allocator import PageAllocator
from icekv.kv.page_table import PageTable


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


class PagedKVCache:
    """Owns the pool tensor and the page lists of live requests."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        paging: PagingConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        self.paging = paging
        self.page_size = paging.page_size
        self.num_layers = num_layers
        # torch.empty: the OS maps pages lazily, so an unused pool costs address space, not RAM
        self.pool = torch.empty(
            (num_layers, paging.num_pages, 2, num_kv_heads, paging.page_size, head_dim),
            dtype=dtype,
            device=device,
        )  # [L, num_pages, 2, Hkv, P, D]
        self.allocator = PageAllocator(paging.num_pages)
        self._seqs: dict[int, _Sequence] = {}

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers (K and V)."""
        return self.pool[:, 0].numel() * self.pool.element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_page // self.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    def add(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has a cache")
        self._seqs[seq_id] = _Sequence()

    def free(self, seq_id: int) -> None:
        self.allocator.free(self._seqs.pop(seq_id).pages)

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def pages_needed(self, seq_id: int, n_new: int) -> int:
        seq = self._seqs[seq_id]
        return -(-(seq.length + n_new) // self.page_size) - len(seq.pages)

    def extend(self, seq_id: int, n_new: int) -> int:
        """Make room for ``n_new`` more tokens; returns the position of the first of them."""
        seq = self._seqs[seq_id]
        need = self.pages_needed(seq_id, n_new)
        if not self.allocator.can_allocate(need):
            raise CacheFullError(
                f"KV cache full: {seq.length + n_new} tokens need {need} more pages of "
                f"{self.page_size}, {self.allocator.num_free} free"
            )
        seq.pages += self.allocator.allocate(need)
        start, seq.length = seq.length, seq.length + n_new
        return start

    def write(self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] of positions ``start .. start+T-1``."""
        pos = torch.arange(start, start + k.shape[0])  # [T]
        pages = torch.tensor(self._seqs[seq_id].pages)[pos // self.page_size]  # [T]
        slots = pos % self.page_size  # [T]
        self.pool[layer, pages, 0, :, slots] = k  # pool[...] indexed -> [T, Hkv, D]
        self.pool[layer, pages, 1, :, slots] = v

    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's keys and values in sequence order: two [Hkv, length, D] tensors."""
        seq = self._seqs[seq_id]
        kv = self.pool[layer, seq.pages]  # [n_pages, 2, Hkv, P, D]
        kv = kv.permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, : seq.length]  # [2, Hkv, length, D]
        return kv[0], kv[1]

    def gather_range(self, layer: int, seq_id: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``start .. end-1``: two [Hkv, end-start, D] tensors."""
        pages = self._seqs[seq_id].pages[start // self.page_size : -(-end // self.page_size)]
        kv = self.pool[layer, pages].permute(1, 2, 0, 3, 4).flatten(2, 3)  # [2, Hkv, n*P, D]
        offset = start % self.page_size
        kv = kv[:, :, offset : offset + end - start]
        return kv[0], kv[1]

    def gather_tokens(
        self, layer: int, seq_id: int, heads: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of arbitrary tokens, one KV head per row: heads [n], positions [n, P] (-1 = none)
        -> two [n, P, D] tensors, zero where the position is -1."""
        valid = positions >= 0  # [n, P]
        pos = positions.clamp_min(0)
        pages = torch.tensor(self._seqs[seq_id].pages)[pos // self.page_size]  # [n, P]
        kv = self.pool[layer, pages, :, heads[:, None], pos % self.page_size]  # [n, P, 2, D]
        kv = kv * valid[:, :, None, None]
        return kv[:, :, 0], kv[:, :, 1]

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget every token from ``length`` on and free the pages no longer needed."""
        seq = self._seqs[seq_id]
        keep = -(-length // self.page_size)
        self.allocator.free(seq.pages[keep:])
        seq.pages, seq.length = seq.pages[:keep], min(seq.length, length)

    def page_table(self, seq_ids: list[int]) -> PageTable:
        seqs = [self._seqs[s] for s in seq_ids]
        return PageTable.build([s.pages for s in seqs], [s.length for s in seqs], self.page_size)

    def sequence_bytes(self, seq_id: int) -> int:
        """Bytes of the pages this request holds (page-granular), all layers."""
        return len(self._seqs[seq_id].pages) * self.bytes_per_page
