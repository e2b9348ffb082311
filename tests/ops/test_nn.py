"""Kernels of asyncinfer/ops/{conv,pool,normalization,linalg,resize,rnn}.py.

Every ONNX backend node test case runs through the whole engine on every backend
(tests/node_cases.py); here, that the cases made only of these ops cover them (the training-mode
BatchNormalization cases are expected failures there). Targeted tests compare with onnxruntime on random inputs for
what the node cases cover thinly (grouped/depthwise/strided/dilated convs, ceil-mode pools, RNN
options…), and check dtypes, input immutability, thread safety and refusal of what is not
implemented.
"""
from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest

from asyncinfer import ops
from asyncinfer.errors import UnsupportedOperatorError
from asyncinfer.model.ir import Layer
from node_cases import cases_made_of, expected_failures_among
from op_testing import compare_with_ort, make_op, ort_run, randn, reference_run  # noqa: F401

ort = pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the reference")

OPS = set("""Conv ConvTranspose MaxPool AveragePool GlobalAveragePool GlobalMaxPool LpPool GlobalLpPool
    BatchNormalization LayerNormalization InstanceNormalization GroupNormalization LRN
    MeanVarianceNormalization LpNormalization RMSNormalization MatMul Gemm Einsum Resize Upsample
    LSTM GRU RNN""".split())


def _own_cases() -> dict[str, object]:
    return cases_made_of(OPS)


def test_node_case_selection_is_not_empty():
    names = _own_cases()
    assert len(names) >= 200
    for op in OPS - {"Upsample", "RMSNormalization", "GlobalLpPool"}:
        assert any(op in {n.op_type for n in c.model.graph.node} for c in names.values()), op
    assert not expected_failures_among(names)  # every case passes, training-mode BatchNormalization included


# -- Conv / ConvTranspose --------------------------------------------------------------------------
CONV_CASES = {
    # name: (x shape, out channels, kernel, attrs)
    "3x3_pad": ((1, 8, 12, 12), 16, (3, 3), dict(pads=[1, 1, 1, 1])),
    "1x1": ((2, 16, 7, 9), 8, (1, 1), {}),
    "1x1_stride2": ((1, 16, 9, 9), 8, (1, 1), dict(strides=[2, 2])),
    "7x7_stride2": ((1, 3, 32, 32), 8, (7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3])),
    "asym_pads_strides": ((1, 4, 11, 10), 6, (3, 2), dict(strides=[2, 3], pads=[0, 1, 2, 1])),
    "dilated": ((1, 4, 15, 15), 5, (3, 3), dict(dilations=[2, 3], pads=[2, 3, 2, 3])),
    "same_upper": ((1, 3, 10, 9), 4, (4, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    "same_lower": ((1, 3, 10, 9), 4, (4, 3), dict(auto_pad="SAME_LOWER", strides=[2, 2])),
    "valid": ((1, 3, 10, 9), 4, (3, 3), dict(auto_pad="VALID", strides=[2, 1])),
    "grouped": ((2, 12, 9, 9), 6, (3, 3), dict(group=3, pads=[1, 1, 1, 1])),
    "grouped_1x1": ((1, 24, 8, 8), 12, (1, 1), dict(group=3)),
    "depthwise": ((2, 16, 14, 14), 16, (3, 3), dict(group=16, pads=[1, 1, 1, 1])),
    "depthwise_stride2": ((1, 16, 15, 15), 16, (3, 3), dict(group=16, strides=[2, 2], pads=[1, 1, 1, 1])),
    "depthwise_stride2_even": ((1, 8, 14, 14), 8, (3, 3), dict(group=8, strides=[2, 2], pads=[1, 1, 1, 1])),
    "depthwise_5x5_dilated": ((1, 8, 13, 13), 8, (5, 5), dict(group=8, dilations=[2, 2], pads=[4, 4, 4, 4])),
    "depthwise_multiplier": ((1, 8, 10, 10), 16, (3, 3), dict(group=8, strides=[1, 2])),
    "depthwise_asym": ((1, 6, 9, 11), 6, (3, 5), dict(group=6, strides=[3, 2], pads=[0, 2, 1, 0])),
    "fewer_outputs_tap_gemms": ((1, 16, 12, 12), 4, (3, 3), dict(pads=[1, 1, 1, 1])),
    "fewer_outputs_strided_batch": ((2, 12, 17, 15), 5, (3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "small_map_exact_im2col": ((2, 8, 7, 7), 16, (3, 3), dict(pads=[1, 1, 1, 1])),
    "small_map_grouped_strided": ((2, 8, 7, 6), 4, (3, 3), dict(group=2, strides=[2, 1], pads=[1, 0, 2, 1])),
    "conv1d": ((2, 4, 20), 6, (5,), dict(strides=[2], pads=[2, 1])),
    "conv1d_depthwise": ((1, 4, 20), 4, (3,), dict(group=4, strides=[2], pads=[1, 1])),
    "conv3d": ((1, 3, 6, 7, 8), 4, (3, 3, 3), dict(pads=[1, 0, 1, 1, 0, 1], strides=[1, 2, 1])),
    "conv3d_depthwise": ((1, 4, 6, 7, 8), 4, (3, 3, 3), dict(group=4, pads=[1] * 6, strides=[2, 1, 2])),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(CONV_CASES))
def test_conv_matches_onnxruntime(name, bias, rng):
    shape, m, kernel, attrs = CONV_CASES[name]
    group = attrs.get("group", 1)
    x = randn(rng, *shape)
    w = randn(rng, m, shape[1] // group, *kernel)
    b = randn(rng, m) if bias else None
    compare_with_ort("Conv", [x, w] + ([b] if bias else []), dict(attrs, kernel_shape=list(kernel)))


@pytest.mark.parametrize("name", ["small_map_exact_im2col", "small_map_grouped_strided", "grouped", "3x3_pad",
                                  "7x7_stride2", "same_lower", "fewer_outputs_strided_batch"])
def test_conv_im2col_paths_agree(name, rng, monkeypatch):
    """The exact and the flat-window im2col of the tiled conv give the same convolution (the
    flat one's padding columns dropped as the epilogue stores each block)."""
    from asyncinfer.ops import conv_gemm

    shape, m, kernel, attrs = CONV_CASES[name]
    x = randn(rng, *shape)
    w = randn(rng, m, shape[1] // attrs.get("group", 1), *kernel)
    b = randn(rng, m)
    layer = Layer("c", "Conv", ["x", "w", "b"], ["y"], attrs=dict(attrs, kernel_shape=list(kernel)), version=17)
    results = []
    for waste, taps, min_taps in ((0.0, 1 << 30, 0), (float("inf"), 0, 1 << 30)):  # always exact, never exact
        monkeypatch.setattr(conv_gemm, "EXACT_IM2COL_WASTE", waste)
        monkeypatch.setattr(conv_gemm, "EXACT_IM2COL_MAX_STRIDED_TAPS", taps)
        monkeypatch.setattr(conv_gemm, "EXACT_IM2COL_MIN_TAPS", min_taps)
        results.append(ops.create(layer)(x, w, b)[0])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-5)


def test_conv_without_kernel_shape_attribute(rng):
    x, w = randn(rng, 1, 3, 8, 8), randn(rng, 4, 3, 3, 3)
    compare_with_ort("Conv", [x, w], dict(pads=[1, 1, 1, 1]))


def test_conv_float64_stays_float64(rng):
    # onnxruntime has no float64 Conv: compare with our float32 result (itself checked above)
    x, w = randn(rng, 1, 2, 6, 6, dtype=np.float64), randn(rng, 3, 2, 3, 3, dtype=np.float64)
    op = make_op("Conv", dict(kernel_shape=[3, 3]), n_inputs=2)
    y = op.run(x, w)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, op.run(x.astype(np.float32), w.astype(np.float32)), rtol=1e-5, atol=1e-5)


CONV_TRANSPOSE_CASES = {
    "stride2": ((1, 4, 5, 5), 3, (3, 3), dict(strides=[2, 2])),
    "stride2_pads_outpad": ((2, 4, 5, 6), 3, (3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])),
    "group2_dilated": ((1, 4, 5, 5), 2, (3, 3), dict(group=2, dilations=[2, 2])),
    "output_shape": ((1, 2, 4, 4), 3, (3, 3), dict(strides=[2, 2], output_shape=[9, 10])),
    "same_upper": ((1, 2, 4, 5), 3, (3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    "same_lower": ((1, 2, 4, 5), 3, (4, 4), dict(strides=[2, 2], auto_pad="SAME_LOWER")),
    "1d": ((1, 3, 7), 2, (4,), dict(strides=[3], pads=[1, 2])),
    "3d": ((1, 2, 3, 4, 3), 2, (2, 3, 2), dict(strides=[2, 1, 2])),
}


@pytest.mark.parametrize("name", sorted(CONV_TRANSPOSE_CASES))
def test_conv_transpose_matches_onnxruntime(name, rng):
    shape, mg, kernel, attrs = CONV_TRANSPOSE_CASES[name]
    x = randn(rng, *shape)
    w = randn(rng, shape[1], mg, *kernel)
    b = randn(rng, mg * attrs.get("group", 1))
    compare_with_ort("ConvTranspose", [x, w, b], dict(attrs, kernel_shape=list(kernel)))


def test_conv_is_thread_safe(rng):
    x = [randn(rng, 1, 8, 16, 16) for _ in range(4)]
    w = randn(rng, 8, 1, 3, 3)
    op = make_op("Conv", dict(group=8, pads=[1, 1, 1, 1]), n_inputs=2)
    expected = [op.run(xi, w) for xi in x]
    errors = []

    def work(k):
        for _ in range(20):
            if not np.array_equal(op.run(x[k], w), expected[k]):
                errors.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# -- pools ------------------------------------------------------------------------------------------
POOL_CASES = {
    "3x3_s2_p1": ((1, 4, 13, 13), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "2x2_s2": ((2, 3, 8, 10), dict(kernel_shape=[2, 2], strides=[2, 2])),
    "3x3_s1_p1": ((1, 3, 7, 7), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "ceil": ((1, 2, 10, 11), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    "ceil_pads": ((1, 2, 9, 9), dict(kernel_shape=[3, 2], strides=[2, 3], pads=[1, 0, 1, 1], ceil_mode=1)),
    "dilated": ((1, 2, 12, 12), dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[1, 1, 1, 1])),
    "same_upper": ((1, 2, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    "same_lower": ((1, 2, 9, 8), dict(kernel_shape=[2, 2], strides=[2, 2], auto_pad="SAME_LOWER")),
    "1d": ((1, 3, 17), dict(kernel_shape=[4], strides=[3], pads=[1, 2])),
    "3d": ((1, 2, 6, 7, 5), dict(kernel_shape=[2, 3, 2], strides=[2, 2, 1], pads=[0, 1, 1, 1, 1, 0])),
}


@pytest.mark.parametrize("name", sorted(POOL_CASES))
def test_max_pool_matches_onnxruntime(name, rng):
    shape, attrs = POOL_CASES[name]
    compare_with_ort("MaxPool", [randn(rng, *shape)], attrs)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("name", ["3x3_s2_p1", "ceil", "2x2_s2", "1d", "3d"])
def test_max_pool_indices_match_onnxruntime(name, storage_order, rng):
    shape, attrs = POOL_CASES[name]
    compare_with_ort("MaxPool", [randn(rng, *shape)], dict(attrs, storage_order=storage_order), n_outputs=2)


def test_max_pool_integers(rng):
    x = rng.integers(0, 255, (1, 3, 9, 9), dtype=np.uint8)
    compare_with_ort("MaxPool", [x], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("name", sorted(POOL_CASES))
def test_average_pool_matches_onnxruntime(name, include_pad, rng):
    shape, attrs = POOL_CASES[name]
    compare_with_ort("AveragePool", [randn(rng, *shape)], dict(attrs, count_include_pad=include_pad))


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("name", ["3x3_s2_p1", "2x2_s2", "1d", "ceil"])
def test_lp_pool_matches_onnxruntime(name, p, rng):
    shape, attrs = POOL_CASES[name]
    compare_with_ort("LpPool", [randn(rng, *shape)], dict(attrs, p=p))


@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"])
@pytest.mark.parametrize("shape", [(2, 3, 7, 5), (1, 4, 9), (1, 2, 3, 4, 5)])
def test_global_pools_match_onnxruntime(op_type, shape, rng):
    compare_with_ort(op_type, [randn(rng, *shape)])


# -- normalization ------------------------------------------------------------------------------------
def test_batch_normalization_matches_onnxruntime(rng):
    x = randn(rng, 2, 6, 5, 4)
    scale, bias, mean = randn(rng, 6), randn(rng, 6), randn(rng, 6)
    var = rng.uniform(0.5, 2, 6).astype(np.float32)
    compare_with_ort("BatchNormalization", [x, scale, bias, mean, var], dict(epsilon=1e-3))
    compare_with_ort("BatchNormalization", [x, scale, bias, mean, var], opset=9)


@pytest.mark.parametrize("size", [1, 3, 5])
def test_lrn_matches_onnxruntime(size, rng):
    x = randn(rng, 2, 7, 5, 5)
    compare_with_ort("LRN", [x], dict(size=size, alpha=1e-2, beta=0.75, bias=2.0))
    compare_with_ort("LRN", [x], dict(size=size, alpha=1e-3, beta=0.6))


def test_lrn_even_size_follows_the_spec(rng):
    # onnxruntime refuses even sizes; the spec's window is [c - floor((s-1)/2), c + ceil((s-1)/2)]
    x = randn(rng, 1, 6, 2, 3)
    size, alpha, beta, bias = 4, 0.1, 0.75, 1.5
    expected = np.empty_like(x)
    for c in range(6):
        lo, hi = max(0, c - 1), min(5, c + 2)
        square_sum = np.square(x[:, lo:hi + 1]).sum(axis=1)
        expected[:, c] = x[:, c] / (bias + alpha / size * square_sum) ** beta
    got = make_op("LRN", dict(size=size, alpha=alpha, beta=beta, bias=bias)).run(x)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_instance_and_layer_normalization_match_onnxruntime(rng):
    x = randn(rng, 2, 3, 5, 4)
    compare_with_ort("InstanceNormalization", [x, randn(rng, 3), randn(rng, 3)], dict(epsilon=1e-4))
    for axis in (-1, -2, 1):
        normalized = x.shape[axis:]
        compare_with_ort("LayerNormalization", [x, randn(rng, *normalized), randn(rng, *normalized)],
                         dict(axis=axis), opset=17, n_outputs=3)
    compare_with_ort("LayerNormalization", [x, randn(rng, 4)], opset=17)


def test_group_normalization_versions(rng):
    x = randn(rng, 2, 6, 3, 3)
    scale, bias = randn(rng, 6), randn(rng, 6)
    compare_with_ort("GroupNormalization", [x, scale, bias], dict(num_groups=3, epsilon=1e-3), opset=21)
    # version 18: one scale/bias per group, i.e. version 21 with the values repeated per channel
    g_scale, g_bias = randn(rng, 3), randn(rng, 3)
    old = make_op("GroupNormalization", dict(num_groups=3), version=18, n_inputs=3).run(x, g_scale, g_bias)
    new = make_op("GroupNormalization", dict(num_groups=3), version=21, n_inputs=3).run(
        x, np.repeat(g_scale, 2), np.repeat(g_bias, 2))
    np.testing.assert_allclose(old, new, rtol=1e-6)


def test_mvn_and_lp_normalization_match_onnxruntime(rng):
    x = randn(rng, 2, 3, 4, 5)
    compare_with_ort("MeanVarianceNormalization", [x])
    compare_with_ort("MeanVarianceNormalization", [x], dict(axes=[1, 3]))
    x[0, :, 1] = 0  # an all-zero slice must stay finite
    for p in (1, 2):
        compare_with_ort("LpNormalization", [x], dict(p=p, axis=2))


def test_batch_normalization_does_not_promote_float16(rng):
    x = randn(rng, 1, 3, 4, 4, dtype=np.float16)
    params = [randn(rng, 3, dtype=np.float16) for _ in range(3)] + [np.ones(3, np.float16)]
    y = make_op("BatchNormalization", version=15, n_inputs=5).run(x, *params)
    assert y.dtype == np.float16


# -- linalg -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("attrs, c_shape", [
    ({}, None), ({}, (5,)), ({}, (1,)), ({}, (3, 5)), ({}, (3, 1)),
    (dict(transA=1, transB=1, alpha=0.5, beta=2.0), (5,)), (dict(transB=1, beta=0.0), (3, 5)),
])
def test_gemm_matches_onnxruntime(attrs, c_shape, rng):
    a = randn(rng, 4, 3) if attrs.get("transA") else randn(rng, 3, 4)
    b = randn(rng, 5, 4) if attrs.get("transB") else randn(rng, 4, 5)
    inputs = [a, b] + ([randn(rng, *c_shape)] if c_shape else [])
    compare_with_ort("Gemm", inputs, attrs)


@pytest.mark.parametrize("attrs, c_shape", [
    (dict(transB=1), (40,)), (dict(transB=1), None), (dict(transB=1, alpha=0.5, beta=2.0), (1, 40)),
    (dict(transA=1, transB=1, beta=0.0), (40,)),
])
def test_one_row_by_a_transposed_weight_matches_the_reference(attrs, c_shape, rng):
    """A Linear layer's single row (transB=1) runs as weight @ row, the weight's rows in place."""
    a = randn(rng, 24, 1) if attrs.get("transA") else randn(rng, 1, 24)
    inputs = [a, randn(rng, 40, 24)] + ([randn(rng, *c_shape)] if c_shape else [])
    (got,) = make_op("Gemm", attrs, n_inputs=len(inputs))(*inputs)
    (want,) = reference_run("Gemm", inputs, attrs)
    assert got.shape == want.shape == (1, 40) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gemm_keeps_inputs_intact(rng):
    a, b, c = randn(rng, 3, 4), randn(rng, 4, 5), randn(rng, 3, 5)
    before = c.copy()
    make_op("Gemm", dict(alpha=2.0, beta=3.0), n_inputs=3).run(a, b, c)
    np.testing.assert_array_equal(c, before)


@pytest.mark.parametrize("eq, shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij,kj", [(3, 4), (5, 4)]), ("ba", [(3, 4)]), ("...ij,...jk", [(2, 3, 4), (2, 4, 5)]),
])
def test_einsum_matches_onnxruntime(eq, shapes, rng):
    compare_with_ort("Einsum", [randn(rng, *s) for s in shapes], dict(equation=eq))


def test_einsum_implicit_output_puts_upper_case_first(rng):
    # onnxruntime rejects upper-case labels; the spec orders implicit outputs by ASCII ("A" < "a")
    x = randn(rng, 3, 4)
    np.testing.assert_array_equal(make_op("Einsum", dict(equation="bA")).run(x), x.T)
    y = randn(rng, 4, 5)
    np.testing.assert_allclose(make_op("Einsum", dict(equation="aB,Bc"), n_inputs=2).run(x, y), x @ y, rtol=1e-5)


# -- resize -----------------------------------------------------------------------------------------
RESIZE_CASES = [
    dict(mode="nearest"), dict(mode="nearest", nearest_mode="floor", coordinate_transformation_mode="asymmetric"),
    dict(mode="nearest", nearest_mode="round_prefer_ceil", coordinate_transformation_mode="align_corners"),
    dict(mode="nearest", nearest_mode="ceil", coordinate_transformation_mode="half_pixel"),
    dict(mode="linear"), dict(mode="linear", coordinate_transformation_mode="align_corners"),
    dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
    dict(mode="linear", coordinate_transformation_mode="asymmetric"),
    dict(mode="cubic"), dict(mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1),
    dict(mode="cubic", coordinate_transformation_mode="asymmetric"),
]


@pytest.mark.parametrize("attrs", RESIZE_CASES, ids=lambda a: "-".join(str(v) for v in a.values()))
@pytest.mark.parametrize("sizes", [(1, 2, 12, 18), (1, 2, 5, 4), (1, 2, 9, 3)])
def test_resize_sizes_match_onnxruntime(attrs, sizes, rng):
    x = randn(rng, 1, 2, 6, 7)
    compare_with_ort("Resize", [x, None, None, np.array(sizes, np.int64)], attrs, opset=19)


@pytest.mark.parametrize("scales", [(1, 1, 2, 2), (1, 1, 0.5, 0.75), (1, 1, 1.5, 3)])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_scales_match_onnxruntime(mode, scales, rng):
    x = randn(rng, 1, 3, 8, 6)
    compare_with_ort("Resize", [x, None, np.array(scales, np.float32)], dict(mode=mode), opset=13)


def test_resize_tf_crop_and_resize_matches_onnxruntime(rng):
    x = randn(rng, 1, 1, 6, 6)
    roi = np.array([0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2], np.float32)
    for mode in ("nearest", "linear"):
        compare_with_ort("Resize", [x, roi, None, np.array([1, 1, 4, 5], np.int64)],
                         dict(mode=mode, coordinate_transformation_mode="tf_crop_and_resize",
                              extrapolation_value=-3.0), opset=13)


def test_resize_v10_and_upsample_match_onnxruntime(rng):
    x = randn(rng, 1, 2, 4, 6)
    for scales in ((1, 1, 2, 3), (1, 1, 2, 1.5)):
        sc = np.array(scales, np.float32)
        for mode in ("nearest", "linear"):
            compare_with_ort("Resize", [x, sc], dict(mode=mode), opset=10)
            compare_with_ort("Upsample", [x, sc], dict(mode=mode), opset=9)


def test_resize_integer_nearest(rng):
    x = rng.integers(0, 255, (1, 1, 4, 4), dtype=np.uint8)
    compare_with_ort("Resize", [x, None, np.array([1, 1, 2, 2], np.float32)], dict(mode="nearest"), opset=13)


# -- RNNs ---------------------------------------------------------------------------------------------
def _rnn_inputs(rng, op_type, seq, batch, inp, hidden, dirs, layout, seq_lens, peepholes=False):
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op_type]
    x = randn(rng, *((batch, seq, inp) if layout else (seq, batch, inp)))
    w = randn(rng, dirs, gates * hidden, inp) * 0.5
    r = randn(rng, dirs, gates * hidden, hidden) * 0.5
    b = randn(rng, dirs, 2 * gates * hidden) * 0.5
    lens = rng.integers(1, seq + 1, batch).astype(np.int32) if seq_lens else None
    state_shape = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    h0 = randn(rng, *state_shape)
    inputs = [x, w, r, b, lens, h0]
    if op_type == "LSTM":
        inputs += [randn(rng, *state_shape), randn(rng, dirs, 3 * hidden) if peepholes else None]
    return inputs


RNN_OPTIONS = [
    dict(direction="forward"), dict(direction="reverse"), dict(direction="bidirectional"),
    dict(direction="bidirectional", layout=1), dict(direction="reverse", seq_lens=True),
    dict(direction="bidirectional", seq_lens=True, layout=1), dict(direction="forward", clip=0.7),
]


@pytest.mark.parametrize("op_type", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("options", RNN_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_rnn_matches_onnxruntime(op_type, options, rng):
    options = dict(options)
    layout, seq_lens = options.pop("layout", 0), options.pop("seq_lens", False)
    dirs = 2 if options["direction"] == "bidirectional" else 1
    inputs = _rnn_inputs(rng, op_type, 5, 3, 4, 6, dirs, layout, seq_lens, peepholes=op_type == "LSTM")
    n_out = 3 if op_type == "LSTM" else 2
    if not layout:
        compare_with_ort(op_type, inputs, dict(options, hidden_size=6), opset=14, n_outputs=n_out)
        return
    # onnxruntime has no layout=1: run it on the layout-0 equivalent and transpose its outputs
    as_layout0 = [None if v is None else (v.transpose(1, 0, 2) if k in (0, 5, 6) else v)
                  for k, v in enumerate(inputs)]
    expected = ort_run(op_type, as_layout0, dict(options, hidden_size=6), 14, n_out)
    expected = [expected[0].transpose(2, 0, 1, 3)] + [e.transpose(1, 0, 2) for e in expected[1:]]
    got = make_op(op_type, dict(options, hidden_size=6, layout=1), 14, len(inputs), n_out)(*inputs)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


def test_gru_linear_before_reset_and_activations(rng):
    inputs = _rnn_inputs(rng, "GRU", 4, 2, 3, 5, 2, 0, False)
    attrs = dict(hidden_size=5, direction="bidirectional", linear_before_reset=1,
                 activations=["HardSigmoid", "Tanh", "Sigmoid", "LeakyRelu"], activation_alpha=[0.3, 0.05],
                 activation_beta=[0.4])
    compare_with_ort("GRU", inputs, attrs, opset=14, n_outputs=2)


def test_lstm_input_forget_and_scaled_tanh(rng):
    inputs = _rnn_inputs(rng, "LSTM", 4, 2, 3, 5, 1, 0, False)
    attrs = dict(hidden_size=5, input_forget=1, activations=["Sigmoid", "ScaledTanh", "Tanh"],
                 activation_alpha=[1.5], activation_beta=[0.5])
    compare_with_ort("LSTM", inputs, attrs, opset=14, n_outputs=3)


@pytest.mark.parametrize("seq, batch, bias, states", [(1, 1, True, True), (7, 3, True, False), (4, 2, False, True)])
def test_plain_forward_lstm_in_one_compiled_call_matches_the_reference(seq, batch, bias, states, rng, monkeypatch):
    """Forward, default activations, no peepholes: every step in `compiled.recurrent.lstm_forward`
    (a streaming VAD's LSTM), against onnx's reference, the final states equal to Y's last step."""
    from asyncinfer.ops import rnn

    calls = []
    real = rnn.lstm_forward
    monkeypatch.setattr(rnn, "lstm_forward", lambda *a: calls.append(1) or real(*a))
    hidden, size = 6, 5
    x = randn(rng, seq, batch, size)
    w, r = randn(rng, 1, 4 * hidden, size), randn(rng, 1, 4 * hidden, hidden)
    inputs = [x, w, r, randn(rng, 1, 8 * hidden) if bias else None, None]
    inputs += [randn(rng, 1, batch, hidden), randn(rng, 1, batch, hidden)] if states else [None, None]
    attrs = dict(hidden_size=hidden)
    op = make_op("LSTM", attrs, 14, len(inputs), 3)
    got = op(*inputs)
    want = reference_run("LSTM", inputs, attrs, opset=14, n_outputs=3)
    assert calls == [1]
    for g, e in zip(got, want):
        assert g.shape == e.shape and g.dtype == np.float32
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[0][-1], got[1])
    again = op(*inputs)  # (the transposed weights are kept for constant ones, worked out for these)
    for g, a in zip(got, again):
        np.testing.assert_array_equal(g, a)


def test_rnn_without_optional_inputs(rng):
    x = randn(rng, 3, 2, 4)
    w, r = randn(rng, 1, 6, 4), randn(rng, 1, 6, 6)
    compare_with_ort("RNN", [x, w, r], dict(hidden_size=6), opset=14, n_outputs=2)


# -- dtypes and refusals ---------------------------------------------------------------------------
@pytest.mark.parametrize("op_type, attrs, inputs", [
    ("Conv", dict(pads=[1, 1, 1, 1]), [(1, 3, 6, 6), (4, 3, 3, 3), (4,)]),
    ("ConvTranspose", dict(strides=[2, 2]), [(1, 3, 4, 4), (3, 2, 3, 3)]),
    ("MaxPool", dict(kernel_shape=[2, 2]), [(1, 3, 6, 6)]),
    ("AveragePool", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]), [(1, 3, 6, 6)]),
    ("LRN", dict(size=3), [(1, 5, 4, 4)]),
    ("Gemm", dict(alpha=0.5, beta=2.0), [(3, 4), (4, 5), (5,)]),
    ("Resize", dict(mode="cubic"), [(1, 1, 4, 4), None, np.array([1, 1, 2, 2], np.float32)]),
])
def test_float32_stays_float32(op_type, attrs, inputs, rng):
    arrays = [x if isinstance(x, np.ndarray) or x is None else randn(rng, *x) for x in inputs]
    out = make_op(op_type, attrs, n_inputs=len(arrays))(*arrays)[0]
    assert out.dtype == np.float32


@pytest.mark.parametrize("op_type, attrs, version", [
    ("Conv", dict(auto_pad="SAME_EVERYWHERE"), 11),
    ("Conv", dict(pads=[-1, 0, 0, 0]), 11),
    ("MaxPool", dict(kernel_shape=[2, 2], storage_order=2), 12),
    ("AveragePool", dict(strides=[2, 2]), 19),  # kernel_shape is required
    ("LpNormalization", dict(p=3), 22),
    ("Resize", dict(mode="area"), 19),
    ("Resize", dict(coordinate_transformation_mode="tf_half_pixel_for_nn"), 19),
    ("Resize", dict(mode="cubic"), 10),
    ("LSTM", dict(hidden_size=3, activations=["Sigmoid", "Gelu", "Tanh"]), 14),
    ("GRU", dict(hidden_size=3, direction="sideways"), 14),
    ("LayerNormalization", dict(stash_type=7), 17),
])
def test_unsupported_attributes_are_refused_at_creation(op_type, attrs, version):
    with pytest.raises(UnsupportedOperatorError, match=op_type):
        make_op(op_type, attrs, version=version)


def test_batch_norm_training_outputs_are_refused():
    layer = Layer(name="bn", op_type="BatchNormalization", inputs=["x", "s", "b", "m", "v"],
                  outputs=["y", "running_mean", "running_var"], attrs={}, version=9)
    with pytest.raises(UnsupportedOperatorError):
        ops.create(layer)


def test_registered_versions_cover_every_schema():
    """Every since_version of every op here is implemented (no silent gaps between opsets)."""
    table = ops.registered()
    for op in OPS:
        versions = {s.since_version for s in onnx.defs.get_all_schemas_with_history()
                    if s.name == op and s.domain == ""}
        if op == "Upsample":
            versions -= {1}  # Upsample-1 (experimental height_scale/width_scale) is not implemented
        assert versions <= set(table[("", op)]), (op, versions - set(table[("", op)]))
