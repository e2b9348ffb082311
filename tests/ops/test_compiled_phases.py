"""A row split into its even and odd columns (asyncinfer/ops/compiled/phases.py), for widths
around a vector's and each element type the strided loops use; nothing past a phase is written."""
from __future__ import annotations

import numba
import numpy as np
import pytest

from asyncinfer.ops.compiled.panels import VECTOR_BYTES
from asyncinfer.ops.compiled.phases import split_even_odd


@numba.njit
def _split(row: np.ndarray, even: np.ndarray, odd: np.ndarray) -> None:
    split_even_odd(row, even, odd)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint8, np.int32])
def test_every_width_splits_into_its_phases(dtype, rng):
    lanes = VECTOR_BYTES // np.dtype(dtype).itemsize
    for width in sorted({0, 1, 2, 3, lanes - 1, lanes, 2 * lanes - 1, 2 * lanes, 2 * lanes + 1, 4 * lanes + 3, 111}):
        row = (rng.standard_normal(width) * 50).astype(dtype)
        even = np.full((width + 1) // 2 + 1, 99, dtype)  # (one more: the split must not write past its phase)
        odd = np.full(width // 2 + 1, 99, dtype)
        _split(row, even, odd)
        np.testing.assert_array_equal(even[:-1], row[0::2])
        np.testing.assert_array_equal(odd[:-1], row[1::2])
        assert even[-1] == odd[-1] == 99
