"""`compiled.prefetch`: a prefetch is a hint — it changes no value and never faults."""
from __future__ import annotations

import numba
import numpy as np

from asyncinfer.ops.compiled.prefetch import prefetch_lines_for_read, prefetch_lines_for_write


@numba.njit
def _prefetch_spans(a: np.ndarray, starts: np.ndarray, count: int) -> None:
    for s in starts:
        prefetch_lines_for_write(a, s, count)
        prefetch_lines_for_read(a, s, count)


def test_prefetching_spans_changes_nothing_even_past_the_end() -> None:
    for dtype in (np.float32, np.float64, np.int64):
        a = np.arange(1000, dtype=dtype).reshape(10, 100)
        before = a.copy()
        _prefetch_spans(a, np.array([0, 17, 990, 5000], np.int64), 300)  # (the last spans lie past the end)
        np.testing.assert_array_equal(a, before)
