"""StreamingLLM at a fixed budget: sink pages plus the most recent pages, nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from icekv.methods.base import Policy
from icekv.methods.selector import Selection, SequencePages, SequenceSelection


@dataclass
class StreamingSelector(SequenceSelection):
    """Attends the sink and the newest ``k`` pages before the window (a longer window)."""

    page_size: int = 16
    pages: SequencePages = field(init=False)
    num_kv_heads: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.pages = SequencePages(self.page_size)

    def build(self, layer, keys, base):
        self.num_kv_heads = keys.shape[0]
        self.pages.add_region(layer, keys.shape[1], base)

    def insert(self, layer, keys):
        self.pages.grow(layer, keys.shape[1])

    def select(self, layer, q, k):
        n = self.pages.num_pages[layer]
        recent = torch.arange(max(n - k, 0), n).flip(0)  # newest first
        return Selection.ranked([recent] * self.num_kv_heads)  # contiguous pages never change once full

    def index_bytes(self) -> int:
        return 0  # pages are positions: nothing stored


POLICY = Policy("streaming", selector=lambda plan: StreamingSelector(plan.page_size))
