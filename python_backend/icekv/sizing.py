"""Size the host page pool and the device budget from context length and model shape, and what
one request holds on the compute device (what admission charges when the pool is elsewhere)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from icekv.kv.quant import KVFormat
from icekv.model import ModelArgs
from icekv.policies import PolicyPlan

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DECODE_STEP_TOKENS = 1  # tokens one decode step writes for a request (a prefill step: up to its chunk)


@dataclass(frozen=True)
class SizingPlan:
    kv_bytes_per_token: int  # K and V, all layers
    host_pool_bytes: int  # page pool for `concurrent` requests of `context_tokens`
    device_bytes_full: int  # per request, full attention (everything resident)
    device_bytes_budget: int  # per request under the selection budget (an upper bound)
    device_saving: float  # full / budget
    index_host_bytes: int  # per request: host memory of the page index (an estimate: PolicyPlan.index_bytes)
    index_share: float  # a request's index over its pages of the pool: above 1, the index outweighs the KV

    def to_dict(self) -> dict:
        return asdict(self)


def size(args: ModelArgs, context_tokens: int, concurrent: int, plan: PolicyPlan,
         dtype: str = "float32", kv_dtype: str = "auto") -> SizingPlan:
    """The pool and device memory of ``concurrent`` requests of ``context_tokens`` tokens, K/V
    stored as ``kv_dtype`` (:class:`icekv.kv.quant.KVFormat`) over a model in ``dtype``."""
    per_layer_token = 2 * args.num_kv_heads * KVFormat(kv_dtype).row_bytes(args.head_dim, DTYPE_BYTES[dtype])
    per_token = per_layer_token * args.num_layers
    pages = -(-context_tokens // plan.page_size) * plan.page_size  # page-granular
    budget = budgeted_tokens(args, pages, plan) * per_layer_token
    index = plan.index_bytes(args, context_tokens, dtype)
    return SizingPlan(per_token, concurrent * pages * per_token, pages * per_token, budget, pages * per_token / budget,
                      index, index / (pages * per_token))


def local_tokens_held(window: int, tokens: int, step_tokens: int = DECODE_STEP_TOKENS) -> int:
    """Tokens a local (sliding-window) layer's device copy holds over ``tokens`` tokens attended in
    steps of at most ``step_tokens`` (a decode: one; a prefill: its chunk): what the step's first
    query sees, the step's tokens and less than a page not dropped yet, so, with pages no longer
    than the window, at most two windows and the step beyond its first token
    (:class:`icekv.engine.backends.whole_tokens.ComputeMirror`)."""
    return min(tokens, 2 * window + step_tokens - 1)


def budgeted_tokens(args: ModelArgs, tokens: int, plan: PolicyPlan, slack: int = 0) -> int:
    """Token-layers of K/V a request of ``tokens`` tokens attends on the compute device in its
    decode: every token in the global layers attended whole, the budget (plus ``slack``) in the
    budgeted ones, about the window in the local ones."""
    sparse, local = len(plan.sparse_layers(args)), len(args.local_layers)
    whole = args.num_layers - sparse - local
    held = local_tokens_held(args.sliding_window, tokens) if local else 0
    return whole * tokens + sparse * min(plan.budget + slack, tokens) + local * held


@dataclass(frozen=True)
class DeviceNeed:
    """Compute-device bytes one request holds beside the model while the KV pool is in host memory."""

    prefill: int  # a global layer keeps a device copy of the whole prompt, a local one about its window
    decode: int  # layers attended whole: every token; budgeted ones: slots, sink, window, a centroid copy

    @property
    def most(self) -> int:
        return max(self.prefill, self.decode)


def device_need(args: ModelArgs, prompt_tokens: int, max_tokens: int, plan: PolicyPlan | None,
                layer_token_bytes: int, context_bytes: int = 0, device_type: str = "cuda", *,
                chunk_tokens: int) -> DeviceNeed:
    """What a request holds on the compute device. ``plan`` None: it only prefills;
    ``layer_token_bytes``: one token's K and V in one layer; ``context_bytes``: a compressed
    context's kept pages (all on the device in prefill; a decode holds only its layers attended
    whole, charged whole all the same); ``chunk_tokens``: the most prompt tokens one step
    prefills. The window may run a page past the budget before its oldest page is flushed."""
    local = len(args.local_layers)
    held = local_tokens_held(args.sliding_window, prompt_tokens, chunk_tokens) if local else 0
    prefill = ((args.num_layers - local) * prompt_tokens + local * held) * layer_token_bytes + context_bytes
    if plan is None:
        return DeviceNeed(prefill, 0)
    tokens = prompt_tokens + max_tokens
    dtype_bytes = layer_token_bytes // (2 * args.num_kv_heads * args.head_dim)
    index = plan.device_index_bytes(args, tokens, device_type, dtype_bytes)
    kv = budgeted_tokens(args, tokens, plan, slack=plan.page_size) * layer_token_bytes
    return DeviceNeed(prefill, kv + index + context_bytes)

