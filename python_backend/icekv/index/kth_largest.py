"""The k largest entries of a row, compiled (numba): a top-k by its cut, without sorting."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def top_k_finite(row, k):
    """row [m] -> mask [m] of its ``k`` largest entries (ties at the cut: lowest index first),
    ``-inf`` entries left out (they mark nothing to pick)."""
    k = min(k, row.shape[0])
    mask = np.zeros(row.shape[0], dtype=np.bool_)
    if k == 0:
        return mask
    cut = kth_largest(row, k)
    ties = k  # then: entries equal to the cut that still fit
    for j in range(row.shape[0]):
        if row[j] > cut:
            mask[j] = True
            ties -= 1
    for j in range(row.shape[0]):
        if ties == 0 or cut == -np.inf:
            break
        if row[j] == cut:
            mask[j] = True
            ties -= 1
    return mask


@numba.njit(cache=True, nogil=True)
def kth_largest(row, k):
    """The ``k``-th largest entry of row [m] (1 <= k <= m): a min-heap of the best k seen so far,
    so most entries cost one comparison with its root."""
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
