"""The device page cache of one layer: ``n_slots`` page slots per KV head, filled from the host.

Each step the selector names the pages each KV head needs; :meth:`DevicePageCache.plan` diffs
them against what the slots already hold (same page, same version) and lists only the missing
ones; :meth:`load` writes them into free slots in one staged bulk copy
(:class:`icekv.kv.transfer.StagedTransfer`: on CUDA a pinned buffer copied on a side stream); on
a CPU-only machine the "device" is CPU memory, but the slots, the diff and the byte accounting are
the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numba
import numpy as np
import torch

from icekv.kv.token_rows import as_bits, copy_token
from icekv.kv.transfer import StagedTransfer


@dataclass(frozen=True)
class TransferPlan:
    """Copy host page ``pages[i]`` of KV head ``heads[i]`` into slot ``slots[i]``."""

    heads: torch.Tensor  # [n]
    pages: torch.Tensor  # [n]
    versions: torch.Tensor  # [n]
    slots: torch.Tensor  # [n]

    def __len__(self) -> int:
        return len(self.pages)


class DevicePageCache:
    """Slots are allocated as selections first need them, up to ``max_slots`` (the budget's
    selected pages), so a short request never holds more device memory than it can use.

    ``scatter(dst_k, dst_v, src_k, src_v, heads, slots)`` writes loaded pages into slots on a GPU
    (the engine passes ``icekv.kernels.scatter_pages``; None: torch indexing)."""

    def __init__(self, num_kv_heads: int, max_slots: int, page_size: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 scatter: Callable | None = None):
        self.max_slots, self.scatter = max_slots, scatter
        self.transfer = StagedTransfer(device, dtype)  # host rows -> these slots
        self.k = torch.zeros((num_kv_heads, 0, page_size, head_dim), dtype=dtype, device=device)  # [Hkv, S, P, D]
        self.v = torch.zeros_like(self.k)
        self.page = torch.full((num_kv_heads, 0), -1, dtype=torch.long)  # resident page id per slot
        self.version = torch.full((num_kv_heads, 0), -1, dtype=torch.long)
        self.length = torch.zeros((num_kv_heads, 0), dtype=torch.long)  # valid tokens
        self.selected = torch.zeros((num_kv_heads, 0), dtype=torch.bool)  # attended this step
        self.bytes_moved = 0
        self.hits = 0
        self.lookups = 0
        self._views: tuple | None = None  # (page, version, length, k bits, v bits) numpy views; None: stale

    @property
    def resident_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def page_bytes(self) -> int:
        return 2 * self.k.shape[2] * self.k.shape[3] * self.k.element_size()

    def plan(self, heads: torch.Tensor, pages: torch.Tensor, versions: torch.Tensor) -> TransferPlan:
        """Selected page ``pages[i]`` of KV head ``heads[i]`` at ``versions[i]`` ([n] each, grouped
        by head) -> the copies still needed.

        Also marks which slots this step attends (hits now, misses once loaded). A miss takes the
        first slot of its head that this step does not attend (slots are few; a compiled loop:
        per-call overhead would dominate in numpy or torch).
        """
        h, p, v = heads.numpy(), pages.numpy(), versions.numpy()
        selected = self._begin_step(h)  # [Hkv, S]
        miss, slots = _plan_slots(self.page.numpy(), self.version.numpy(), h, p, v, selected)
        self._end_step(selected, len(h), len(miss))
        return TransferPlan(*(torch.from_numpy(x) for x in (h[miss], p[miss], v[miss], slots)))

    def _grow(self, n_slots: int) -> None:
        extra = n_slots - self.k.shape[1]
        if extra <= 0:
            return
        pad = lambda t, fill: torch.cat([t, torch.full((t.shape[0], extra, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)], 1)
        self.k, self.v = pad(self.k, 0), pad(self.v, 0)
        self.page, self.version = pad(self.page, -1), pad(self.version, -1)
        self.length, self.selected = pad(self.length, 0), pad(self.selected, False)
        self._views = None

    def _slot_views(self) -> tuple:
        """(page, version, length, k bits, v bits) as numpy views, rebuilt only when slots grow:
        the fused fill runs every layer and step, where each conversion costs microseconds."""
        if self._views is None:
            self._views = (self.page.numpy(), self.version.numpy(), self.length.numpy(), as_bits(self.k),
                           as_bits(self.v))
        return self._views

    def load(self, plan: TransferPlan, staging: torch.Tensor, lengths: torch.Tensor) -> None:
        """Write the planned pages: staging [2, n, P, D] their K and V, gathered on the host into
        one contiguous buffer (best: ``self.transfer.staging``); lengths [n] their valid tokens."""
        if len(plan) == 0:
            return
        staging = self.transfer.to_device(staging)  # one bulk copy (the buffer itself on a CPU)
        h, s = plan.heads.numpy(), plan.slots.numpy()
        if self.k.is_cuda and self.scatter is not None:
            self.scatter(self.k, self.v, staging[0], staging[1], plan.heads, plan.slots)
        elif self.k.is_cuda:
            self.k[plan.heads, plan.slots], self.v[plan.heads, plan.slots] = staging[0], staging[1]
        else:  # one numpy copy per tensor: a few dozen pages, where torch's index_put costs more in dispatch
            as_bits(self.k)[h, s], as_bits(self.v)[h, s] = as_bits(staging[0]), as_bits(staging[1])
        self.page.numpy()[h, s] = plan.pages.numpy()
        self.version.numpy()[h, s] = plan.versions.numpy()
        self.length.numpy()[h, s] = lengths.numpy()
        self.bytes_moved += len(plan) * self.page_bytes

    def fill(self, selection, positions: Callable, pool_rows: tuple | None, gather: Callable) -> None:
        """Make this step's ``selection`` (heads, pages, versions [n]) resident: straight from the
        pool in one compiled pass when the pool and these slots are in CPU memory (``pool_rows``:
        the pool layer and the request's page ids), else the missing pages gathered on the host
        into the staging buffer and copied in bulk. ``positions(heads, pages)`` -> [m, P] their
        tokens (-1: none); ``gather(heads, positions, out)`` -> [2, m, P, W] their stored rows."""
        if pool_rows is not None:
            self.fill_from_pool(selection.heads, selection.pages, selection.versions,
                                positions(selection.heads, selection.pages), *pool_rows)
            return
        plan = self.plan(selection.heads, selection.pages, selection.versions)
        if len(plan):
            refs = positions(plan.heads, plan.pages)  # [m, P]
            lengths = torch.from_numpy(np.count_nonzero(refs.numpy() >= 0, axis=1))  # [m]
            staging = self.transfer.staging((2, *refs.shape, self.k.shape[-1]))  # [2, m, P, W]
            self.load(plan, gather(plan.heads, refs, staging), lengths)

    def fill_from_pool(self, heads: torch.Tensor, pages: torch.Tensor, versions: torch.Tensor,
                       positions: torch.Tensor, pool_layer: torch.Tensor, page_ids: torch.Tensor) -> None:
        """:meth:`plan` + :meth:`load` in one compiled pass, for slots in CPU memory fed straight
        from a host pool in CPU memory (no staging buffer, no plan object): selected page
        ``pages[i]`` of KV head ``heads[i]`` at ``versions[i]`` holds the tokens at ``positions[i]``
        [n, P] (-1: none) of the pool layer [2, Hkv, pages, P, D] whose page list is ``page_ids``.

        Same slots, bytes and counters as plan + gather + load (tested against them); on the
        decode loop's CPU path it replaces half a dozen numpy/torch calls per layer and step."""
        h = heads.numpy()
        selected = self._begin_step(h)  # [Hkv, S]
        page, version, length, k, v = self._slot_views()
        moved = _fill(page, version, length, selected, h, pages.numpy(), versions.numpy(), positions.numpy(),
                      as_bits(pool_layer), page_ids.numpy(), k, v)
        self._end_step(selected, len(h), moved)
        self.bytes_moved += moved * self.page_bytes

    def _begin_step(self, heads: np.ndarray) -> np.ndarray:
        """Slots for the most pages a head selects (up to ``max_slots``); a cleared attended mask."""
        if self.page.shape[1] < self.max_slots:  # once every slot exists, no count is needed
            self._grow(min(int(np.bincount(heads, minlength=self.page.shape[0]).max(initial=0)), self.max_slots))
        return np.zeros(self.page.shape, dtype=bool)  # [Hkv, S]

    def _end_step(self, selected: np.ndarray, lookups: int, misses: int) -> None:
        self.selected = torch.from_numpy(selected)
        self.hits += lookups - misses
        self.lookups += lookups

    def attended_lengths(self) -> torch.Tensor:
        """Valid tokens per slot for this step's attention, 0 for slots not selected [Hkv, S]."""
        lengths = torch.from_numpy(np.where(self.selected.numpy(), self.length.numpy(), 0))  # numpy: no dispatch
        return lengths.to(self.k.device)


@numba.njit(cache=True, nogil=True)
def _plan_slots(page, version, heads, pages, versions, selected):
    """page, version [Hkv, S] what each slot holds; selection heads, pages, versions [n] -> (indices
    of the misses [m], the slot each goes to [m]); marks every attended slot in selected [Hkv, S]."""
    n = heads.shape[0]
    hit = np.zeros(n, dtype=np.bool_)
    for i in range(n):
        for s in range(page.shape[1]):
            if page[heads[i], s] == pages[i] and version[heads[i], s] == versions[i]:
                hit[i] = True
                selected[heads[i], s] = True
    miss = np.nonzero(~hit)[0]
    slots = np.empty(miss.shape[0], dtype=np.int64)
    for r in range(miss.shape[0]):
        h = heads[miss[r]]
        s = 0
        while s < selected.shape[1] and selected[h, s]:
            s += 1
        if s == selected.shape[1]:
            raise ValueError("a KV head was given more pages than it has slots")
        slots[r] = s
        selected[h, s] = True
    return miss, slots


@numba.njit(cache=True, nogil=True, parallel=True)
def _fill(page, version, length, selected, heads, pages, versions, positions, pool_layer, page_ids, k, v):
    """:func:`_plan_slots`, then each miss's rows copied from pool_layer [2, Hkv, pages, P, D] into
    its slot of k, v [Hkv, S, P, D] (zeros past its tokens), and the slot's page, version and length
    set. Returns the number of pages copied."""
    miss, slots = _plan_slots(page, version, heads, pages, versions, selected)
    n, p = miss.shape[0], positions.shape[1]
    for row in numba.prange(n * p):  # rows in parallel: each is a cache miss
        i, j = row // p, row % p
        h, s = heads[miss[i]], slots[i]
        copy_token(pool_layer, page_ids, h, positions[miss[i], j], k[h, s, j], v[h, s, j])
    for i in range(n):
        h, s = heads[miss[i]], slots[i]
        page[h, s], version[h, s] = pages[miss[i]], versions[miss[i]]
        filled = 0
        for j in range(p):
            filled += positions[miss[i], j] >= 0
        length[h, s] = filled
    return n
