"""IceCache's DCI-tree page index (vectorised torch)."""

from icekv.index.dci_tree import DCITree, promotion_levels

__all__ = ["DCITree", "promotion_levels"]
