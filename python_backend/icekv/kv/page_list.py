"""A request's page list in the paged pool, with the forms its readers ask for every layer."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch


@dataclass
class PageList:
    """One request's pages in the pool, in sequence order, and the tokens they hold."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    shared: int = 0  # leading pages the prefix cache holds for it (its hit, its published prompt): never written
    _ids: torch.Tensor | None = None  # [pages] the page list as a tensor; None = stale
    _run_starts: list[int] | None = None  # index of the first page of each run of consecutive ids; None = stale

    def set_pages(self, pages: list[int]) -> None:
        self.pages, self._ids, self._run_starts = pages, None, None

    def ids(self) -> torch.Tensor:
        if self._ids is None:
            self._ids = torch.tensor(self.pages, dtype=torch.long)
        return self._ids

    def run_starts(self) -> list[int]:
        """Where each run of consecutive page ids begins (its tokens are one slice of the pool);
        plain Python ints: read once per layer and step, where a torch call costs more."""
        if self._run_starts is None:
            p = self.pages
            self._run_starts = [i for i in range(len(p)) if i == 0 or p[i] != p[i - 1] + 1]
        return self._run_starts

    def runs(self, first: int, last: int):
        """Pages ``first .. last`` as runs of consecutive ids: (index of the run's first page in
        the list, its pages, its first page id), in sequence order."""
        starts = self.run_starts()
        at = bisect.bisect_right(starts, first) - 1  # the run holding page ``first``
        page = first
        while page <= last:
            run_end = starts[at + 1] if at + 1 < len(starts) else len(self.pages)
            n = min(run_end, last + 1) - page
            yield page, n, self.pages[page]
            page, at = page + n, at + 1
