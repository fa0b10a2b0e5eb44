"""A sparse layer's sink and window (its *tail*) for one request's decode, and the attention over
the tail plus the selected pages' slots: the placement of the tail, decided once per request.

Every decode step attends the sink and the window besides the selected pages. Where the pool
and attention are both in CPU memory with fp32 values, :class:`PoolTail` reads them in place from
the request's pages (the compiled kernel takes position ranges: nothing to copy or keep).
Elsewhere, read from the pool each step, that is four small copies per layer and step when the
pool is in host memory: :class:`DeviceTail` copies them once when decoding starts; after that
each step appends the new token's K/V, which the model made on the device anyway, and the
window's oldest page is dropped when it is flushed into the index (its tokens stay in the pool,
where selection finds them).
"""

from __future__ import annotations

import torch

from icekv.attention import sparse_paged_attention
from icekv.kernels.cpu_decode import sparse_decode_pool_cpu
from icekv.kv import DevicePageCache
from icekv.kv.quant import KVFormat


class PoolTail:
    """The tail read in place from the request's pages (``source``, a :class:`RequestPages`):
    own positions ``[0, sink_end)`` and ``[win_start, length)`` of ``layer``."""

    def __init__(self, source, layer: int, sink_end: int, win_start: int, length: int):
        self.source, self.layer, self.sink_end, self.win_start = source, layer, sink_end, win_start
        self.length = length  # own tokens written so far, as the appends tell

    def append(self, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.length = position + 1  # the token is in the pool already

    def advance(self, win_start: int) -> None:
        self.win_start = win_start

    def attend(self, q: torch.Tensor, slots: DevicePageCache) -> torch.Tensor:
        """q [Hq, D] over the tail and the slots this step selected -> [Hq, D]."""
        ranges = self.source.tail_ranges(self.sink_end, self.win_start, self.length)  # [2, 2]
        return sparse_decode_pool_cpu(q, *self.source.pool_rows(self.layer), ranges, slots.k, slots.v,
                                      slots.attended_lengths(), self.source.cache.kv_format)

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sink K, sink V, window K, window V) [Hkv, n, D] values, read from the pool."""
        return self.source.sink_window(self.layer, self.sink_end, self.win_start, self.length)


class DeviceTail:
    """Sink K/V [Hkv, S, D] (fixed) and window K/V [Hkv, W, D] starting at own position
    ``win_start``, holding up to ``capacity`` window tokens."""

    def __init__(self, sink_k: torch.Tensor, sink_v: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
                 win_start: int, capacity: int, kv_format: KVFormat = KVFormat()):
        self.sink_k, self.sink_v, self.kv_format = sink_k, sink_v, kv_format
        hkv, n, d = win_k.shape
        self.win = torch.empty((2, hkv, max(capacity, n), d), dtype=win_k.dtype, device=win_k.device)  # [2, Hkv, cap, D]
        self.win[0, :, :n], self.win[1, :, :n] = win_k, win_v
        self.win_start, self.n = win_start, n

    @property
    def nbytes(self) -> int:
        return self.sink_k.nbytes + self.sink_v.nbytes + self.win.nbytes

    def append(self, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The K/V [Hkv, D] of own position ``position``, the window's next one (kept as reading
        it back from the pool gives it: quantized then decoded when the pool is)."""
        if position != self.win_start + self.n or self.n == self.win.shape[2]:
            raise RuntimeError(f"window tail: position {position} does not follow {self.win_start + self.n - 1} "
                               f"or the window is full ({self.win.shape[2]} tokens)")
        self.win[0, :, self.n], self.win[1, :, self.n] = self.kv_format.as_stored(k), self.kv_format.as_stored(v)
        self.n += 1

    def advance(self, win_start: int) -> None:
        """The window now starts at own position ``win_start``: drop the tokens before it."""
        drop = win_start - self.win_start
        if drop <= 0:
            return
        keep = self.n - drop
        self.win[:, :, :keep] = self.win[:, :, drop : self.n].clone()  # overlapping ranges
        self.win_start, self.n = win_start, keep

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sink K, sink V, window K, window V) as sparse_paged_attention takes them."""
        return self.sink_k, self.sink_v, self.win[0, :, : self.n], self.win[1, :, : self.n]

    def attend(self, q: torch.Tensor, slots: DevicePageCache) -> torch.Tensor:
        """q [Hq, D] over the tail and the slots this step selected -> [Hq, D]."""
        sink_k, sink_v, win_k, win_v = self.views()
        return sparse_paged_attention(q, sink_k, sink_v, slots.k, slots.v, slots.attended_lengths(), win_k, win_v,
                                      self.kv_format)
