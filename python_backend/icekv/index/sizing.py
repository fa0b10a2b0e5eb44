"""Host and compute-device bytes of an IceCache index over a number of tokens: what admission and
``icekv size`` charge before the index exists. The page store's own rows are sized by
:class:`PageStore` from its layout; the rest here is the trees' bookkeeping and measured fill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from icekv.index.levels import promotion_step
from icekv.index.page_store import PageStore

if TYPE_CHECKING:
    from icekv.model import ModelArgs
    from icekv.policies import PolicyPlan

# The index keeps each indexed key once in a page-major store whose pages hold P/2..P tokens
# (about 7/8 full on random and on SmolLM2 keys) and grow with 1/8 headroom; every token also has
# a norm, a projection, a parent, a level and a store location (32 bytes), every page a mean key,
# and the promoted tokens (1 in ``promotion_step``) a second key copy for the parent search.
PAGE_FILL, HEADROOM, TOKEN_ARRAYS = 7 / 8, 9 / 8, 32
TREE_PAGE_BYTES = 16  # each page's length and owner in its tree


def tree_index_bytes(plan: PolicyPlan, args: ModelArgs, tokens: int, dtype: str, trees_per_kv_head: int) -> int:
    """Host bytes of ``trees_per_kv_head`` trees per KV head over ``tokens`` tokens each, over a KV
    cache of ``dtype`` (which sets the page keys' dtype under ``score_dtype="auto"``)."""
    d, p, ice = args.head_dim, plan.page_size, plan.selection.icecache
    keys = ice.page_keys(dtype)
    per_slot = PageStore.slot_bytes(d, getattr(torch, keys))
    per_page = PageStore.page_bytes(d, getattr(torch, keys)) + TREE_PAGE_BYTES
    promoted_key = d * 4 / promotion_step(ice)
    per_token = HEADROOM * ((per_slot + per_page / p) / PAGE_FILL + TOKEN_ARRAYS + promoted_key)
    return int(trees_per_kv_head * args.num_kv_heads * tokens * per_token)


def device_copy_bytes(plan: PolicyPlan, args: ModelArgs, tokens: int, device_type: str, dtype_bytes: int,
                      trees_per_kv_head: int) -> int:
    """Compute-device bytes of the index's copies there over ``tokens`` tokens: the page centroids
    (index/device_centroids.py) where the centroids are ranked on that device, and the candidates'
    keys (index/device_rescoring.py: at most a step's union of candidates per KV head) where they
    are rescored there; else 0."""
    ice = plan.selection.icecache
    if not ice.scores_centroids_on_device(device_type):
        return 0
    pages = HEADROOM * tokens / plan.page_size / PAGE_FILL
    per_kv_head = pages * (args.head_dim * dtype_bytes + 8)  # centroid row, live, id
    if ice.rescores_on_device():
        union = args.gqa_group * ice.candidates(plan.selected_pages)
        per_kv_head += min(union, pages) * plan.page_size * args.head_dim * dtype_bytes
    return int(trees_per_kv_head * args.num_kv_heads * per_kv_head)
