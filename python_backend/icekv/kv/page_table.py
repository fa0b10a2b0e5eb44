"""The page table of a batch of requests, in FlashInfer's CSR form: the one page-table format of
the engine (a step's decode plan holds one, the batched kernels read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PageTable:
    """Request ``i`` owns pages ``indices[indptr[i]:indptr[i+1]]`` in sequence order and holds
    ``lengths[i]`` tokens (position ``t`` in page ``t // page_size``). The forms derived from it
    (a subset of its requests, the per-head layout of the sparse kernels) are made once per table."""

    indptr: torch.Tensor  # [B + 1] long
    indices: torch.Tensor  # [total_pages] long
    lengths: torch.Tensor  # [B] long
    page_size: int
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, pages: list[list[int]], lengths: list[int], page_size: int) -> PageTable:
        for p, n in zip(pages, lengths):
            if len(p) != -(-n // page_size):
                raise ValueError(f"{n} tokens need {-(-n // page_size)} pages, got {len(p)}")
        indptr = torch.tensor([0] + [len(p) for p in pages]).cumsum(0)  # [B + 1]
        indices = torch.tensor([i for p in pages for i in p], dtype=torch.long)  # [total]
        return cls(indptr, indices, torch.tensor(lengths, dtype=torch.long), page_size)

    @property
    def batch_size(self) -> int:
        return self.indptr.numel() - 1

    @property
    def starts(self) -> torch.Tensor:
        """[B] where each request's pages begin in ``indices``."""
        return self.indptr[:-1]

    @property
    def last_page_len(self) -> torch.Tensor:
        """[B] tokens in each request's last page (0: no pages)."""
        return torch.where(self.lengths > 0, (self.lengths - 1) % self.page_size + 1, 0)

    def pages(self, i: int) -> torch.Tensor:
        """Page ids of request ``i`` in sequence order."""
        return self.indices[self.indptr[i] : self.indptr[i + 1]]

    def seq_len(self, i: int) -> int:
        return int(self.lengths[i])

    def last_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(page [B], slot [B]) of each request's last token: where a decode step writes."""
        new = self.lengths - 1  # [B]
        return self.indices[self.starts + new // self.page_size], new % self.page_size

    def subset(self, members: tuple[int, ...]) -> PageTable:
        """The table of requests ``members`` (indices into this one), in that order."""
        if members not in self._derived:
            index = torch.tensor(members, dtype=torch.long)  # [G]
            counts = self.indptr[1:][index] - self.indptr[:-1][index]  # [G]
            pages = [self.indices[int(self.indptr[i]) : int(self.indptr[i + 1])] for i in members]
            self._derived[members] = PageTable(torch.cat([counts.new_zeros(1), counts.cumsum(0)]), torch.cat(pages),
                                               self.lengths[index], self.page_size)
        return self._derived[members]

    def per_head(self, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' pages as the sparse kernels name them: ids, lens [B, Hkv, K] int32, the
        same for every KV head, padded with id -1 / 0 tokens to the longest request."""
        key = ("per_head", num_kv_heads)
        if key not in self._derived:
            counts = self.indptr[1:] - self.indptr[:-1]  # [B] pages per request
            k = int(counts.max()) if len(counts) else 0
            at = torch.arange(k)  # [K]
            valid = at[None, :] < counts[:, None]  # [B, K]
            last = max(len(self.indices) - 1, 0)
            ids = torch.where(valid, self.indices[(self.starts[:, None] + at).clamp(max=last)], -1)  # [B, K]
            lens = (self.lengths[:, None] - at * self.page_size).clamp(0, self.page_size)  # [B, K]
            expand = lambda t: t[:, None].expand(-1, num_kv_heads, -1).to(torch.int32).contiguous()  # [B, Hkv, K]
            self._derived[key] = (expand(ids), expand(lens))
        return self._derived[key]
