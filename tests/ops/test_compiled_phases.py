"""A row split into its even and odd columns (asyncinfer/ops/compiled/phases.py), for widths
around a vector's and each element type the strided loops use; nothing past a phase is written."""
from __future__ import annotations

import numba
import numpy as np
import pytest

from asyncinfer.ops.compiled.panels import VECTOR_BYTES
from asyncinfer.ops.compiled.phases import split_even_odd, split_pairs_at


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


@numba.njit
def _split_at(source, at, width, target, even, odd):
    split_pairs_at(source, at, width, target, even, odd)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint8])
def test_a_row_at_an_offset_splits_into_two_places_of_one_array(dtype, rng):
    """`split_pairs_at` (a stride-2 stem's padded copy): the vector pairs, the scalar tail and an
    odd last column land where `split_even_odd` puts them, nothing else of the target changes."""
    lanes = VECTOR_BYTES // np.dtype(dtype).itemsize
    for width in sorted({1, 2, 2 * lanes - 1, 2 * lanes, 2 * lanes + 1, 4 * lanes + 3, 224}):
        source = (rng.standard_normal(width + 10) * 50).astype(dtype)
        target = np.full(2 * width + 20, 99, dtype)
        even, odd = 3, 3 + (width + 1) // 2 + 4
        _split_at(source, 5, width, target, even, odd)
        row = source[5:5 + width]
        expected = np.full_like(target, 99)
        expected[even:even + (width + 1) // 2] = row[0::2]
        expected[odd:odd + width // 2] = row[1::2]
        np.testing.assert_array_equal(target, expected)
