"""Where a request's tokens come from, for its attention backends.

:class:`RequestPages`: the request's own pages in the pool, positions from 0. :class:`ContextPages`:
a compressed context's kept per-head pages first (fixed, never written), then the request's own
pages in the pool at positions that continue after the original context (RoPE positions match
what the uncompressed run would use). A backend composes a source with how it attends (all tokens,
or sink + selected pages + window), so one sparse backend serves both.
"""

from __future__ import annotations

import numpy as np
import torch

from icekv.attention import paged_prefix_attention, sparse_paged_attention
from icekv.compress import CompressedContext
from icekv.compress.evict import CONTEXT_SINKS
from icekv.engine.backends.whole_tokens import ComputeMirror, PoolTokens
from icekv.engine.results import KVStats
from icekv.kv import PagedKVCache
from icekv.policies import PolicyPlan
from icekv.sizing import DECODE_STEP_TOKENS


class RequestPages:
    """The request's own tokens (at most ``tokens``, written at most ``step_tokens`` a step: size
    hints for device copies). An IceCache tree's local token ``l`` is position ``base + l``."""

    def __init__(self, cache: PagedKVCache, seq_id: int, tokens: int = 0, step_tokens: int = DECODE_STEP_TOKENS):
        self.cache, self.seq_id = cache, seq_id
        self.offset = 0  # RoPE position of the request's first own token
        self.context: CompressedContext | None = None
        self._pool_layers: dict[int, torch.Tensor] = {}
        # the layers attended whole read the pool in place, or a copy of the tokens on the compute device
        self.whole = (PoolTokens(cache, seq_id) if cache.pool_on_compute
                      else ComputeMirror(cache, seq_id, tokens, step_tokens))

    def length(self) -> int:
        """Own tokens in the pool."""
        return self.cache.length(self.seq_id)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write(layer, self.seq_id, start, k, v)
        self.whole.write(layer, start, k, v)

    def attend_all(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D] of the newest N tokens (own positions ``positions``) over every token."""
        return self.whole.attend(layer, q, positions, self.length())

    def own_tokens(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every own token's K and V on the compute device: two [Hkv, length, D]."""
        return self.whole.read(layer, self.length())

    def context_bytes(self, layers) -> int:
        """Bytes of a compressed context's pages in ``layers`` (none here)."""
        return 0

    # ---- what a sparse backend needs
    def sink_end(self, plan: PolicyPlan) -> int:
        """Own tokens before the indexed region (the sink)."""
        return plan.sink_tokens

    def sink_tokens_held(self, sink_end: int) -> int:
        return min(sink_end, self.length())

    def region_keys(self, layer: int, sink_end: int, win_start: int):
        """Keys of the indexed region, per KV head, on the compute device (the index lives on the
        host; its build runs its bulk product where the keys are): [Hkv, n, D]."""
        return self.cache.to_compute(self.cache.gather_range(layer, self.seq_id, sink_end, win_start)[0])

    def gather_pages(self, layer: int, heads: torch.Tensor, refs: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """K/V [2, n, P, D] of selected pages (into ``out`` when given): heads [n], token refs [n,
        P] (-1 = empty)."""
        return self.cache.gather_tokens(layer, self.seq_id, heads, refs, out)

    def pool_rows(self, layer: int):
        """(pool layer [2, Hkv, pages, P, D], page ids [pages]) that selected tokens and the tail are
        read from in place, when the pool and attention are both in CPU memory; None: stage them via
        gather_pages."""
        if not self.cache.pool_on_compute or self.cache.pool.device.type != "cpu":
            return None
        if layer not in self._pool_layers:
            self._pool_layers[layer] = self.cache.pool[layer]  # a view, made once per layer
        return self._pool_layers[layer], self.cache.page_ids(self.seq_id)

    def tail_ranges(self, sink_end: int, win_start: int, length: int) -> np.ndarray:
        """[2, 2] own position ranges (start, end) of the sink and the window."""
        return np.array([[0, min(sink_end, length)], [min(win_start, length), length]])

    def sink_window(self, layer: int, sink_end: int, win_start: int, length: int):
        """(sink K, sink V, window K, window V), each [Hkv, n, D] on the compute device."""
        (s0, s1), (w0, w1) = self.tail_ranges(sink_end, win_start, length).tolist()
        sink_k, sink_v = self.cache.view_range(layer, self.seq_id, s0, s1)
        win_k, win_v = self.cache.view_range(layer, self.seq_id, w0, w1)
        return tuple(self.cache.to_compute(t) for t in (sink_k, sink_v, win_k, win_v))

    def kv_stats(self, resident_bytes: int, **transfer) -> KVStats:
        """Own pages, plus the full size of a compressed context (what the uncompressed cache holds)."""
        own = self.cache.sequence_bytes(self.seq_id)
        total = own + (self.context.full_bytes if self.context is not None else 0)
        return KVStats(resident_bytes, total, own // self.cache.bytes_per_page, **transfer)


class ContextPages(RequestPages):
    """A compressed context's kept pages, then the request's own tokens. Each KV head indexes its
    kept context tokens after the sinks, then its own tokens as they leave the window: a tree's
    local token ``l`` is kept context token ``l + CONTEXT_SINKS`` of its head while
    ``l < n_h - CONTEXT_SINKS``, else the request's own token ``l - (n_h - CONTEXT_SINKS)``."""

    def __init__(self, cache: PagedKVCache, seq_id: int, context: CompressedContext, tokens: int = 0):
        super().__init__(cache, seq_id, tokens)
        self.context, self.offset = context, context.length
        self._prefix: dict[int, tuple] = {}  # layer -> (k, v, page_len) regrouped per head, on the compute device
        self.n_pref = [torch.tensor(layer.kept_per_head) - CONTEXT_SINKS for layer in context.layers]  # [Hkv]

    def prefix(self, layer: int) -> tuple:
        """The layer's kept pages per head on the compute device: k, v [Hkv, K, P, W] stored rows
        (the pool's format), page_len [Hkv, K]. Made at the layer's first whole attention: a
        budgeted layer never needs them there (it selects from the host copy and keeps only the
        sinks on the device)."""
        if layer not in self._prefix:
            self._prefix[layer] = tuple(self.cache.to_compute(t) for t in self.context.layers[layer].padded())
        return self._prefix[layer]

    def _values(self, rows: torch.Tensor) -> torch.Tensor:
        """The context's stored rows [..., W] as values [..., D] (its format is the pool's)."""
        return self.cache.kv_format.unpack(rows, self.cache.dtype)

    def attend_all(self, layer, q, positions):
        k, v, page_len = self.prefix(layer)
        own_k, own_v = self.own_tokens(layer)  # [Hkv, S, D] values
        if q.shape[0] == 1:  # a decode step: the kernels read the rows, dequantized inside the attention
            none = own_k[:, :0]  # [Hkv, 0, D] no sink apart from the pages
            return sparse_paged_attention(q[0], none, none, k, v, page_len, own_k, own_v, self.cache.kv_format)[None]
        return paged_prefix_attention(q, self._values(k), self._values(v), page_len, own_k, own_v)  # values for this call

    def context_bytes(self, layers) -> int:
        """Bytes of the kept pages held on the compute device, of ``layers``."""
        return sum(self._prefix[i][0].nbytes + self._prefix[i][1].nbytes for i in layers if i in self._prefix)

    def sink_end(self, plan):
        return 0  # the sink is the context's first tokens, not the request's own

    def sink_tokens_held(self, sink_end):
        return CONTEXT_SINKS

    def region_keys(self, layer, sink_end, win_start):
        """Per KV head [n_h, D]: kept context tokens after the sinks, then own tokens before the window."""
        ctx = self.context.layers[layer]
        own = self.cache.gather_range(layer, self.seq_id, 0, win_start)[0].cpu()  # [Hkv, w, D]
        keys = []
        for h, (a, b) in enumerate(zip(ctx.head_indptr[:-1].tolist(), ctx.head_indptr[1:].tolist())):
            kept = self._values(ctx.k[a:b].flatten(0, 1)[: int(ctx.page_len[a:b].sum())])  # [n_h, D] in position order
            keys.append(self.cache.to_compute(torch.cat([kept[CONTEXT_SINKS:], own[h]])))
        return keys

    def gather_pages(self, layer, heads, refs, out=None):
        ctx, p = self.context.layers[layer], self.context.page_size
        n_pref = self.n_pref[layer][heads][:, None]  # [n, 1]
        in_ctx = (refs >= 0) & (refs < n_pref)  # [n, P]
        idx = (refs + CONTEXT_SINKS).clamp_min(0)
        page = (ctx.head_indptr[heads][:, None] + idx // p).clamp_max(max(len(ctx.page_len) - 1, 0))
        own = self.cache.gather_tokens(layer, self.seq_id, heads, torch.where(in_ctx | (refs < 0), -1, refs - n_pref))
        in_ctx_kv = torch.stack([ctx.k[page, idx % p], ctx.v[page, idx % p]])  # [2, n, P, W] stored rows
        merged = torch.where(in_ctx[None, ..., None], in_ctx_kv, own.cpu())
        return merged if out is None else out.copy_(merged)

    def pool_rows(self, layer):
        return None  # tokens come from the context and the pool: gather_pages merges them

    def sink_window(self, layer, sink_end, win_start, length):
        ctx = self.context.layers[layer]
        first = ctx.head_indptr[:-1]  # each head's first page holds its sinks
        win_k, win_v = self.cache.gather_range(layer, self.seq_id, min(win_start, length), length)
        sinks = (self._values(ctx.k[first, :CONTEXT_SINKS]), self._values(ctx.v[first, :CONTEXT_SINKS]))
        return tuple(self.cache.to_compute(t) for t in (*sinks, win_k, win_v))


def token_source(cache: PagedKVCache, seq_id: int, context: CompressedContext | None, tokens: int = 0,
                 step_tokens: int = DECODE_STEP_TOKENS) -> RequestPages:
    """The request's tokens (at most ``tokens`` of its own, ``step_tokens`` a step), after ``context``
    if there is one (no model with sliding windows takes one)."""
    if context is None:
        return RequestPages(cache, seq_id, tokens, step_tokens)
    return ContextPages(cache, seq_id, context, tokens)
