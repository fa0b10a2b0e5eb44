"""Size the host page pool and the device budget from context length and model shape."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from icekv.config import SelectionConfig
from icekv.model import ModelArgs

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class SizingPlan:
    kv_bytes_per_token: int  # K and V, all layers
    host_pool_bytes: int  # page pool for `concurrent` requests of `context_tokens`
    device_bytes_full: int  # per request, full attention (everything resident)
    device_bytes_budget: int  # per request under the selection budget (an upper bound)
    device_saving: float  # full / budget

    def to_dict(self) -> dict:
        return asdict(self)


def size(args: ModelArgs, context_tokens: int, concurrent: int, selection: SelectionConfig,
         dtype: str = "float32") -> SizingPlan:
    per_layer_token = 2 * args.num_kv_heads * args.head_dim * DTYPE_BYTES[dtype]
    per_token = per_layer_token * args.num_layers
    pages = -(-context_tokens // selection.page_size) * selection.page_size  # page-granular
    full_layers = min(selection.n_unlimited_layers, args.num_layers)
    sparse_layers = args.num_layers - full_layers
    attended = min(selection.budget, pages)
    budget = (full_layers * pages + sparse_layers * attended) * per_layer_token
    return SizingPlan(per_token, concurrent * pages * per_token, pages * per_token, budget, pages * per_token / budget)
