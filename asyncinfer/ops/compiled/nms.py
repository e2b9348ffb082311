"""The greedy walk of NonMaxSuppression, every class of an image in one compiled call.

Given the image's suppression matrix (which box suppresses which, from `ops.image`), each class
walks its candidates in score order: a candidate is picked unless an earlier pick suppressed it,
and each pick marks the boxes it suppresses. As a Python loop this costs 10-30 µs a class, and a
detector has tens of classes (SSDlite: 90 classes of 300 candidates); here it is one loop over
bytes in L1.
"""
from __future__ import annotations

import numpy as np

from . import kernel


@kernel
def greedy_walk(over: np.ndarray, classes: np.ndarray, rows: np.ndarray, limit: int, picked: np.ndarray) -> int:
    """Walk the candidates ``(classes[k], rows[k])``, sorted by class, then score order within a
    class; mark ``picked[k]`` for each pick (at most ``limit`` a class) and return how many.

    ``over`` (P, P) bool: row i suppresses row j; ``rows`` index it.
    """
    suppressed = np.zeros(over.shape[0], np.bool_)
    count = 0
    taken = 0
    for k in range(classes.shape[0]):
        if k == 0 or classes[k] != classes[k - 1]:  # a new class: nothing suppressed, none taken
            suppressed[:] = False
            taken = 0
        i = rows[k]
        if taken == limit or suppressed[i]:
            continue
        picked[k] = True
        count += 1
        taken += 1
        line = over[i]
        for j in range(over.shape[0]):
            suppressed[j] |= line[j]
    return count


@kernel(contract=False)
def suppression_matrix(y0: np.ndarray, x0: np.ndarray, y1: np.ndarray, x1: np.ndarray, area: np.ndarray,
                       iou_max: float, over: np.ndarray) -> None:
    """``over[i, j]``: box i suppresses box j, i.e. both have an area (``area > 0``; a box with a
    NaN corner has a NaN area) and their IoU is above ``iou_max``. Corners are sorted (y0 <= y1,
    x0 <= x1); each value is computed as ONNX Runtime and NumPy do, in float32, no FMA."""
    n = area.shape[0]
    zero = area.dtype.type(0.0)
    for i in range(n):
        row = over[i]
        if not area[i] > zero:
            row[:] = False
            continue
        for j in range(n):
            h = (y1[i] if y1[i] < y1[j] else y1[j]) - (y0[i] if y0[i] > y0[j] else y0[j])
            w = (x1[i] if x1[i] < x1[j] else x1[j]) - (x0[i] if x0[i] > x0[j] else x0[j])
            inter = (w if w > zero else zero) * (h if h > zero else zero)
            union = (area[i] + area[j]) - inter
            row[j] = area[j] > zero and inter / union > iou_max
