"""The k largest entries of a row, compiled (numba): a top-k by its cut, without sorting."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def top_k_finite(row, k):
    """row [m] -> mask [m] of its ``k`` largest entries (ties at the cut: lowest index first),
    ``-inf`` entries left out (they mark nothing to pick)."""
    mask = np.zeros(row.shape[0], dtype=np.bool_)
    cut, ties = cut_and_ties(row, k)
    for j in range(row.shape[0]):
        if row[j] > cut:
            mask[j] = True
        elif row[j] == cut and ties > 0:
            mask[j] = True
            ties -= 1
    return mask


@numba.njit(cache=True, nogil=True)
def cut_and_ties(row, k):
    """The rule of :func:`top_k_finite` as two numbers: pick every entry above ``cut``, then the
    first ``ties`` entries equal to it (callers that scan several rows at once apply it themselves).
    Nothing to pick: cut = +inf."""
    k = min(k, row.shape[0])
    if k <= 0:
        return np.float32(np.inf), 0
    cut = kth_largest(row, k)
    if cut == -np.inf:
        return cut, 0
    above = 0
    for j in range(row.shape[0]):
        above += row[j] > cut
    return cut, k - above


SAMPLE_STEP = 8  # kth_largest: every 8th entry of a long row names a threshold


@numba.njit(cache=True, nogil=True)
def kth_largest(row, k):
    """The ``k``-th largest entry of row [m] (1 <= k <= m).

    A long row is first cut by a threshold read off a sample (every ``SAMPLE_STEP``-th entry, at
    about 1.5 k / step of its ranks): when at least ``k`` entries reach it, the answer is among
    them, so the heap sees ~1.5 k entries instead of m;
    otherwise the whole row goes through the heap. Exact either way."""
    m = row.shape[0]
    rank = (3 * k) // (2 * SAMPLE_STEP) + 1
    if m >= 4 * k and rank >= 4:
        sample = row[::SAMPLE_STEP].copy()  # [m / step]
        threshold = _heap_kth(sample, min(rank, sample.shape[0]))
        reach = 0
        for j in range(m):
            reach += row[j] >= threshold
        if reach >= k:
            kept = np.empty(reach, dtype=row.dtype)  # [reach] every entry >= threshold
            n = 0
            for j in range(m):
                if row[j] >= threshold:
                    kept[n] = row[j]
                    n += 1
            return _heap_kth(kept, k)
    return _heap_kth(row, k)


@numba.njit(cache=True, nogil=True)
def _heap_kth(row, k):
    """The ``k``-th largest of row [m]: a min-heap of the best k seen so far, so most entries cost
    one comparison with its root."""
    heap = row[:k].copy()  # [k]
    for i in range(k // 2 - 1, -1, -1):
        _sift_down(heap, i)
    for j in range(k, row.shape[0]):
        if row[j] > heap[0]:
            heap[0] = row[j]
            _sift_down(heap, 0)
    return heap[0]


@numba.njit(cache=True, nogil=True)
def _sift_down(heap, i):
    n = heap.shape[0]
    while True:
        low, left, right = i, 2 * i + 1, 2 * i + 2
        if left < n and heap[left] < heap[low]:
            low = left
        if right < n and heap[right] < heap[low]:
            low = right
        if low == i:
            return
        heap[i], heap[low] = heap[low], heap[i]
        i = low
