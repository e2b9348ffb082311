"""The vectorised row reductions (asyncinfer/ops/compiled/rows.py) and GlobalAveragePool on them,
against NumPy in float64 and onnx's reference implementation."""
from __future__ import annotations

import numpy as np
import pytest

from asyncinfer.ops.compiled.rows import row_max, row_sum, row_sum_squares

from .op_testing import make_op, randn, reference_run


@pytest.mark.parametrize("width", [0, 1, 7, 8, 9, 64, 1001])
def test_row_reductions_match_float64(width, rng):
    row = randn(rng, width) * 10 + 3
    assert row_sum(row) == pytest.approx(float(row.astype(np.float64).sum()), rel=1e-12, abs=1e-12)
    shift = np.float32(2.5)
    want = float(((row - shift).astype(np.float64) ** 2).sum())
    assert row_sum_squares(row, shift) == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert row_max(row) == (row.max() if width else -np.inf)


def test_row_max_ignores_nan_and_sees_inf(rng):
    row = randn(rng, 37)
    row[5] = np.nan
    assert row_max(row) == np.nanmax(row)
    row[30] = np.inf
    assert row_max(row) == np.inf
    assert row_max(np.full(12, np.nan, np.float32)) == -np.inf
    assert np.isnan(row_sum(row))  # a NaN anywhere makes the sum NaN


@pytest.mark.parametrize("shape", [(1, 96, 56, 56), (2, 3, 7, 7), (3, 4, 5), (1, 2, 3, 4, 5)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_global_average_pool_matches_reference(shape, dtype, rng):
    x = (randn(rng, *shape) * 3 + 10).astype(dtype)
    x.reshape(-1)[7] = np.nan
    got = make_op("GlobalAveragePool", {}, n_inputs=1)(x)[0]
    want = reference_run("GlobalAveragePool", [x], {})[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-3 if dtype == np.float16 else 1e-5, equal_nan=True)
