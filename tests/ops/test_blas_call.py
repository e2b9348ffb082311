"""BLAS's sgemm called from compiled code (asyncinfer/ops/compiled/blas_call.py), and the GEMMs
that `linalg.matmul` shares with the CPU backend's spin team through it."""
from __future__ import annotations

import numpy as np
import pytest

from asyncinfer.ops import linalg
from asyncinfer.ops.compiled import blas_call

from .op_testing import spin_team_bound

needs_sgemm = pytest.mark.skipif(not blas_call.available(),
                                 reason="NumPy's BLAS exports no cblas_sgemm here: kernels keep their NumPy path")


@needs_sgemm
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (7, 13, 5), (64, 300, 33), (3, 1000, 2)])
def test_sgemm_from_compiled_code_equals_numpy(m, k, n, rng):
    """Operands read in place with their row strides (views into wider arrays), the result
    overwritten (NaN before: beta is 0)."""
    a_wide = rng.standard_normal((m, k + 3)).astype(np.float32)
    b_wide = rng.standard_normal((k, n + 5)).astype(np.float32)
    a, b = a_wide[:, 1:k + 1], b_wide[:, 2:n + 2]
    c_wide = np.full((m, n + 1), np.nan, np.float32)
    blas_call.gemm(a, b, c_wide[:, :n], blas_call.SGEMM, blas_call.ILP64)
    np.testing.assert_allclose(c_wide[:, :n], a @ b, rtol=1e-5, atol=1e-5)
    assert np.isnan(c_wide[:, n]).all()  # nothing written past the result's columns


def test_without_the_symbol_the_binding_is_unavailable(monkeypatch):
    monkeypatch.setattr(blas_call, "SGEMM", 0)
    blas_call.available.cache_clear()
    try:
        assert not blas_call.available()
    finally:
        monkeypatch.undo()
        blas_call.available.cache_clear()


@pytest.mark.parametrize("m, k, n, split", [(96, 40, 50, "rows"), (10, 40, 300, "columns"), (1, 64, 200, "columns")])
@pytest.mark.parametrize("helpers", [1, 2])
def test_matmul_shares_bands_with_the_spin_team(m, k, n, split, helpers, rng, monkeypatch):
    """Bands of rows, or of columns starting on whole vectors, one per sharer: the product of
    one BLAS call."""
    monkeypatch.setattr(linalg, "TEAM_MIN_MACS", 0)
    monkeypatch.setattr(linalg, "FEW_ROWS_MIN_B_BYTES", 1 << 40)  # (a one-row product keeps BLAS here)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    with spin_team_bound(helpers) as runs:
        got = linalg.matmul(a, b)
    assert runs.shared == 1
    np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-5)


def test_operands_blas_cannot_read_in_place_keep_numpy(rng, monkeypatch):
    """A transposed operand (columns not contiguous), a broadcast one (row stride 0), float64:
    not shared, still right."""
    monkeypatch.setattr(linalg, "TEAM_MIN_MACS", 0)
    a = rng.standard_normal((40, 64)).astype(np.float32)
    b = rng.standard_normal((64, 96)).astype(np.float32)
    row = np.broadcast_to(rng.standard_normal((1, 64)).astype(np.float32), (40, 64))
    with spin_team_bound(1) as runs:
        for x, y in [(b.T, a.T), (row, b), (a.astype(np.float64), b.astype(np.float64))]:
            np.testing.assert_allclose(linalg.matmul(x, y), np.matmul(x, y), rtol=1e-5, atol=1e-5)
    assert runs.shared == 0


@needs_sgemm
@pytest.mark.parametrize("m, k, n, split", [(96, 40, 50, "rows"), (10, 40, 300, "columns"), (33, 17, 70, "columns")])
@pytest.mark.parametrize("helpers", [1, 2])
def test_a_shared_gemm_adds_the_bias_row_in_each_band(m, k, n, split, helpers, rng, monkeypatch):
    """``matmul(a, b, bias)`` on the team: each sharer adds its columns of the bias to its band,
    the float32 additions of ``y += bias`` after the product, so the very bits of the unshared
    way; the rows past a band's columns are left alone."""
    monkeypatch.setattr(linalg, "TEAM_MIN_MACS", 0)
    monkeypatch.setattr(linalg, "FEW_ROWS_MIN_B_BYTES", 1 << 40)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    with spin_team_bound(helpers) as runs:
        got = linalg.matmul(a, b, bias)
        expected = linalg.matmul(a, b)  # the same bands without the bias
    assert runs.shared == 2
    expected += bias
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(got, a @ b + bias, rtol=1e-5, atol=1e-5)


def test_the_compiled_bias_row_equals_numpys_broadcast_add(rng):
    """`blas_call.add_bias` (float32 rows, strided), as `linalg._plus` uses it: the same bits as
    ``y += bias``, nothing written past the view's columns."""
    wide = rng.standard_normal((37, 70)).astype(np.float32)
    y = wide[:, :65]
    bias = rng.standard_normal(65).astype(np.float32)
    expected, tail = y + bias, wide[:, 65:].copy()
    blas_call.add_bias(y, bias)
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(wide[:, 65:], tail)
