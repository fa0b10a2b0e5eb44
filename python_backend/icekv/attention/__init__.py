"""Attention over cached keys and values (torch references; sparse decode dispatches to kernels)."""

from icekv.attention.dense import (causal_attention, decode_attention, decode_attention_chunks, is_decode_step,
                                  first_visible_key)
from icekv.attention.sparse import paged_prefix_attention, sparse_paged_attention

__all__ = ["causal_attention", "decode_attention", "decode_attention_chunks", "is_decode_step",
           "paged_prefix_attention", "sparse_paged_attention", "first_visible_key"]
