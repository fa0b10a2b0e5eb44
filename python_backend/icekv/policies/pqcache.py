"""PQCache: per layer and KV head, keys product-quantized at prefill; the best estimated tokens."""

from icekv.config import SelectionConfig
from icekv.model import ModelArgs
from icekv.policies.base import Policy
from icekv.select.pqcache import PQCacheSelector


def pqcache_index_bytes(args: ModelArgs, tokens: int, cfg: SelectionConfig, kv_dtype: str) -> int:
    """A one-byte code per part per token, and fp32 codebooks, per budgeted layer and KV head."""
    pq = cfg.pqcache
    layers = len(POLICY.sparse_layers(cfg, args.num_layers))
    return layers * args.num_kv_heads * (tokens * pq.sub_vectors + pq.centroids * args.head_dim * 4)


POLICY = Policy("pqcache", selector=lambda cfg: PQCacheSelector(cfg.page_size, cfg.pqcache),
                index_bytes=pqcache_index_bytes)
