"""MagicPIG: LSH sampling over mean-centred keys, attention estimated with importance weights.

Dense: its own layers (:meth:`icekv.method_settings.MagicPIGConfig.dense_layers`, layers 0 and 16
of 32 scaled to the depth); every other layer is budgeted: sink and window exactly, at most the
budget's selected tokens sampled per query head.
"""

from icekv.config import SelectionConfig
from icekv.model import ModelArgs
from icekv.policies.base import Policy, layers_outside
from icekv.select.magicpig import MagicPIGSelector


def budgeted(cfg: SelectionConfig, num_layers: int) -> tuple[int, ...]:
    return layers_outside(cfg.magicpig.dense_layers(num_layers), num_layers)


def magicpig_index_bytes(args: ModelArgs, tokens: int, cfg: SelectionConfig, kv_dtype: str) -> int:
    """A 2-byte bucket per table and an fp32 centred-key norm per token, per budgeted layer and KV head."""
    layers = len(budgeted(cfg, args.num_layers))
    return layers * args.num_kv_heads * (tokens * (2 * cfg.magicpig.tables + 4) + args.head_dim * 4)


POLICY = Policy("magicpig", selector=lambda cfg: MagicPIGSelector(cfg.page_size, cfg.magicpig), budgeted_layers=budgeted,
                index_bytes=magicpig_index_bytes, sampled=True)
