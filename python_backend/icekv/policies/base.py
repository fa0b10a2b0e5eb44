"""What a decode-time policy is, and the region rules every sparse policy shares.

A policy is one registered unit (:class:`Policy`): its name, the per-request page selector it
builds (none for full attention), the host memory its index takes, and whether it can select over
a compressed context. The cache regions of a sparse policy are the same for every policy and are
written here once: the first ``n_unlimited_layers`` layers attend their full cache; in the others
each KV head attends its sink, ``k`` selected pages of the indexed region, and its window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from icekv.config import SelectionConfig
from icekv.model import ModelArgs
from icekv.select.base import PageSelector

SelectorFactory = Callable[[SelectionConfig], PageSelector]
LayerRule = Callable[[SelectionConfig, int], Sequence[int]]  # (selection, model depth) -> layer ids
IndexSizer = Callable[[ModelArgs, int, SelectionConfig, str], int]
DeviceIndexSizer = Callable[[ModelArgs, int, SelectionConfig, str, int], int]


def no_index(args: ModelArgs, tokens: int, cfg: SelectionConfig, kv_dtype: str) -> int:
    """Policies that keep no page index beside the KV pool."""
    return 0


def no_device_index(args: ModelArgs, tokens: int, cfg: SelectionConfig, device_type: str, dtype_bytes: int) -> int:
    """Policies whose selection keeps nothing on the compute device."""
    return 0


@dataclass(frozen=True)
class Policy:
    """Everything about one policy. ``selector`` None: full attention (no budget, no index)."""

    name: str
    selector: SelectorFactory | None
    index_bytes: IndexSizer = no_index  # (model, tokens held, selection, KV dtype) -> host bytes of the index
    # (model, tokens held, selection, compute device type, its dtype's bytes) -> device bytes of the index
    device_index_bytes: DeviceIndexSizer = no_device_index
    compressed_context: bool = False  # can it select over a compressed context's per-head pages?
    # the layers attended under the budget (default: all but the first n_unlimited_layers)
    budgeted_layers: LayerRule | None = None
    # the layers whose keys the selector indexes (default: the budgeted ones); a dense one among
    # them also shows the selector its decode query (``observe``), as OmniKV's filter layers do
    indexed_layers: LayerRule | None = None
    # the prompt's last queries per indexed layer the selector needs before it builds (SnapKV's
    # observation window); 0: none
    window_queries: Callable[[SelectionConfig], int] = lambda cfg: 0
    # attention estimated from weighted samples (MagicPIG), not exact over the selected pages
    sampled: bool = False
    # its index grows by insertion, in token order: a later request over a longer prompt may
    # continue a finished request's index (:mod:`icekv.engine.index_cache`)
    extends_index: bool = False

    @property
    def sparse(self) -> bool:
        return self.selector is not None

    def selects(self, cfg: SelectionConfig, tokens_held: int) -> bool:
        """Does a request that holds at most ``tokens_held`` tokens select pages? Not when they all
        fit in the budget: it attends every token (full attention), with no index to build."""
        return self.sparse and tokens_held > cfg.budget

    def make_selector(self, cfg: SelectionConfig) -> PageSelector | None:
        """A fresh selector for one request; None for full attention."""
        return self.selector(cfg) if self.selector is not None else None

    def sparse_layers(self, cfg: SelectionConfig, num_layers: int) -> Sequence[int]:
        """The layers that attend under the budget."""
        if not self.sparse:
            return range(0)
        return (self.budgeted_layers or sparse_layers)(cfg, num_layers)

    def index_layers(self, cfg: SelectionConfig, num_layers: int) -> Sequence[int]:
        """The layers whose keys the selector indexes (built after prefill, or during it)."""
        if not self.sparse:
            return range(0)
        return (self.indexed_layers or self.sparse_layers)(cfg, num_layers)


def sparse_layers(cfg: SelectionConfig, num_layers: int) -> range:
    """All but the first ``n_unlimited_layers``."""
    return range(min(cfg.n_unlimited_layers, num_layers), num_layers)


def layers_outside(dense: frozenset[int], num_layers: int) -> tuple[int, ...]:
    """Every layer of a ``num_layers``-deep model not in ``dense`` (a method's own dense layers)."""
    return tuple(layer for layer in range(num_layers) if layer not in dense)


def sink_tokens(cfg: SelectionConfig) -> int:
    """Sink tokens at the start of a request's own pages."""
    return cfg.n_sink_pages * cfg.page_size


def window_start(cfg: SelectionConfig, sink_end: int, length: int) -> int:
    """First position of the window: the page of the newest token and the pages before it; never
    before ``sink_end``, so the indexed region ``sink_end .. window_start`` is never negative."""
    newest_page = (length - 1) // cfg.page_size
    return max(sink_end, (newest_page - cfg.n_win_pages + 1) * cfg.page_size)
