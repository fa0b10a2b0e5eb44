"""What the engine hands back: a finished generation, its KV statistics, a prefilled prompt."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from icekv.compress import CompressedContext
from icekv.policies import PolicyPlan


@dataclass(frozen=True)
class KVStats:
    """KV cache of one request: bytes on the compute device vs in total (all layers), and traffic.
    Every attention backend reports this one shape (``kv_stats()``)."""

    resident_bytes: int
    total_bytes: int
    pages: int
    bytes_moved: int = 0
    pages_moved: int = 0  # (layer, KV head) pages copied host -> device
    slot_hit_rate: float = 0.0
    index_bytes: int = 0  # host memory of the page index (IceCache trees, Quest bounds)
    index_bytes_moved: int = 0  # host -> device bytes of the selector's index copies (centroids, candidates' keys)


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    new_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prefill_s: float
    decode_s: float
    tpot_s: float
    kv: KVStats
    policy: str = "full"
    budget: int | None = None
    timings: dict = field(default_factory=dict)  # select_s, transfer_s, attention_s, index_build_s
    layer_stats: dict = field(default_factory=dict)  # probe: layer -> {"recall", "cosine"}
    step_recall: list[float] = field(default_factory=list)  # probe: per decode step, recall over the probed layers
    step_max_s: float = 0.0  # the slowest decode step (a window flush inserts into every layer's index)
    first_step_s: float = 0.0  # the first decode step: caches cold after prefill, slots filled from empty
    cached_tokens: int = 0  # prompt tokens the prefix cache held, not prefilled
    logprobs: list[dict] = field(default_factory=list)  # per sampled token (an end-of-sequence one too), when asked
    prompt_logprobs: list[dict] = field(default_factory=list)  # per prompt token (the first's logprob None), when asked

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Prefilled:
    """A prompt whose KV is in the pool; decode it (possibly several times), then release it."""

    seq_id: int
    prompt_ids: list[int]
    logits: torch.Tensor  # [V] for the token after the prompt
    prefill_s: float
    context: CompressedContext | None = None  # a compressed context the prompt continues
    index: object = None  # a PrefillIndex: a sparse policy's index built during prefill, for the first decode
    window_queries: dict | None = None  # layer -> the prompt's last queries [W, Hq, D] (SnapKV's window)
    cached_tokens: int = 0  # prompt tokens the prefix cache held (read, not prefilled)

    def prebuilt_index(self, plan: PolicyPlan):
        """The index prefill built, if it was built for ``plan`` and no decode has taken it."""
        return self.index if self.index is not None and self.index.plan == plan else None
