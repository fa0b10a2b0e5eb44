"""What a TensorRT build of the decode step is specialised for, and the plugins' shape and launch
logic as plain functions (ints in tests; TensorRT's symbolic dims support the same + and *).

Two engines per model shape, run by the Python backend once per sparse layer and step:
  select: q [B, Hq, D], index_k [Hkv, S_idx, P, D], cand_ids/lens [B, Hkv, C] i32
          -> ids, lens [B, Hkv, top_k] i32, scores [B, Hkv, C] fp32      (icekv::page_select)
  attend: q [B, Hq, D], k/v_slots [Hkv, S, P, D], slot_ids/lens [B, Hkv, K] i32
          -> out [B, Hq, D], lse [B, Hq] fp32                           (icekv::sparse_paged_attention)
Between them the backend turns selected pages into device slots (host pool -> staging -> scatter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from icekv.config.paging import PagingConfig
from icekv.kernels import aot, launch
from icekv.model import ModelArgs
from icekv.policies import PolicyPlan

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PLUGIN_NAMESPACE = "icekv"


@dataclass(frozen=True)
class DecodeStepSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    top_k: int  # pages page_select keeps per KV head
    max_candidates: int  # candidate pages per KV head the select engine accepts
    max_slots: int  # device slots per KV head (selected + sink + window pages)
    dtype: str = "float16"
    max_batch: int = 8
    arch: int = 90

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        launch.check_head_dim(self.head_dim)
        launch.select_launch(1, self.num_kv_heads, self.group, self.max_candidates, self.page_size, self.head_dim)
        for name in ("top_k", "max_candidates", "max_slots", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_plan(cls, plan: PolicyPlan, paging: PagingConfig, args: ModelArgs, **overrides) -> "DecodeStepSpec":
        """Shapes from the model, page budget from the plan, candidates from the pool."""
        values = dict(
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
            page_size=plan.page_size, top_k=plan.selected_pages,
            max_candidates=math.ceil(paging.pool_tokens / plan.page_size),
            max_slots=plan.budget // plan.page_size,
        )
        return cls(**{**values, **overrides})

    def kernel_specs(self) -> dict[str, aot.KernelSpec]:
        """The specialisations the plugins embed (plus the scatter the backend launches itself)."""
        dt = DTYPES[self.dtype]
        return {
            "page_select": aot.select_spec(dt, self.num_kv_heads, self.group, self.head_dim, self.page_size,
                                           self.max_candidates),
            "sparse_paged_attention": aot.decode_spec(dt, self.num_kv_heads, self.group, self.head_dim,
                                                      self.page_size, num_splits=1),
            "page_scatter": aot.scatter_spec(dt, self.page_size, self.head_dim),
        }


def attention_output_shapes(q_shape):
    """icekv::sparse_paged_attention outputs: out [B, Hq, D], lse [B, Hq]."""
    b, hq, d = q_shape
    return (b, hq, d), (b, hq)


def select_output_shapes(q_shape, index_shape, cand_shape, top_k: int):
    """icekv::page_select outputs: ids and lens [B, Hkv, top_k], scores [B, Hkv, C]."""
    b, hkv, c = q_shape[0], index_shape[0], cand_shape[2]
    return (b, hkv, top_k), (b, hkv, top_k), (b, hkv, c)


def plugin_grid(batch, num_kv_heads: int):
    """Both plugin kernels run one program per (sequence, KV head): grid (B * Hkv, 1, 1)."""
    return batch * num_kv_heads, 1, 1
