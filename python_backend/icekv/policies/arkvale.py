"""ArkVale: contiguous pages ranked by a digest bound (its keys' box shrunk to their mean spread)."""

from icekv.config import SelectionConfig
from icekv.model import ModelArgs
from icekv.policies.base import Policy
from icekv.select.arkvale import ArkValeSelector


def arkvale_index_bytes(args: ModelArgs, tokens: int, cfg: SelectionConfig, kv_dtype: str) -> int:
    """Two fp32 digest bounds per full page, per budgeted layer and KV head."""
    layers = len(POLICY.sparse_layers(cfg, args.num_layers))
    return layers * args.num_kv_heads * (tokens // cfg.page_size) * 2 * args.head_dim * 4


POLICY = Policy("arkvale", selector=lambda cfg: ArkValeSelector(cfg.page_size, cfg.arkvale),
                index_bytes=arkvale_index_bytes)
