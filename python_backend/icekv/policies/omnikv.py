"""OmniKV: filter layers attend in full and choose the tokens the budgeted layers after them attend.

Dense: the layers before the first filter, each filter and its wait layers
(:meth:`icekv.method_settings.OmniKVConfig.dense_layers`); every other layer is budgeted.
"""

from icekv.config import SelectionConfig
from icekv.model import ModelArgs
from icekv.policies.base import Policy, layers_outside
from icekv.select.omnikv import OmniKVSelector


def budgeted(cfg: SelectionConfig, num_layers: int) -> tuple[int, ...]:
    return layers_outside(cfg.omnikv.dense_layers(num_layers), num_layers)


def filters(cfg: SelectionConfig, num_layers: int) -> tuple[int, ...]:
    return cfg.omnikv.filters(num_layers)


def device_index_bytes(args: ModelArgs, tokens: int, cfg: SelectionConfig, device_type: str, dtype_bytes: int) -> int:
    """The filter layers' keys, kept where their query scores them."""
    return len(filters(cfg, args.num_layers)) * args.num_kv_heads * tokens * args.head_dim * dtype_bytes


POLICY = Policy("omnikv", selector=lambda cfg: OmniKVSelector(cfg.page_size), budgeted_layers=budgeted,
                indexed_layers=filters, device_index_bytes=device_index_bytes)
