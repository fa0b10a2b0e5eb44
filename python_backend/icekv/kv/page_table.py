"""The page table of a batch of requests, in FlashInfer's CSR form."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PageTable:
    """Request ``i`` owns pages ``indices[indptr[i]:indptr[i+1]]`` in sequence order; its last
    page holds ``last_page_len[i]`` valid tokens (1..page_size; a request with no tokens has no
    pages and ``last_page_len`` 0).
    """

    indptr: torch.Tensor  # [B + 1] int32
    indices: torch.Tensor  # [total_pages] int32
    last_page_len: torch.Tensor  # [B] int32
    page_size: int

    @classmethod
    def build(cls, pages: list[list[int]], lengths: list[int], page_size: int) -> "PageTable":
        for p, n in zip(pages, lengths):
            if len(p) != -(-n // page_size):
                raise ValueError(f"{n} tokens need {-(-n // page_size)} pages, got {len(p)}")
        counts = torch.tensor([0] + [len(p) for p in pages], dtype=torch.int32)
        indptr = torch.cumsum(counts, 0, dtype=torch.int32)  # [B + 1]
        indices = torch.tensor([i for p in pages for i in p], dtype=torch.int32)
        last = torch.tensor(
            [0 if n == 0 else (n - 1) % page_size + 1 for n in lengths], dtype=torch.int32
        )
        return cls(indptr, indices, last, page_size)

    @property
    def batch_size(self) -> int:
        return self.indptr.numel() - 1

    def pages(self, i: int) -> torch.Tensor:
        """Page ids of request ``i`` in sequence order."""
        return self.indices[self.indptr[i] : self.indptr[i + 1]]

    def seq_len(self, i: int) -> int:
        n_pages = int(self.indptr[i + 1] - self.indptr[i])
        return 0 if n_pages == 0 else (n_pages - 1) * self.page_size + int(self.last_page_len[i])
