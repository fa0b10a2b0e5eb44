"""A sparse layer's sink and window K/V, kept on the compute device for one request's decode.

Every decode step attends the sink and the window besides the selected pages. Read from the pool
each step, that is four small copies per layer and step when the pool is in host memory. Here
they are copied once when decoding starts; after that each step appends the new token's K/V,
which the model made on the device anyway, and the window's oldest page is dropped when it is
flushed into the index (its tokens stay in the pool, where selection finds them).
"""

from __future__ import annotations

import torch


class DeviceTail:
    """Sink K/V [Hkv, S, D] (fixed) and window K/V [Hkv, W, D] starting at own position
    ``win_start``, holding up to ``capacity`` window tokens."""

    def __init__(self, sink_k: torch.Tensor, sink_v: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
                 win_start: int, capacity: int):
        self.sink_k, self.sink_v = sink_k, sink_v
        hkv, n, d = win_k.shape
        self.win = torch.empty((2, hkv, max(capacity, n), d), dtype=win_k.dtype, device=win_k.device)  # [2, Hkv, cap, D]
        self.win[0, :, :n], self.win[1, :, :n] = win_k, win_v
        self.win_start, self.n = win_start, n

    @property
    def nbytes(self) -> int:
        return self.sink_k.nbytes + self.sink_v.nbytes + self.win.nbytes

    def append(self, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The K/V [Hkv, D] of own position ``position``, the window's next one."""
        if position != self.win_start + self.n or self.n == self.win.shape[2]:
            raise RuntimeError(f"window tail: position {position} does not follow {self.win_start + self.n - 1} "
                               f"or the window is full ({self.win.shape[2]} tokens)")
        self.win[0, :, self.n], self.win[1, :, self.n] = k, v
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
