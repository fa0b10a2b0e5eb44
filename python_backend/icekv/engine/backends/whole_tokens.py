"""Where a request's layers attended whole read its own tokens: the pool itself when it is on the
compute device (:class:`PoolTokens`), or a copy kept there (:class:`ComputeMirror`) while the pool
lives elsewhere (host memory, for a GPU under a sparse policy). Chosen once per request, both offer
``write`` / ``attend`` / ``read``, so the backends' control flow is the same on a CPU and a GPU.

Without a mirror, every step of a layer attended whole (a prefill chunk, full attention, a sparse
policy's unlimited layers) would copy all the request's tokens to the device. The mirror keeps
each token's K/V as the model wrote it (on the device already) when it extends what the mirror
holds, and otherwise copies what it lacks from the pool once, on the next read. It is allocated
at the request's most tokens (given) in one piece: growing would hold the old and the new copy
at once. It belongs to one backend and is dropped with it, so a sparse decode's budgeted layers
never hold one.
"""

from __future__ import annotations

import torch

from icekv.attention import causal_attention, decode_attention_chunks, is_decode_step, window_start
from icekv.kv import PagedKVCache


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
        start = window_start(int(positions[0]), window)
        if is_decode_step(positions, length):  # read the pages in place, run by run
            return decode_attention_chunks(q[0], self.cache.view_runs(layer, self.seq_id, start, length))[None]
        keys, values = self.cache.view_range(layer, self.seq_id, start, length)  # [Hkv, L - start, D]
        return causal_attention(q, keys, values, positions - start, window)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of own tokens ``0 .. length-1``: two [Hkv, length, D]."""
        return self.cache.gather(layer, self.seq_id)


class ComputeMirror:
    def __init__(self, cache: PagedKVCache, seq_id: int, tokens: int = 0):
        self.cache, self.seq_id, self.tokens = cache, seq_id, tokens  # tokens: the most it will hold
        self.kv: dict[int, torch.Tensor] = {}  # layer -> [2, Hkv, capacity, D] on the compute device
        self.filled: dict[int, int] = {}  # layer -> tokens copied

    def attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        window = self.cache.window(layer)
        start = window_start(int(positions[0]), window)
        keys, values = self.read(layer, length)  # [Hkv, length, D]
        return causal_attention(q, keys[:, start:], values[:, start:], positions - start, window)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of own positions ``0 .. length-1``: two [Hkv, length, D] device views.
        Positions below what was read before are never rewritten within one backend."""
        filled = self.filled.get(layer, 0)
        kv = self._room(layer, length, filled)
        if filled < length:
            k, v = self.cache.view_range(layer, self.seq_id, filled, length)  # [Hkv, n, D] in the pool
            kv[0, :, filled:length].copy_(k, non_blocking=True)
            kv[1, :, filled:length].copy_(v, non_blocking=True)
            self.filled[layer] = length
        return kv[0, :, :length], kv[1, :, :length]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep k, v [n, Hkv, D] of own positions ``start ..`` (just written to the pool) when they
        continue what the mirror holds; otherwise the next read copies them from the pool."""
        filled = self.filled.get(layer, 0)
        if start != filled:
            return
        kv = self._room(layer, start + k.shape[0], filled)
        kv[0, :, start : start + k.shape[0]] = self.cache.as_stored(k).transpose(0, 1)
        kv[1, :, start : start + k.shape[0]] = self.cache.as_stored(v).transpose(0, 1)
        self.filled[layer] = start + k.shape[0]

    def _room(self, layer: int, length: int, filled: int) -> torch.Tensor:
        kv = self.kv.get(layer)
        if kv is None or kv.shape[2] < length:
            pool = self.cache.pool  # [L, 2, Hkv, pages, P, W]: the mirror holds values [.., D] in the model's dtype
            capacity = max(length, self.tokens, 2 * (kv.shape[2] if kv is not None else 0), self.cache.page_size)
            d = self.cache.kv_format.head_dim(pool.shape[-1])
            grown = torch.empty((2, pool.shape[2], capacity, d), dtype=self.cache.dtype,
                                device=self.cache.compute)  # [2, Hkv, capacity, D]
            if kv is not None:
                grown[:, :, :filled] = kv[:, :, :filled]
            self.kv[layer] = kv = grown
        return kv
