"""Attention over cached keys and values (torch references; kernels dispatch here later)."""

from icekv.attention.dense import causal_attention

__all__ = ["causal_attention"]
