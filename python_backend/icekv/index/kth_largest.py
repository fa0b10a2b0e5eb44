"""The k-th largest entry of a row, compiled (numba): the cut of a top-k without sorting."""

from __future__ import annotations

import numba


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
