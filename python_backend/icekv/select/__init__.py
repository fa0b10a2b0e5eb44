"""Decode-time page selectors: streaming, quest, icecache, icecache_r (``full`` needs none).

Which selector a policy uses is the policy registry's business (:mod:`icekv.policies`)."""

from __future__ import annotations

from icekv.select.base import PageSelector, Selection, query_device
from icekv.select.icecache import IceCacheSelector
from icekv.select.quest import QuestSelector
from icekv.select.streaming import StreamingSelector

__all__ = ["IceCacheSelector", "PageSelector", "QuestSelector", "Selection", "StreamingSelector", "query_device"]
