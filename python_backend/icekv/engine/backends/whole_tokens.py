"""Where a request's layers attended whole read its own tokens: the pool itself when it is on the
compute device (:class:`PoolTokens`), or a copy kept there (:class:`ComputeMirror`) while the pool
lives elsewhere (host memory, for a GPU under a sparse policy). Chosen once per request, both offer
``write`` / ``attend`` / ``read``, so the backends' control flow is the same on a CPU and a GPU.

Without a mirror, every step of a layer attended whole (a prefill chunk, full attention, a sparse
policy's unlimited layers) would copy all the request's tokens to the device. The mirror keeps
each token's K/V as the model wrote it (on the device already) when it extends what the mirror
holds, and otherwise copies what it lacks from the pool once, on the next read. It is allocated
at the request's most tokens (given) in one piece: growing would hold the old and the new copy
at once. A local (sliding-window) layer's copy drops what is behind its window as it attends: it
holds about its window and the newest steps' tokens. It belongs to one backend and is dropped
with it, so a sparse decode's budgeted layers never hold one.
"""

from __future__ import annotations

import torch

from icekv.attention import causal_attention, decode_attention_chunks, is_decode_step, first_visible_key
from icekv.kv import PagedKVCache
from icekv.sizing import DECODE_STEP_TOKENS, local_tokens_held


class PoolTokens:
    """The request's tokens read in place from a pool on the compute device."""

    def __init__(self, cache: PagedKVCache, seq_id: int):
        self.cache, self.seq_id = cache, seq_id

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Nothing to keep: the pool holds what was written."""

    def attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """q [N, Hq, D] at own ``positions`` over own tokens ``0 .. length-1`` (a local layer: those
        within its window)."""
        window = self.cache.window(layer)
        start = first_visible_key(int(positions[0]), window)
        if is_decode_step(positions, length):  # read the pages in place, run by run
            return decode_attention_chunks(q[0], self.cache.view_runs(layer, self.seq_id, start, length))[None]
        keys, values = self.cache.view_range(layer, self.seq_id, start, length)  # [Hkv, L - start, D]
        return causal_attention(q, keys, values, positions - start, window)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of own tokens ``0 .. length-1``: two [Hkv, length, D]."""
        return self.cache.gather(layer, self.seq_id)


class ComputeMirror:
    """Own tokens ``base .. filled-1`` of each layer, copied to the compute device: from 0 in a
    global layer; a local layer drops the tokens no later query sees (behind its window) as it
    attends, so it holds about its window and the newest steps' tokens, not the request's length."""

    def __init__(self, cache: PagedKVCache, seq_id: int, tokens: int = 0, step_tokens: int = DECODE_STEP_TOKENS):
        self.cache, self.seq_id, self.tokens = cache, seq_id, tokens  # tokens: the most it will hold
        self.step_tokens = step_tokens  # the most tokens one step writes (a prefill: its chunk)
        self.kv: dict[int, torch.Tensor] = {}  # layer -> [2, Hkv, capacity, D] on the compute device
        self.base: dict[int, int] = {}  # layer -> the own position in its first slot
        self.filled: dict[int, int] = {}  # layer -> the own position after the last one held

    def attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        window = self.cache.window(layer)
        start = first_visible_key(int(positions[0]), window)
        if window is not None:
            self._drop_before(layer, start)
        return causal_attention(q, *self.read(layer, length, start), positions - start, window)

    def read(self, layer: int, length: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of own positions ``start .. length-1``: two [Hkv, length - start, D] device
        views. Positions below what was read before are never rewritten within one backend; what a
        local layer dropped is read from the pool again."""
        base, filled = self.base.get(layer, 0), self.filled.get(layer, 0)
        if start < base:
            k, v = self.cache.view_range(layer, self.seq_id, start, length)  # [Hkv, n, D] in the pool
            return self.cache.to_compute(k), self.cache.to_compute(v)
        kv = self._room(layer, length)
        if filled < length:
            k, v = self.cache.view_range(layer, self.seq_id, filled, length)  # [Hkv, n, D] in the pool
            kv[0, :, filled - base : length - base].copy_(k, non_blocking=True)
            kv[1, :, filled - base : length - base].copy_(v, non_blocking=True)
            self.filled[layer] = length
        return kv[0, :, start - base : length - base], kv[1, :, start - base : length - base]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep k, v [n, Hkv, D] of own positions ``start ..`` (just written to the pool) when they
        continue what the mirror holds; otherwise the next read copies them from the pool."""
        if start != self.filled.get(layer, 0):
            return
        window = self.cache.window(layer)
        if window is not None:  # what no query of this step sees goes first, so the step joins about a window
            self._drop_before(layer, first_visible_key(start, window))
        base, end = self.base.get(layer, 0), start + k.shape[0]
        kv = self._room(layer, end)
        kv[0, :, start - base : end - base] = self.cache.as_stored(k).transpose(0, 1)
        kv[1, :, start - base : end - base] = self.cache.as_stored(v).transpose(0, 1)
        self.filled[layer] = end

    def _drop_before(self, layer: int, start: int) -> None:
        """Forget own positions before ``start``, once they span a page or more: the held ones
        move to the front (a copy of about the window, once a page)."""
        base, filled = self.base.get(layer, 0), self.filled.get(layer, 0)
        if start - base < self.cache.page_size:
            return
        kept = max(filled - start, 0)
        if kept and layer in self.kv:
            kv = self.kv[layer]
            kv[:, :, :kept] = kv[:, :, start - base : filled - base].clone()
        self.base[layer], self.filled[layer] = start, max(filled, start)

    def _room(self, layer: int, end: int) -> torch.Tensor:
        """The layer's buffer, holding positions up to ``end`` (grown when it cannot)."""
        base, filled = self.base.get(layer, 0), self.filled.get(layer, 0)
        kv = self.kv.get(layer)
        if kv is None or kv.shape[2] < end - base:
            pool = self.cache.pool  # [L, 2, Hkv, pages, P, W]: the mirror holds values [.., D] in the model's dtype
            window = self.cache.window(layer)
            hint = self.tokens if window is None else local_tokens_held(window, self.tokens, self.step_tokens)
            doubled = 2 * kv.shape[2] if kv is not None and window is None else 0  # a local layer's need is bounded
            capacity = max(end - base, hint, doubled, self.cache.page_size)
            d = self.cache.kv_format.head_dim(pool.shape[-1])
            grown = torch.empty((2, pool.shape[2], capacity, d), dtype=self.cache.dtype,
                                device=self.cache.compute)  # [2, Hkv, capacity, D]
            if kv is not None:
                grown[:, :, : filled - base] = kv[:, :, : filled - base]
            self.kv[layer] = kv = grown
        return kv
