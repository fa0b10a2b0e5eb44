"""Quest: contiguous pages ranked by an upper bound of q.k from per-page key min and max."""

from icekv.config import SelectionConfig
from icekv.model import ModelArgs
from icekv.policies.base import Policy, sparse_layers
from icekv.select.quest import QuestSelector


def quest_index_bytes(args: ModelArgs, tokens: int, cfg: SelectionConfig, kv_dtype: str) -> int:
    """An fp32 min and max key per full page, per sparse layer and KV head."""
    layers = len(sparse_layers(cfg, args.num_layers))
    return layers * args.num_kv_heads * (tokens // cfg.page_size) * 2 * args.head_dim * 4


POLICY = Policy("quest", selector=lambda cfg: QuestSelector(cfg.page_size), index_bytes=quest_index_bytes,
                extends_index=True)
