"""Integer page ids handed out from a fixed pool (nano-vllm's block manager, reduced)."""

from __future__ import annotations

from collections import deque

from icekv.errors import CacheFullError


class PageAllocator:
    """A free list over page ids ``0 .. num_pages-1``; check with ``can_allocate`` first.

    ``allocate(n, after=p)`` hands out ``p+1, p+2, ...`` while they are free, so a growing
    request keeps consecutive pages and its cache can be read as one slice without a copy.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._order: deque[int] = deque(range(num_pages))  # free ids, oldest first (may hold stale ids)
        self._free: set[int] = set(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        if not self.can_allocate(n):
            raise CacheFullError(
                f"KV page pool exhausted: {n} pages requested, {len(self._free)} of "
                f"{self.num_pages} free"
            )
        pages = []
        nxt = None if after is None else after + 1
        while len(pages) < n and nxt in self._free:
            pages.append(nxt)
            nxt += 1
        while len(pages) < n:
            page = self._order.popleft()
            if page in self._free and page not in pages:
                pages.append(page)
        self._free.difference_update(pages)
        return pages

    def free(self, page_ids: list[int]) -> None:
        self._order.extend(page_ids)
        self._free.update(page_ids)
        if len(self._order) > 2 * self.num_pages:  # stale ids from runs continued in place: compact
            self._order = deque(dict.fromkeys(p for p in self._order if p in self._free))
