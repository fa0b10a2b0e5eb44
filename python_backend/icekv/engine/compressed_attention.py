"""The attention backend for a question (and its answer) over a compressed context.

The context's kept pages sit on the device for the whole request; the question and generated
tokens go into the request's own pages in the pool, at positions that continue after the
original context (RoPE positions match what the uncompressed run would use).
"""

from __future__ import annotations

import torch

from icekv.attention import paged_prefix_attention
from icekv.compress.compressed import CompressedContext
from icekv.kv import PagedKVCache


class CompressedPrefixAttention:
    def __init__(self, cache: PagedKVCache, seq_id: int, context: CompressedContext):
        self.cache, self.seq_id, self.context = cache, seq_id, context
        self.prefix = [layer.padded() for layer in context.layers]  # per layer (k, v, page_len)
        self.start = 0
        self.positions = torch.zeros(0, dtype=torch.long)

    def begin_step(self, n_tokens: int) -> torch.Tensor:
        self.start = self.cache.extend(self.seq_id, n_tokens)
        self.positions = self.context.length + torch.arange(self.start, self.start + n_tokens)
        return self.positions

    def end_step(self) -> None:
        """Nothing to flush: the compressed prefix is fixed."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.seq_id, self.start, k, v)
        tail_k, tail_v = self.cache.gather(layer, self.seq_id)  # [Hkv, S, D]
        page_k, page_v, page_len = self.prefix[layer]
        return paged_prefix_attention(q, page_k, page_v, page_len, tail_k, tail_v)

    def resident_bytes(self) -> int:
        pages = sum(2 * k.numel() * k.element_size() for k, _, _ in self.prefix)
        return pages + self.cache.sequence_bytes(self.seq_id)
