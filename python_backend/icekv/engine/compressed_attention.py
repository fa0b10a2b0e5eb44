"""The attention backend for a question (and its answer) over a compressed context.

The context's kept pages sit on the device for the whole request; the question and generated
tokens go into the request's own pages in the pool, at positions that continue after the
original context (RoPE positions match what the uncompressed run would use).
"""

from __future__ import annotations

import torch

from icekv.attention import paged_prefix_attention
from icekv.compress.compressed import CompressedContext
from icekv.config import SelectionConfig
from icekv.compress.evict import CONTEXT_SINKS
from icekv.engine.full_attention import request_kv_stats
from icekv.engine.results import KVStats
from icekv.engine.sparse_attention import SparseCacheAttention
from icekv.kv import PagedKVCache
from icekv.model import ModelArgs
from icekv.select import PageSelector


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

    def kv_stats(self) -> KVStats:
        return request_kv_stats(self.cache, self.seq_id, self.resident_bytes(), self.context)

    def resident_bytes(self) -> int:
        pages = sum(2 * k.numel() * k.element_size() for k, _, _ in self.prefix)
        return pages + self.cache.sequence_bytes(self.seq_id)


class CompressedSparseAttention(SparseCacheAttention):
    """IceCache over a compressed context: each KV head indexes its kept context tokens (after the
    sinks) and the question/answer tokens that leave the window; the context's first tokens are
    the sink. The first ``n_unlimited_layers`` attend the whole compressed context.

    A tree's local token ``l`` is kept context token ``l + CONTEXT_SINKS`` of its head while
    ``l < n_h - CONTEXT_SINKS``, else the request's own token ``l - (n_h - CONTEXT_SINKS)``.
    """

    def __init__(self, cache: PagedKVCache, seq_id: int, args: ModelArgs, cfg: SelectionConfig,
                 selector: PageSelector, context: CompressedContext):
        self.context = context
        self.prefix = [layer.padded() for layer in context.layers]
        self.n_pref = [torch.tensor(layer.kept_per_head) - CONTEXT_SINKS for layer in context.layers]  # [Hkv]
        super().__init__(cache, seq_id, args, cfg, selector)

    def begin_step(self, n_tokens: int) -> torch.Tensor:
        self.positions = super().begin_step(n_tokens) + self.context.length
        return self.positions

    def _sink_tokens(self) -> int:
        return 0  # the sink is in the context, not in the request's own pages

    def _region_keys(self, layer: int) -> list[torch.Tensor]:
        ctx = self.context.layers[layer]
        own, _ = self.cache.gather_range(layer, self.seq_id, 0, self.win_start)  # [Hkv, w, D]
        keys = []
        for h, (a, b) in enumerate(zip(ctx.head_indptr[:-1].tolist(), ctx.head_indptr[1:].tolist())):
            kept = ctx.k[a:b].flatten(0, 1)[: int(ctx.page_len[a:b].sum())]  # [n_h, D] in position order
            keys.append(torch.cat([kept[CONTEXT_SINKS:], own[h]]))
        return keys

    def _gather_pages(self, layer: int, heads: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
        ctx, p = self.context.layers[layer], self.context.page_size
        n_pref = self.n_pref[layer][heads][:, None]  # [n, 1]
        in_ctx = (refs >= 0) & (refs < n_pref)  # [n, P]
        idx = (refs + CONTEXT_SINKS).clamp_min(0)
        page = (ctx.head_indptr[heads][:, None] + idx // p).clamp_max(max(len(ctx.page_len) - 1, 0))
        own = self.cache.gather_tokens(layer, self.seq_id, heads, torch.where(in_ctx | (refs < 0), -1, refs - n_pref))
        in_ctx_kv = torch.stack([ctx.k[page, idx % p], ctx.v[page, idx % p]])  # [2, n, P, D]
        return torch.where(in_ctx[None, ..., None], in_ctx_kv, own)

    def _pool_rows(self, layer: int):
        return None  # tokens come from the context and the request's pool: _gather_pages merges them

    def _sink_window(self, layer: int, length: int):
        ctx = self.context.layers[layer]
        first = ctx.head_indptr[:-1]  # each head's first page holds its sinks
        win_k, win_v = self.cache.gather_range(layer, self.seq_id, min(self.win_start, length), length)
        return ctx.k[first, :CONTEXT_SINKS], ctx.v[first, :CONTEXT_SINKS], win_k, win_v

    def attend(self, layer, q, k, v):
        if layer in self.device:
            return super().attend(layer, q, k, v)
        self.cache.write(layer, self.seq_id, self.start, k, v)
        tail_k, tail_v = self.cache.gather(layer, self.seq_id)  # [Hkv, S, D]
        return paged_prefix_attention(q, *self.prefix[layer], tail_k, tail_v)

    def kv_stats(self) -> KVStats:
        return request_kv_stats(self.cache, self.seq_id, self.resident_bytes(), self.context, **self.transfer_stats())

    def resident_bytes(self) -> int:
        dense = sum(2 * self.prefix[l][0].numel() * self.prefix[l][0].element_size()
                    for l in range(len(self.prefix)) if l not in self.device)
        per_token_layer = self.cache.bytes_per_token // self.cache.num_layers
        length = self.cache.length(self.seq_id)
        own = len(self.prefix) - len(self.device)
        window = max(length - self.win_start, 0) + CONTEXT_SINKS
        slots = sum(d.resident_bytes for d in self.device.values())
        return dense + own * length * per_token_layer + len(self.device) * window * per_token_layer + slots
