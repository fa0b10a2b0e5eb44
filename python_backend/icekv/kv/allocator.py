"""Integer page ids handed out from a fixed pool (nano-vllm's block manager, reduced)."""

from __future__ import annotations

from collections import deque

from icekv.errors import CacheFullError


class PageAllocator:
    """A free list over page ids ``0 .. num_pages-1``; check with ``can_allocate`` first."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise CacheFullError(
                f"KV page pool exhausted: {n} pages requested, {len(self._free)} of "
                f"{self.num_pages} free"
            )
        return [self._free.popleft() for _ in range(n)]

    def free(self, page_ids: list[int]) -> None:
        self._free.extend(page_ids)
