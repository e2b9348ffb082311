"""The one-pass float32 activations (asyncinfer/ops/compiled/activations.py) against their
definitions evaluated in float64, on a dense grid and on the special values."""
from __future__ import annotations

import numpy as np
import pytest

from asyncinfer.ops.compiled import activations

GRID = np.concatenate([np.linspace(-100, 100, 400_001, dtype=np.float32),
                       np.float32([0.0, -0.0, 1e-30, -1e-30, 88.0, 88.5, 88.7, -87.0, -87.5, -103.0])])
SPECIAL = np.float32([np.nan, np.inf, -np.inf, 0.0, -0.0, -3.0, 3.0, -5.0, 5.0])


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of float32 spacing at ``want`` (results under 1e-30 left out: the
    kernels flush subnormal and near-subnormal exponentials to zero)."""
    keep = np.abs(want) > 1e-30
    spacing = np.spacing(np.abs(want[keep]).astype(np.float32)).astype(np.float64)
    return np.abs(got[keep].astype(np.float64) - want[keep]) / spacing


def _run(kernel, x: np.ndarray, *args) -> np.ndarray:
    y = x.copy()
    kernel(y, *args)
    return y


def test_exp_within_3_ulp():
    x = GRID[(GRID > -87.3) & (GRID < 88.7)]
    got = np.array([activations._exp(v) for v in x[::97]], dtype=np.float32)
    assert _ulps(got, np.exp(x[::97].astype(np.float64))).max() <= 3


@pytest.mark.parametrize("alpha", [1.0, 1.702])
def test_swish_matches_definition(alpha):
    x = GRID.astype(np.float64)
    # the definition's one float32 rounding of alpha·x kept: it alone moves e^(alpha·x) by up
    # to |alpha·x|·2^-24 relative (60 ulp at x = -39), the same in any float32 evaluation
    scaled = (np.float32(alpha) * GRID).astype(np.float64)
    want = x / (1 + np.exp(-scaled))
    assert _ulps(_run(activations.swish, GRID, alpha), want).max() <= 4


def test_sigmoid_matches_definition():
    want = 1 / (1 + np.exp(-GRID.astype(np.float64)))
    assert _ulps(_run(activations.sigmoid, GRID), want).max() <= 4


def test_hard_activations_match_definition():
    """Within 2 ulp, plus the float32 rounding of the gate ``x/6 + 1/2`` (absolute, up to
    2^-24): near x = -3 the gate cancels to almost 0, as in any float32 evaluation."""
    x = GRID.astype(np.float64)
    want = x * np.clip(x / 6 + 0.5, 0, 1)
    err = np.abs(_run(activations.hard_swish, GRID).astype(np.float64) - want)
    assert (err <= 2 * np.spacing(np.abs(want).astype(np.float32)) + np.abs(x) * 2.0 ** -24).all()
    alpha, beta = float(np.float32(0.2)), 0.5
    assert _ulps(_run(activations.hard_sigmoid, GRID, alpha, beta), np.clip(alpha * x + beta, 0, 1)).max() <= 2


def test_special_values_follow_the_definitions():
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(_run(activations.sigmoid, SPECIAL), 1 / (1 + np.exp(-SPECIAL)))
        np.testing.assert_array_equal(_run(activations.hard_swish, SPECIAL), SPECIAL * np.clip(SPECIAL / 6 + 0.5, 0, 1))
        np.testing.assert_array_equal(_run(activations.hard_sigmoid, SPECIAL, 0.2, 0.5),
                                      np.clip(np.float32(0.2) * SPECIAL + np.float32(0.5), 0, 1))  # NaN stays
        swish = _run(activations.swish, SPECIAL, 1.0)
    assert np.isnan(swish[0]) and swish[1] == np.inf and np.isnan(swish[2])  # -inf/(1+inf) is NaN
    np.testing.assert_array_equal(np.signbit(swish[3:5]), [False, True])  # ±0 keep their sign


def test_gelu_matches_definition():
    """erf form: within the erf fit's error (3.6e-7 relative on erf) of the float64 definition,
    as an absolute bound scaled by |x|/2; tanh form: 8 ulp plus the float32 rounding of its
    argument y (a few roundings of terms as large as y, each moving e^(2y) by |y|·2^-23)."""
    from math import erf

    x = GRID[::7].astype(np.float64)
    want = 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))
    err = np.abs(_run(activations.gelu, GRID[::7]).astype(np.float64) - want)
    assert (err <= 4 * np.spacing(np.abs(want).astype(np.float32)) + np.abs(x) * 4e-7).all()
    y = np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)
    with np.errstate(over="ignore"):  # e^(-2y) overflows to inf far left: x/inf = -0, right
        want_tanh = x / (1 + np.exp(-2 * y))  # = x/2·(1 + tanh y), without float64's own cancellation
    err = np.abs(_run(activations.gelu_tanh, GRID[::7]).astype(np.float64) - want_tanh)
    keep = np.abs(want_tanh) > 1e-30
    assert (err[keep] <= (8 + 8 * np.abs(y[keep])) * np.spacing(np.abs(want_tanh[keep]).astype(np.float32))).all()
    with np.errstate(all="ignore"):
        special = _run(activations.gelu, SPECIAL)
    assert np.isnan(special[0]) and special[1] == np.inf and np.isnan(special[2])  # -inf·0 is NaN


def test_tanh_within_7e7_relative_and_exact_at_the_ends():
    """`tanh1` (the LSTM cell's tanh) on the grid, across its switch from the Taylor series to the
    exponential form at |v| = 1/8, and on tiny values, where only a series keeps relative accuracy."""
    x = np.concatenate([GRID[::13], np.float32([0.1249, 0.125, 0.1251, -0.125]),
                        np.geomspace(1e-30, 1, 20_000, dtype=np.float32)])
    got = np.array([activations.tanh1(v) for v in x], dtype=np.float32)
    want = np.tanh(x.astype(np.float64))
    nonzero = want != 0
    assert (np.abs(got[nonzero] - want[nonzero]) / np.abs(want[nonzero])).max() <= 7e-7
    special = np.array([activations.tanh1(v) for v in SPECIAL], dtype=np.float32)
    np.testing.assert_array_equal(special[:5], np.float32([np.nan, 1.0, -1.0, 0.0, -0.0]))
    assert np.signbit(special[4])
