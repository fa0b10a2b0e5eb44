"""SnapKV at decode time: the prompt's last queries choose, once, the tokens each KV head attends."""

from icekv.config import SelectionConfig
from icekv.model import ModelArgs
from icekv.policies.base import Policy
from icekv.select.snapkv import SnapKVSelector


def snapkv_index_bytes(args: ModelArgs, tokens: int, cfg: SelectionConfig, kv_dtype: str) -> int:
    """An fp32 vote per token, per budgeted layer and KV head."""
    layers = len(POLICY.sparse_layers(cfg, args.num_layers))
    return layers * args.num_kv_heads * tokens * 4


POLICY = Policy("snapkv", selector=lambda cfg: SnapKVSelector(cfg.page_size, cfg.snapkv),
                index_bytes=snapkv_index_bytes, window_queries=lambda cfg: cfg.snapkv.window)
