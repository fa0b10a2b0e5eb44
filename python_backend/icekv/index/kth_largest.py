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
