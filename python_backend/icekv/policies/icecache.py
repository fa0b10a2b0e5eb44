"""IceCache (a DCI-tree per layer and KV head) and IceCache(r) (one tree per group of layers).

Each can select over a compressed context only without layer reuse: compression keeps different
tokens in each layer, while IceCache(r) shares one token-to-page map across a group of layers.
"""

from __future__ import annotations

from icekv.config import SelectionConfig
from icekv.index.sizing import device_copy_bytes, tree_index_bytes
from icekv.model import ModelArgs
from icekv.policies.base import Policy, sparse_layers
from icekv.select.icecache import IceCacheSelector

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


ICECACHE = Policy("icecache", selector=_selector(False), compressed_context=True, extends_index=True,
                  **_sizers(False))
ICECACHE_R = Policy("icecache_r", selector=_selector(True), extends_index=True, **_sizers(True))
