"""Page layout, page table, allocator and the paged KV pool."""

from icekv.kv.allocator import PageAllocator
from icekv.kv.device_cache import DevicePageCache, TransferPlan
from icekv.kv.page_table import PageTable
from icekv.kv.paged_cache import PagedKVCache
from icekv.kv.prefix_cache import PrefixCache

__all__ = ["DevicePageCache", "TransferPlan", "PageAllocator", "PageTable", "PagedKVCache", "PrefixCache"]
