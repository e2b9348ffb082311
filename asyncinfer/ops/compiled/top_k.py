"""TopK's selection, every row in one compiled call: a heap of the k best, then the heap sorted.

Sorting a whole row to keep its first k costs n·log n comparisons, about one mispredicted branch
each on values in no order: SSDlite's top 300 of 3234 scores took 200 µs in a model's run (a
microbenchmark that repeats one input trains the branch predictor on it and shows 34). Here each
value is compared once with the worst of the k kept so far, a branch that is rarely taken once
the heap holds good values (about k·ln(n/k) replacements), and only the k kept are sorted.

The order is TopK's: by value (descending where ``largest``), ties by ascending index, a NaN the
largest value (where NumPy's sort places it), NaNs among themselves by index; -0.0 equals 0.0.
"""
from __future__ import annotations

import numpy as np

from . import inline, kernel


@inline
def _before(va: float, ia: int, vb: float, ib: int, largest: bool) -> bool:
    """Whether value ``va`` at index ``ia`` comes before ``vb`` at ``ib`` in TopK's order."""
    a_nan, b_nan = va != va, vb != vb
    if a_nan or b_nan:
        if a_nan and b_nan:
            return ia < ib
        return a_nan == largest  # a NaN first among the largest, last among the smallest
    if va == vb:
        return ia < ib
    return va > vb if largest else va < vb


@inline
def _sift_down(values: np.ndarray, index: np.ndarray, size: int, at: int, largest: bool) -> None:
    """Restore the heap below ``at``: every parent comes after its children in the order (the
    root is the worst of those kept)."""
    v, i = values[at], index[at]
    while True:
        child = 2 * at + 1
        if child >= size:
            break
        if child + 1 < size and _before(values[child], index[child], values[child + 1], index[child + 1], largest):
            child += 1  # the later of the two children
        if not _before(v, i, values[child], index[child], largest):
            break
        values[at], index[at] = values[child], index[child]
        at = child
    values[at], index[at] = v, i


@kernel
def top_k_rows(x: np.ndarray, k: int, largest: bool, top: np.ndarray, values: np.ndarray) -> None:
    """``top[r]`` = the indices of row ``r`` of ``x`` (R, n) that TopK keeps, in its order (k ≥ 1,
    k ≤ n); ``values`` (k,) of ``x``'s dtype is scratch."""
    n = x.shape[1]
    index = np.empty(k, np.int64)
    for r in range(x.shape[0]):
        row = x[r]
        for j in range(k):
            values[j], index[j] = row[j], j
        for at in range(k // 2 - 1, -1, -1):
            _sift_down(values, index, k, at, largest)
        for j in range(k, n):
            if _before(row[j], j, values[0], index[0], largest):
                values[0], index[0] = row[j], j
                _sift_down(values, index, k, 0, largest)
        # heapsort: the worst to the end, one at a time, leaves the best first
        for size in range(k - 1, 0, -1):
            values[0], values[size] = values[size], values[0]
            index[0], index[size] = index[size], index[0]
            _sift_down(values, index, size, 0, largest)
        out = top[r]
        for j in range(k):
            out[j] = index[j]
