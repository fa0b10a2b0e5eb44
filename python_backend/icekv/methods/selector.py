"""What every decode-time page selector provides, and the sequence-ordered page layout.

A selector owns the page index of one request. It sees the *indexed region* of each layer: the
tokens between the sink and the window, in sequence order, starting at position ``base``. It
decides which tokens form a page (contiguous runs, or semantic clusters for IceCache) and which
``k`` pages each KV head attends at each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class Selection:
    """One layer's pages for this step: page ``pages[i]`` of KV head ``heads[i]``, at
    ``versions[i]`` ([n] long each, grouped by head, each head's best first). A version changes
    whenever its page's contents change, so a device slot holding an older one is reloaded."""

    heads: torch.Tensor  # [n]
    pages: torch.Tensor  # [n]
    versions: torch.Tensor  # [n]

    @classmethod
    def ranked(cls, per_head: list[torch.Tensor], versions: np.ndarray | None = None) -> Selection:
        """Per KV head page ids [k_h] -> a selection; ``versions`` [Hkv, pages] (None: pages never
        change)."""
        heads = np.repeat(np.arange(len(per_head)), [len(s) for s in per_head])  # [n]
        pages = np.concatenate([s.numpy() for s in per_head]).astype(np.int64) if per_head else np.zeros(0, np.int64)
        found = np.zeros(len(pages), dtype=np.int64) if versions is None else versions[heads, pages]  # [n]
        return cls(*(torch.from_numpy(x) for x in (heads, pages, found)))

    def per_head(self, num_heads: int) -> list[torch.Tensor]:
        """The page ids of each KV head [k_h], best first."""
        return [self.pages[self.heads == h] for h in range(num_heads)]


class PageSelector(Protocol):
    def build(self, layer: int, keys: torch.Tensor, base: int) -> None:
        """Index the region's keys [Hkv, n, D] (post-RoPE; on the compute device, where a build
        may run its bulk products; the index it keeps is the selector's choice), first at
        position ``base``."""

    def insert(self, layer: int, keys: torch.Tensor) -> None:
        """Append the next full pages of keys [Hkv, m * P, D], m >= 1 (flushed out of the window).
        One call of m pages leaves the index that m calls of one page would."""

    def select(self, layer: int, q: torch.Tensor, k: int) -> Selection:
        """q [Hq, D] (on :func:`query_device`, or moved there by the selector) -> per KV head, up
        to ``k`` pages (best first)."""

    def page_positions(self, layer: int, heads: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Page ``pages[i]`` of KV head ``heads[i]`` ([m] each) -> positions [m, P] of its tokens
        (-1 = empty slot)."""

    def index_bytes(self) -> int:
        """Host memory the selector's index holds, all layers (the KV pool itself not included)."""

    def device_bytes(self) -> int:
        """Compute-device memory the selector holds (a copy of index summaries scored there)."""

    def bytes_to_device(self) -> int:
        """Bytes the selector has copied to the compute device for those copies, all layers."""


def query_device(selector: PageSelector, compute: torch.device) -> torch.device:
    """Where ``selector.select`` scores its query: the compute device for a selector that scores
    there (its ``scores_on_device(device_type)`` says so), else the host, where the indexes live."""
    on_device = getattr(selector, "scores_on_device", None)
    return compute if on_device is not None and on_device(compute.type) else torch.device("cpu")


class SequenceSelection:
    """What the selectors of contiguous pages share: positions from their :class:`SequencePages`
    (``self.pages``), and nothing of theirs on or copied to the compute device (they score on the
    host)."""

    pages: SequencePages

    def page_positions(self, layer, heads, pages):
        return self.pages.positions(layer, pages)

    def device_bytes(self) -> int:
        return 0

    def bytes_to_device(self) -> int:
        return 0


class SequencePages:
    """Pages as contiguous, always-full runs of ``page_size`` tokens of the indexed region."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.base: dict[int, int] = {}
        self.num_pages: dict[int, int] = {}

    def add_region(self, layer: int, n_tokens: int, base: int) -> None:
        self.base[layer], self.num_pages[layer] = base, n_tokens // self.page_size

    def grow(self, layer: int, n_tokens: int) -> None:
        """``n_tokens`` more (whole pages) at the region's end."""
        self.num_pages[layer] += n_tokens // self.page_size

    def paged(self, keys: torch.Tensor) -> torch.Tensor:
        """keys [Hkv, n, D] of the region -> its whole pages [Hkv, n // P, P, D] (a partial last one
        left out: it is not a page yet)."""
        hkv, n, d = keys.shape
        return keys[:, : n - n % self.page_size].reshape(hkv, n // self.page_size, self.page_size, d)

    def positions(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        return self.base[layer] + pages[:, None] * self.page_size + torch.arange(self.page_size)[None, :]

