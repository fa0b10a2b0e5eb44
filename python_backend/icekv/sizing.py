"""Size the host page pool and the device budget from context length and model shape."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from icekv.config import SelectionConfig
from icekv.index.dci_tree import promotion_step
from icekv.index.score_rows import row_width
from icekv.model import ModelArgs

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# The IceCache index keeps each indexed key once in a page-major store whose pages hold P/2..P
# tokens (about 7/8 full on random and on SmolLM2 keys) and grow with 1/8 headroom; every token
# also has a norm, a projection, a parent, a level and a store location (32 bytes), every page a
# mean key, and the promoted tokens (1 in ``promotion_step``) a second key copy for the parent search.
PAGE_FILL, HEADROOM, TOKEN_ARRAYS = 7 / 8, 9 / 8, 32


@dataclass(frozen=True)
class SizingPlan:
    kv_bytes_per_token: int  # K and V, all layers
    host_pool_bytes: int  # page pool for `concurrent` requests of `context_tokens`
    device_bytes_full: int  # per request, full attention (everything resident)
    device_bytes_budget: int  # per request under the selection budget (an upper bound)
    device_saving: float  # full / budget
    index_host_bytes: int  # per request: host memory of the page index (estimate, see PAGE_FILL)

    def to_dict(self) -> dict:
        return asdict(self)


def size(args: ModelArgs, context_tokens: int, concurrent: int, selection: SelectionConfig,
         dtype: str = "float32") -> SizingPlan:
    per_layer_token = 2 * args.num_kv_heads * args.head_dim * DTYPE_BYTES[dtype]
    per_token = per_layer_token * args.num_layers
    pages = -(-context_tokens // selection.page_size) * selection.page_size  # page-granular
    sparse_layers = _sparse_layers(args, selection)
    full_layers = args.num_layers - sparse_layers
    attended = min(selection.budget, pages)
    budget = (full_layers * pages + sparse_layers * attended) * per_layer_token
    return SizingPlan(per_token, concurrent * pages * per_token, pages * per_token, budget, pages * per_token / budget,
                      index_bytes(args, context_tokens, selection))


def _sparse_layers(args: ModelArgs, selection: SelectionConfig) -> int:
    """Layers that attend under the budget (the first ``n_unlimited_layers`` keep their cache)."""
    return args.num_layers - min(selection.n_unlimited_layers, args.num_layers)


def index_bytes(args: ModelArgs, context_tokens: int, selection: SelectionConfig) -> int:
    """Host bytes of one request's page index: IceCache trees (icecache_r: one per layer group),
    Quest's per-page key bounds, nothing for streaming and full."""
    sparse_layers = _sparse_layers(args, selection)
    d, p = args.head_dim, selection.page_size
    if selection.policy == "quest":
        return sparse_layers * args.num_kv_heads * (context_tokens // p) * 2 * d * 4
    if not selection.policy.startswith("icecache"):
        return 0
    if selection.policy == "icecache_r":
        sparse_layers = -(-sparse_layers // selection.icecache.layer_group)
    key_bytes = row_width(d, getattr(torch, selection.icecache.score_dtype)) * DTYPE_BYTES[selection.icecache.score_dtype]
    per_slot = key_bytes + 4 + 8  # key, pad, member id
    per_page = key_bytes + 8 + 16  # centroid (in the score dtype), version, length and owner
    promoted_key = d * 4 / promotion_step(selection.icecache)
    per_token = HEADROOM * ((per_slot + per_page / p) / PAGE_FILL + TOKEN_ARRAYS + promoted_key)
    return int(sparse_layers * args.num_kv_heads * context_tokens * per_token)
