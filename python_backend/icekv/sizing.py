"""Size the host page pool and the device budget from context length and model shape."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from icekv.config import SelectionConfig
from icekv.model import ModelArgs
from icekv.policies import get_policy

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class SizingPlan:
    kv_bytes_per_token: int  # K and V, all layers
    host_pool_bytes: int  # page pool for `concurrent` requests of `context_tokens`
    device_bytes_full: int  # per request, full attention (everything resident)
    device_bytes_budget: int  # per request under the selection budget (an upper bound)
    device_saving: float  # full / budget
    index_host_bytes: int  # per request: host memory of the page index (estimate, see icekv.policies)

    def to_dict(self) -> dict:
        return asdict(self)


def size(args: ModelArgs, context_tokens: int, concurrent: int, selection: SelectionConfig,
         dtype: str = "float32") -> SizingPlan:
    policy = get_policy(selection.policy)
    per_layer_token = 2 * args.num_kv_heads * args.head_dim * DTYPE_BYTES[dtype]
    per_token = per_layer_token * args.num_layers
    pages = -(-context_tokens // selection.page_size) * selection.page_size  # page-granular
    sparse_layers = len(policy.sparse_layers(selection, args.num_layers))
    full_layers = args.num_layers - sparse_layers
    attended = min(selection.budget, pages)
    budget = (full_layers * pages + sparse_layers * attended) * per_layer_token
    return SizingPlan(per_token, concurrent * pages * per_token, pages * per_token, budget, pages * per_token / budget,
                      index_bytes(args, context_tokens, selection))


def index_bytes(args: ModelArgs, context_tokens: int, selection: SelectionConfig) -> int:
    """Host bytes of one request's page index under its policy (IceCache trees, Quest's bounds)."""
    return get_policy(selection.policy).index_bytes(args, context_tokens, selection)
