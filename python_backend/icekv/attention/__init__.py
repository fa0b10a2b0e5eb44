"""Attention over cached keys and values (torch references; kernels dispatch here later)."""

from icekv.attention.dense import causal_attention
from icekv.attention.sparse import sparse_paged_attention

__all__ = ["causal_attention", "sparse_paged_attention"]
