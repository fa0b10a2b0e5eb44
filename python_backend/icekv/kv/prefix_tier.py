"""The bridge between the prefix cache and a lower tier of pages (the context store): a page is
written there when it becomes cached, and read back into a free pool page when a prompt's chain
reaches a page the pool no longer holds.

The tier (:class:`icekv.store.prefix_pages.PrefixPageStore`) takes ``save(chain, rows, lost)`` and
``load(chain) -> rows | None``; rows are one page of every layer as the pool stores them
([L, 2, Hkv, P, W]). A save may not be written (the tier too busy, unreachable or full): the tier
then calls ``lost(chain)``, possibly from its writer thread, and the page is written again the next
time it is cached.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class PageTier(Protocol):
    def save(self, chain: bytes, rows: torch.Tensor, lost: Callable[[bytes], None]) -> None: ...

    def load(self, chain: bytes) -> torch.Tensor | None: ...


class PrefixTier:
    """``tier`` under the prefix cache of ``cache`` (a :class:`icekv.kv.PagedKVCache`). Pages it
    wrote, is writing or read are not written again (their chain key names their contents)."""

    def __init__(self, cache, tier: PageTier):
        self.cache, self.tier = cache, tier
        self._stored: set[bytes] = set()

    def keep(self, chain: bytes, page: int) -> None:
        """``page`` now holds the prefix ``chain`` names: written below, unless it is there already."""
        if chain not in self._stored:
            self._stored.add(chain)
            rows = self.cache.pool[:, :, :, page].to("cpu", copy=True)  # [L, 2, Hkv, P, W]: copied now
            self.tier.save(chain, rows, lost=self._stored.discard)

    def fetch(self, chain: bytes) -> int | None:
        """A pool page now holding the prefix ``chain`` names, read from below; None when the tier
        lacks it or the pool has no page to spare."""
        if self.cache.pages_available < 1:
            return None
        rows = self.tier.load(chain)  # [L, 2, Hkv, P, W]
        if rows is None:
            self._stored.discard(chain)  # refused or gone: written again when the page is cached again
            return None
        page = self.cache.allocate_pages(1)[0]
        self.cache.pool[:, :, :, page] = rows.to(self.cache.pool.device)
        self._stored.add(chain)
        return page
