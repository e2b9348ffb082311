"""LayerNormalization and Softmax on their compiled float32 row kernels
(asyncinfer/ops/compiled/normalization.py) against onnx's reference implementation."""
from __future__ import annotations

import numpy as np
import pytest

from .op_testing import make_op, randn, reference_run


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
