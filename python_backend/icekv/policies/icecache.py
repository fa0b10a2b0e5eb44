"""IceCache (a DCI-tree per layer and KV head) and IceCache(r) (one tree per group of layers).

Each can select over a compressed context only without layer reuse: compression keeps different
tokens in each layer, while IceCache(r) shares one token-to-page map across a group of layers.
"""

from __future__ import annotations

import torch

from icekv.config import SelectionConfig
from icekv.index.levels import promotion_step
from icekv.index.score_rows import row_width
from icekv.model import ModelArgs
from icekv.policies.base import Policy, sparse_layers
from icekv.select.icecache import IceCacheSelector

# The index keeps each indexed key once in a page-major store whose pages hold P/2..P tokens
# (about 7/8 full on random and on SmolLM2 keys) and grow with 1/8 headroom; every token also has
# a norm, a projection, a parent, a level and a store location (32 bytes), every page a mean key,
# and the promoted tokens (1 in ``promotion_step``) a second key copy for the parent search.
PAGE_FILL, HEADROOM, TOKEN_ARRAYS = 7 / 8, 9 / 8, 32
SCORE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def tree_index_bytes(args: ModelArgs, tokens: int, cfg: SelectionConfig, kv_dtype: str, trees_per_kv_head: int) -> int:
    """Host bytes of ``trees_per_kv_head`` trees per KV head over ``tokens`` tokens each, over a KV
    cache of ``kv_dtype`` (which sets the page keys' dtype under ``score_dtype="auto"``)."""
    d, p, ice = args.head_dim, cfg.page_size, cfg.icecache
    keys = ice.page_keys(kv_dtype)
    key_bytes = row_width(d, getattr(torch, keys)) * SCORE_BYTES[keys]
    per_slot = key_bytes + 4 + 8  # key, pad, member id
    per_page = key_bytes + 8 + 16  # centroid (in the score dtype), version, length and owner
    promoted_key = d * 4 / promotion_step(ice)
    per_token = HEADROOM * ((per_slot + per_page / p) / PAGE_FILL + TOKEN_ARRAYS + promoted_key)
    return int(trees_per_kv_head * args.num_kv_heads * tokens * per_token)


def device_copy_bytes(args: ModelArgs, tokens: int, cfg: SelectionConfig, device_type: str, dtype_bytes: int,
                      trees_per_kv_head: int) -> int:
    """Compute-device bytes of the index's copies there over ``tokens`` tokens: the page centroids
    (index/device_centroids.py) where the centroids are ranked on that device, and the candidates'
    keys (index/device_rescoring.py: at most a step's union of candidates per KV head) where they
    are rescored there; else 0."""
    ice = cfg.icecache
    if not ice.scores_centroids_on_device(device_type):
        return 0
    pages = HEADROOM * tokens / cfg.page_size / PAGE_FILL
    per_kv_head = pages * (args.head_dim * dtype_bytes + 8)  # centroid row, live, id
    if ice.rescores_on_device():
        union = args.gqa_group * ice.candidates(cfg.selected_pages)
        per_kv_head += min(union, pages) * cfg.page_size * args.head_dim * dtype_bytes
    return int(trees_per_kv_head * args.num_kv_heads * per_kv_head)


def _trees(cfg: SelectionConfig, args: ModelArgs, layer_reuse: bool) -> int:
    """Trees per KV head: one per sparse layer, or per group of them under layer reuse."""
    layers = len(sparse_layers(cfg, args.num_layers))
    return -(-layers // cfg.icecache.layer_group) if layer_reuse else layers


def _sizers(layer_reuse: bool) -> dict:
    return {
        "index_bytes": lambda args, tokens, cfg, kv_dtype: tree_index_bytes(args, tokens, cfg, kv_dtype,
                                                                            _trees(cfg, args, layer_reuse)),
        "device_index_bytes": lambda args, tokens, cfg, device_type, dtype_bytes: device_copy_bytes(
            args, tokens, cfg, device_type, dtype_bytes, _trees(cfg, args, layer_reuse)),
    }


def _selector(layer_reuse: bool):
    return lambda cfg: IceCacheSelector(cfg.page_size, cfg.icecache, layer_reuse=layer_reuse,
                                        first_sparse_layer=cfg.n_unlimited_layers)


ICECACHE = Policy("icecache", selector=_selector(False), compressed_context=True, **_sizers(False))
ICECACHE_R = Policy("icecache_r", selector=_selector(True), **_sizers(True))
