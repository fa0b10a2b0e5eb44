"""The centroids search's exact rescoring on the compute device, from a cache of the candidates'
page keys there.

Consecutive decode steps of a real model nominate mostly the same candidates (how many:
``bench/candidate_reuse.py``), so the keys of recent candidates stay on the device, in slots per
KV head keyed by page and version like the selected pages' :class:`icekv.kv.DevicePageCache`,
and only pages not resident (or changed by an insert) cross from the host store, in one staged
copy. The host then reads the keys
of those pages only, where :func:`icekv.index.fused_search.candidate_search` reads every
candidate's. Scoring is :func:`icekv.index.device_centroids.best_per_query_head`, as the
centroids are ranked (``select_pages`` with each query head a row): per query head, its best
pages by max q.k over the page's tokens (ties to the lower page id), which the host interleaves
as the host search does. The copy is in the compute dtype; the host store stays the source of truth.

A page's holes (tokens moved to other pages) are filled with a copy of one of its own keys when
loaded: a page's score is a max over its tokens, which duplicates do not change, so every slot
is scored as a full page (or skipped, without members).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from icekv.index.device_centroids import best_per_query_head
from icekv.index.fused_search import merge_ranked_picks, union_of_picks
from icekv.index.page_store import PageStore
from icekv.index.score_rows import narrow, raw, widen
from icekv.kv.transfer import StagedTransfer


class DeviceRescoring:
    """Page keys of one layer's recent candidates (of ``store``) on ``device`` in ``dtype``: up to
    ``max_slots`` pages per KV head (at least a step's most candidates per head), the least
    recently used replaced first: slots beyond one step's candidates keep pages that were
    candidates recently, which often are again."""

    def __init__(self, store: PageStore, device: torch.device, dtype: torch.dtype, max_slots: int):
        self.store, self.max_slots = store, max_slots
        heads, _, page_size = store.tokens.shape
        self.transfer = StagedTransfer(device, dtype)  # host rows -> the slots
        self.k = torch.zeros((heads, 0, page_size, store.dim), dtype=dtype, device=device)  # [H, S, P, D]
        self.page = np.full((heads, 0), -1, dtype=np.int64)  # [H, S] the page in each slot, -1: none
        self.version = np.full((heads, 0), -1, dtype=np.int64)  # [H, S]
        self.length = np.zeros((heads, 0), dtype=np.int32)  # [H, S] P, or 0 for a page without members
        self.slot_of = np.full((heads, 0), -1, dtype=np.int64)  # [H, store capacity] a page's slot, -1: none
        self.used = np.full((heads, 0), -1, dtype=np.int64)  # [H, S] the last search that read each slot
        self.searches = 0
        self.bytes_moved = self.hits = self.lookups = 0

    @property
    def nbytes(self) -> int:
        """Device memory of the copy."""
        return self.k.nbytes

    def search(self, q: torch.Tensor, picks: np.ndarray, k: int, *,
               by_score: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q [H, G, D] on the device, each query head's candidates picks [H, G, c] (-1: none) ->
        (heads, pages, versions) as :func:`icekv.index.fused_search.candidate_search` returns them
        (``by_score``: a rank's query heads taken best score first, ``gqa_merge="score_order"``)."""
        cand, n_cand = union_of_picks(np.ascontiguousarray(picks, dtype=np.int64))  # [H, G * c], [H]
        most = int(n_cand.max(initial=0))
        if k <= 0 or most == 0:
            nothing = np.zeros(0, dtype=np.int64)
            return nothing, nothing, nothing
        slots = self._load(np.ascontiguousarray(cand[:, :most]), n_cand)  # [H, m] each candidate's slot, -1 past n_cand
        return merge_ranked_picks(*self._rank(q, slots, k), self.store.version.numpy(), k, by_score=by_score)

    def _load(self, cand: np.ndarray, n_cand: np.ndarray) -> np.ndarray:
        """Make every candidate resident; cand [H, m] ascending page ids, the first n_cand[h] of
        each head -> their slots [H, m] (-1 past them)."""
        if cand.shape[1] > self.max_slots:
            raise ValueError(f"{cand.shape[1]} candidates for a KV head, room for {self.max_slots}")
        self._grow(min(int(self.store.num_pages.max()), self.max_slots), self.store.capacity)
        self.searches += 1
        slots, miss = _plan(self.slot_of, self.page, self.version, self.used, self.searches,
                            self.store.version.numpy(), cand, n_cand)
        self.lookups += int(n_cand.sum())
        self.hits += int(n_cand.sum()) - len(miss)
        if len(miss):
            staged = self.transfer.staging((len(miss), *self.k.shape[2:]))  # [n, P, D]
            direct = staged.dtype in (torch.float32, torch.bfloat16)  # what the compiled gather writes
            rows = staged if direct else torch.empty(staged.shape)  # [n, P, D]
            self.length[miss[:, 0], miss[:, 2]] = _gather_keys(raw(self.store.keys), self.store.pad.numpy(), miss,
                                                               raw(rows))
            if not direct:
                staged.copy_(rows)
            h, s = (torch.from_numpy(miss[:, i]).to(self.k.device) for i in (0, 2))  # [n] each
            self.k[h, s] = self.transfer.to_device(staged)
            self.bytes_moved += staged.nbytes
        return slots

    def _rank(self, q: torch.Tensor, slots: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each query head's best ``min(k, m)`` candidates by exact score -> (ranked [H, G, kk] page
        ids, their scores [H, G, kk])."""
        heads = np.arange(q.shape[0])
        lens = np.where(slots >= 0, self.length[heads[:, None], slots], 0)  # [H, m]
        ids, lens = (torch.from_numpy(t.astype(np.int32)).to(self.k.device) for t in (slots, lens))  # [H, m] each
        best, scores = (t.cpu().numpy() for t in best_per_query_head(q, self.k, ids, lens, min(k, slots.shape[1])))
        return np.where(best >= 0, self.page[heads[:, None, None], best], -1), scores  # [H, G, kk] each

    def _grow(self, n_slots: int, capacity: int) -> None:
        """Slots for at least ``n_slots`` pages per head (doubling, up to ``max_slots``); a slot map
        for the store's ``capacity`` pages."""
        heads = self.page.shape[0]
        if capacity > self.slot_of.shape[1]:
            self.slot_of = np.concatenate([self.slot_of, np.full((heads, capacity - self.slot_of.shape[1]), -1)], 1)
        if n_slots <= self.page.shape[1]:
            return
        extra = min(max(n_slots, 2 * self.page.shape[1]), self.max_slots) - self.page.shape[1]
        self.k = torch.cat([self.k, self.k.new_zeros((heads, extra, *self.k.shape[2:]))], 1)
        self.page = np.concatenate([self.page, np.full((heads, extra), -1)], 1)
        self.version = np.concatenate([self.version, np.full((heads, extra), -1)], 1)
        self.length = np.concatenate([self.length, np.zeros((heads, extra), dtype=np.int32)], 1)
        self.used = np.concatenate([self.used, np.full((heads, extra), -1)], 1)


@numba.njit(cache=True, nogil=True)
def _plan(slot_of, page, version, used, now, store_version, cand, n_cand):
    """The slot of every candidate: its own where it is resident at the store's version, else the
    least recently used slot no candidate of search ``now`` holds (its page, version, use and map
    entries updated here; the caller copies the keys). -> (slots [H, m], misses [n, 3] as (head,
    page, slot))."""
    h_n, m = cand.shape
    slots = np.full((h_n, m), -1, dtype=np.int64)
    for h in range(h_n):
        for i in range(n_cand[h]):
            p = cand[h, i]
            s = slot_of[h, p]
            if s >= 0 and version[h, s] == store_version[h, p]:
                slots[h, i] = s
                used[h, s] = now
            elif s >= 0:  # resident at an older version: free its slot
                page[h, s], slot_of[h, p], used[h, s] = -1, -1, -1
    misses = np.empty((n_cand.sum(), 3), dtype=np.int64)
    n = 0
    for h in range(h_n):
        order = np.argsort(used[h], kind="mergesort")  # [S] least recently used first, empty slots before all
        free = 0
        for i in range(n_cand[h]):
            if slots[h, i] >= 0:
                continue
            while used[h, order[free]] == now:
                free += 1
            p, s = cand[h, i], order[free]
            if page[h, s] >= 0:
                slot_of[h, page[h, s]] = -1  # evicted
            page[h, s], version[h, s], slot_of[h, p], used[h, s] = p, store_version[h, p], s, now
            slots[h, i] = s
            misses[n, 0], misses[n, 1], misses[n, 2] = h, p, s
            n += 1
    return slots, misses[:n]


@numba.njit(cache=True, nogil=True, parallel=True)
def _gather_keys(keys, pad, misses, out):
    """keys [H, cap, P, W] rows of the score dtype, pad [H, cap, P] (0 on a member), misses [n, 3]
    as (head, page, slot) -> out [n, P, D] (fp32, or bf16 as its bits) each missed page's keys,
    every hole a copy of the page's first member; returns each page's length [n]: P, or 0
    without members (its rows 0). One pass over the rows, pages in parallel."""
    n, p = misses.shape[0], pad.shape[2]
    lengths = np.zeros(n, dtype=np.int32)
    for i in numba.prange(n):
        h, page = misses[i, 0], misses[i, 1]
        first = -1
        for j in range(p):
            if first < 0 and pad[h, page, j] == 0:
                first = j
        if first < 0:
            out[i] = 0
            continue
        lengths[i] = p
        buf = np.empty(out.shape[2], dtype=np.float32)  # [D]
        for j in range(p):
            narrow(widen(keys[h, page, j if pad[h, page, j] == 0 else first], buf), out[i, j])
    return lengths
