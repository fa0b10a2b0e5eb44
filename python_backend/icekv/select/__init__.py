"""Decode-time page selectors: streaming, quest, icecache, icecache_r (``full`` needs none)."""

from __future__ import annotations

from icekv.config import SelectionConfig
from icekv.select.base import PageSelector, Selection
from icekv.select.icecache import IceCacheSelector
from icekv.select.quest import QuestSelector
from icekv.select.streaming import StreamingSelector


def make_selector(cfg: SelectionConfig) -> PageSelector | None:
    """A fresh selector (per request) for ``cfg.policy``; None for full attention."""
    if cfg.policy == "full":
        return None
    if cfg.policy == "streaming":
        return StreamingSelector(cfg.page_size)
    if cfg.policy == "quest":
        return QuestSelector(cfg.page_size)
    return IceCacheSelector(
        cfg.page_size, cfg.icecache, layer_reuse=cfg.policy == "icecache_r",
        first_sparse_layer=cfg.n_unlimited_layers,
    )


__all__ = ["IceCacheSelector", "PageSelector", "QuestSelector", "Selection", "StreamingSelector", "make_selector"]
