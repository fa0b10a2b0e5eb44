"""IceCache's DCI-tree page index (vectorised torch)."""

from icekv.index.dci_tree import DCITree, promotion_levels
from icekv.index.page_store import PageStore

__all__ = ["DCITree", "PageStore", "promotion_levels"]
