"""LayerNormalization and Softmax on their compiled float32 row kernels
(asyncinfer/ops/compiled/normalization.py) against onnx's reference implementation."""
from __future__ import annotations

import numpy as np
import pytest

from .op_testing import make_op, randn, reference_run, spin_team_bound


@pytest.mark.parametrize("shape, axis, bias", [((2, 5, 16), -1, True), ((3, 4, 6), 1, True),
                                               ((7, 33), -1, False), ((1, 1, 1), -1, True)])
def test_layer_norm_matches_reference(shape, axis, bias, rng):
    x = randn(rng, *shape) * 3 + 1
    d = shape[axis:] if axis >= 0 else shape[axis:]
    scale, b = randn(rng, *d), randn(rng, *d)
    inputs = [x, scale] + ([b] if bias else [])
    attrs = dict(axis=axis, epsilon=1e-5)
    got = make_op("LayerNormalization", attrs, version=17, n_inputs=len(inputs), n_outputs=3)(*inputs)
    want = reference_run("LayerNormalization", inputs, attrs, n_outputs=3)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset, axis", [(13, -1), (13, 2), (11, 1)])
def test_softmax_matches_reference(opset, axis, rng):
    x = randn(rng, 2, 3, 17) * 20
    x[0, 1] = -np.inf  # a row of -inf: 0/0, NaN
    x[1, 2, 3] = np.inf
    got = make_op("Softmax", dict(axis=axis), n_inputs=1, version=opset)(x)[0]
    with np.errstate(all="ignore"):
        if opset < 13:  # the definition coerces to 2-D at axis (onnx.reference's Softmax-11 does not)
            rows = x.reshape(int(np.prod(x.shape[:axis])), -1)
            want = reference_run("Softmax", [rows], dict(axis=-1), opset=13)[0].reshape(x.shape)
        else:
            want = reference_run("Softmax", [x], dict(axis=axis), opset=opset)[0]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("width", [1, 15, 16, 33, 200])
def test_softmax_rows_of_every_width_with_nan_and_inf(width, rng):
    """The row kernels reduce over 16 partials plus a tail: every split of a row, and the values
    that reductions treat specially (a NaN makes its row NaN, +inf makes its row NaN, -inf is 0)."""
    x = randn(rng, 6, width) * 30
    x[1, width // 2] = np.nan
    x[2, -1] = np.inf
    x[3, 0] = -np.inf
    x[4] = np.nan
    got = make_op("Softmax", dict(axis=-1), n_inputs=1, version=13)(x)[0]
    with np.errstate(all="ignore"):
        want = reference_run("Softmax", [x], dict(axis=-1), opset=13)[0]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("width", [1, 15, 16, 33, 200])
def test_softmax_rows_in_place_have_the_bits_of_a_separate_output(width, rng):
    """`softmax_rows(x, x)` (attention's scores, normalised where they are) takes its own loop,
    one LLVM can vectorise without an aliasing guard; its results must be the other loop's."""
    from asyncinfer.ops.compiled.normalization import softmax_rows
    x = randn(rng, 6, width) * 30
    x[1, width // 2] = np.nan
    x[3, 0] = -np.inf
    apart = np.empty_like(x)
    softmax_rows(x, apart)
    softmax_rows(x, x)
    np.testing.assert_array_equal(x, apart)


@pytest.mark.parametrize("width", [1, 15, 16, 33, 200])
def test_layer_norm_rows_of_every_width(width, rng):
    x = randn(rng, 5, width) * 4 + 100  # a large mean: the variance must not cancel away
    scale, b = randn(rng, width), randn(rng, width)
    attrs = dict(axis=-1, epsilon=1e-5)
    got = make_op("LayerNormalization", attrs, version=17, n_inputs=3, n_outputs=3)(x, scale, b)
    want = reference_run("LayerNormalization", [x, scale, b], attrs, n_outputs=3)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape, axis", [((1, 128, 1024), -1), ((2, 3, 17), -1), ((2, 3, 4, 5), 2), ((1, 1, 1), -1)])
def test_rms_norm_rows_match_reference(shape, axis, rng):
    pytest.importorskip("onnx.reference.ops.op_rms_normalization", reason="onnx without RMSNormalization (opset 23)")
    x = randn(rng, *shape) * 3
    scale = randn(rng, *shape[axis:])
    attrs = dict(axis=axis, epsilon=1e-5)
    got = make_op("RMSNormalization", attrs, version=23, n_inputs=2)(x, scale)[0]
    want = reference_run("RMSNormalization", [x, scale], attrs, opset=23)[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [1, 7, 8, 15, 16, 33, 90])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_max_over_the_last_axis_with_nan_and_inf(width, keepdims, rng):
    """A float32 ReduceMax over the last axis runs on compiled rows (`max_rows`: eight running
    maxima and a tail): every split of a row, NaN anywhere in a row gives NaN (np.max's answer),
    infinities of both signs and a row holding both; views of rows in place or copied."""
    x = randn(rng, 7, 3, width) * 30
    x[1, 0, width // 2] = np.nan
    x[2, 1, -1] = np.inf
    x[3, 2, 0] = -np.inf
    x[4, 0] = -np.inf
    x[5, 1, 0], x[5, 1, -1] = np.inf, -np.inf
    x[6, 2] = np.nan
    op = make_op("ReduceMax", dict(axes=[2], keepdims=keepdims), version=13, n_inputs=1)
    got = op(x)[0]
    want = reference_run("ReduceMax", [x], dict(axes=[2], keepdims=keepdims), opset=13)[0]
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    # views: rows read in place where each is contiguous and evenly spaced, else copied first
    for view in (x[:, :, 1:], x[:, :, ::-1], x[:, ::2], x[::2, 1:]):
        if view.shape[-1]:
            np.testing.assert_array_equal(op(view)[0], np.max(view, axis=2, keepdims=bool(keepdims)))


@pytest.mark.parametrize("helpers", [1, 2])
def test_rows_shared_with_the_spin_team_give_the_bits_of_one_thread(helpers, rng):
    """A softmax or a ReduceMax of many rows (SSDlite's 3234 scores of 91 classes) takes ranges of
    rows on the spinning helpers (`one_pass.row_kernel`): each row as one thread computes it, NaN
    and infinities included, rows read in place from a view too."""
    from asyncinfer.ops.one_pass import ROWS_TEAM_MIN_VALUES

    x = randn(rng, 1, 1203, 91) * 10
    x[0, 5, 3], x[0, 700, 0], x[0, 1100, -1] = np.nan, np.inf, -np.inf
    assert x.size >= ROWS_TEAM_MIN_VALUES
    softmax = make_op("Softmax", dict(axis=-1), version=13, n_inputs=1)
    reduce_max = make_op("ReduceMax", dict(axes=[2], keepdims=0), version=13, n_inputs=1)
    alone = softmax(x)[0], reduce_max(x[:, :, 1:])[0]
    with spin_team_bound(helpers) as runs:
        shared = softmax(x)[0], reduce_max(x[:, :, 1:])[0]
    assert runs.shared == 2
    for got, want in zip(shared, alone):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(shared[1], np.max(x[:, :, 1:], axis=2))
    with np.errstate(all="ignore"):  # (the reference's own inf - inf)
        want = reference_run("Softmax", [x], dict(axis=-1), opset=13)[0]
    np.testing.assert_allclose(shared[0], want, rtol=1e-5, atol=1e-7)
