"""IceCache's DCI-tree page index: torch for the bulk work, compiled numba loops for the per-step
search, walk and insertion."""

from icekv.index.dci_tree import DCITree
from icekv.index.levels import promotion_levels
from icekv.index.page_store import PageStore

__all__ = ["DCITree", "PageStore", "promotion_levels"]
