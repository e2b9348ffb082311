"""Kernels of asyncinfer/ops/{loss,signal,image}.py.

Every ONNX backend node test case that uses one of these ops runs through the whole engine on every
backend (tests/node_cases.py; ImageDecoder has its own tests in test_image_decoder.py). Targeted tests
compare with onnxruntime on random inputs for what the node cases cover thinly (GridSample's
mode/padding/align grid, NonMaxSuppression on many overlapping boxes, RoiAlign, DFT, Col2Im), check
that inputs are never modified, and that what is not implemented is refused at load time.
"""
from __future__ import annotations


import numpy as np
import onnx
import pytest

from asyncinfer.errors import UnsupportedOperatorError
from node_cases import cases_using, expected_failures_among
from op_testing import compare_with_ort, make_op, randn

pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the reference")

OPS = set("""NegativeLogLikelihoodLoss SoftmaxCrossEntropyLoss DFT STFT HannWindow HammingWindow
    BlackmanWindow MelWeightMatrix GridSample AffineGrid Col2Im CenterCropPad RoiAlign MaxUnpool DeformConv
    NonMaxSuppression Det Scatter CumProd ImageDecoder""".split())


def _own_cases() -> dict[str, object]:
    return cases_using(OPS)


def test_node_case_selection():
    names = _own_cases()
    assert len(names) >= 170
    for op in OPS:
        assert any(op in {n.op_type for n in c.model.graph.node} for c in names.values()), op
    assert not expected_failures_among(names)  # every case passes


# -- GridSample ----------------------------------------------------------------------------------
@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode,opset", [("bilinear", 16), ("nearest", 16), ("bicubic", 16),
                                        ("linear", 20), ("nearest", 20), ("cubic", 20)])
def test_gridsample_2d_matches_onnxruntime(mode, opset, padding, align, rng):
    x = randn(rng, 2, 3, 5, 7)
    grid = rng.uniform(-1.4, 1.4, (2, 4, 6, 2)).astype(np.float32)  # reaches past the borders
    compare_with_ort("GridSample", [x, grid], dict(mode=mode, padding_mode=padding, align_corners=align), opset=opset)


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_gridsample_3d_matches_onnxruntime(mode, padding, align, rng):
    x = randn(rng, 1, 2, 4, 5, 3)
    grid = rng.uniform(-1.3, 1.3, (1, 3, 2, 4, 3)).astype(np.float32)
    compare_with_ort("GridSample", [x, grid], dict(mode=mode, padding_mode=padding, align_corners=align), opset=20)


def test_gridsample_far_reflection_and_integer_data(rng):
    """Positions several image widths away fold back repeatedly; nearest keeps integer data exact."""
    x = rng.integers(-50, 50, (1, 2, 4, 4)).astype(np.int32)
    grid = rng.uniform(-7, 7, (1, 3, 3, 2)).astype(np.float32)
    attrs = dict(mode="nearest", padding_mode="reflection")
    y = make_op("GridSample", attrs, version=20, n_inputs=2)(x, grid)[0]
    assert y.dtype == np.int32
    expected = compare_with_ort("GridSample", [x.astype(np.float32), grid], attrs, opset=20)[0]
    np.testing.assert_array_equal(y, expected.astype(np.int32))


# -- NonMaxSuppression ---------------------------------------------------------------------------
@pytest.mark.parametrize("center", [0, 1])
@pytest.mark.parametrize("iou,score", [(0.5, None), (0.3, 0.2), (0.0, 0.5), (0.7, None)])
def test_nonmaxsuppression_matches_onnxruntime(center, iou, score, rng):
    batches, classes, boxes = 2, 3, 60
    corners = rng.uniform(0, 10, (batches, boxes, 4)).astype(np.float32)  # any corner order
    if center:
        corners[..., 2:] = np.abs(corners[..., 2:]) / 2  # (x_c, y_c, w, h)
    corners[0, 5] = corners[0, 6]  # identical boxes, and one of zero area
    corners[1, 3, 2:] = corners[1, 3, :2] if not center else 0
    scores = rng.uniform(0, 1, (batches, classes, boxes)).astype(np.float32)
    scores[0, 0, 10:14] = 0.75  # ties: the lower index wins
    inputs = [corners, scores, np.array([25], np.int64), np.array([iou], np.float32)]
    inputs += [] if score is None else [np.array([score], np.float32)]
    compare_with_ort("NonMaxSuppression", inputs, dict(center_point_box=center), opset=11)


def test_nonmaxsuppression_without_limit_selects_nothing(rng):
    boxes, scores = rng.uniform(0, 1, (1, 4, 4)).astype(np.float32), rng.uniform(0, 1, (1, 1, 4)).astype(np.float32)
    y = make_op("NonMaxSuppression", version=11, n_inputs=2)(boxes, scores)[0]
    assert y.shape == (0, 3) and y.dtype == np.int64


# -- other ops vs onnxruntime --------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ctm,ratio", [("half_pixel", 0), ("output_half_pixel", 2), ("half_pixel", 3)])
def test_roialign_matches_onnxruntime(mode, ctm, ratio, rng):
    x = randn(rng, 2, 3, 12, 10)
    top_left = rng.uniform(-2, 8, (7, 2))
    rois = np.concatenate([top_left, top_left + rng.uniform(0.2, 7, (7, 2))], axis=1).astype(np.float32)
    batch = rng.integers(0, 2, 7).astype(np.int64)
    attrs = dict(mode=mode, coordinate_transformation_mode=ctm, sampling_ratio=ratio, output_height=3,
                 output_width=4, spatial_scale=0.8)
    compare_with_ort("RoiAlign", [x, rois, batch], attrs, opset=16)


@pytest.mark.parametrize("inverse,onesided,length", [(0, 0, None), (0, 1, 9), (1, 0, 6), (1, 1, None)])
def test_dft_matches_onnxruntime(inverse, onesided, length, rng):
    x = randn(rng, 2, 8, 3, 1 if (onesided and not inverse) else 2)
    inputs = [x, None if length is None else np.array(length, np.int64), np.array(1, np.int64)]
    compare_with_ort("DFT", inputs, dict(inverse=inverse, onesided=onesided), opset=20, rtol=1e-4, atol=1e-4)


def test_col2im_matches_onnxruntime(rng):
    image, block = np.array([9, 8], np.int64), np.array([3, 2], np.int64)
    attrs = dict(strides=[2, 1], dilations=[1, 2], pads=[1, 0, 1, 1])
    blocks = ((9 + 2 - 3) // 2 + 1) * ((8 + 1 - 3) // 1 + 1)
    compare_with_ort("Col2Im", [randn(rng, 2, 2 * 6, blocks), image, block], attrs, opset=18)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_softmax_cross_entropy_matches_onnxruntime(reduction, rng):
    scores, labels = randn(rng, 3, 5, 4, 2), rng.integers(0, 5, (3, 4, 2)).astype(np.int64)
    labels[0, 0, 0] = -1
    attrs = dict(reduction=reduction, ignore_index=-1)
    compare_with_ort("SoftmaxCrossEntropyLoss", [scores, labels, randn(rng, 5)], attrs, opset=13, n_outputs=2)


# -- dtypes, refusals ------------------------------------------------------------------------------
def test_float16_losses_stay_float16(rng):
    x, target = randn(rng, 4, 3, dtype=np.float16), np.array([0, 2, 1, 2], np.int64)
    y = make_op("NegativeLogLikelihoodLoss", version=13, n_inputs=2)(x, target)[0]
    assert y.dtype == np.float16 and y.shape == ()
    np.testing.assert_allclose(y, -x[np.arange(4), target].astype(np.float32).mean(), rtol=1e-3)


@pytest.mark.parametrize("datatype", [onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT32])
def test_window_output_datatype(datatype):
    y = make_op("HannWindow", dict(output_datatype=datatype), version=17)(np.array(8, np.int64))[0]
    assert y.dtype == onnx.helper.tensor_dtype_to_np_dtype(datatype) and y.shape == (8,)


@pytest.mark.parametrize("op_type,attrs,version", [
    ("GridSample", dict(mode="bicubic"), 20),  # the opset-16 name is not valid from 20 on
    ("GridSample", dict(mode="cubic"), 16),
    ("GridSample", dict(padding_mode="wrap"), 20),
    ("NegativeLogLikelihoodLoss", dict(reduction="max"), 13),
    ("SoftmaxCrossEntropyLoss", dict(reduction="median"), 13),
    ("RoiAlign", dict(mode="min"), 16),
    ("RoiAlign", dict(coordinate_transformation_mode="align_corners"), 16),
    ("NonMaxSuppression", dict(center_point_box=2), 11),
    ("HannWindow", dict(output_datatype=onnx.TensorProto.STRING), 17),
    ("Scatter", dict(reduction="add"), 11),
    ("ImageDecoder", dict(pixel_format="CMYK"), 20),
])
def test_unsupported_attributes_are_refused(op_type, attrs, version):
    with pytest.raises(UnsupportedOperatorError, match=op_type):
        make_op(op_type, attrs, version=version)


def test_inputs_not_mutated(rng):
    """Kernels that copy or reshape their input internally leave the caller's arrays alone."""
    checks = [
        ("CumProd", dict(exclusive=1, reverse=1), 26, [randn(rng, 3, 4), np.array(1, np.int64)]),
        ("Scatter", dict(axis=1), 11, [randn(rng, 3, 4), np.array([[1, 0]] * 3, np.int64), randn(rng, 3, 2)]),
        ("MaxUnpool", dict(kernel_shape=[2, 2], strides=[2, 2]), 22,
         [randn(rng, 1, 1, 2, 2), np.array([[[[0, 3], [9, 14]]]], np.int64)]),
        ("CenterCropPad", dict(axes=[0, -1]), 18, [randn(rng, 5, 3, 2), np.array([3, 4], np.int64)]),
        ("SoftmaxCrossEntropyLoss", {}, 13, [randn(rng, 2, 3), np.array([2, 0], np.int64)]),
        ("STFT", {}, 17, [randn(rng, 1, 16, 1), np.array(4, np.int64), randn(rng, 8)]),
        ("DeformConv", dict(pads=[1, 1, 1, 1]), 22,
         [randn(rng, 1, 2, 4, 4), randn(rng, 3, 2, 3, 3), randn(rng, 1, 18, 4, 4), None, randn(rng, 1, 9, 4, 4)]),
    ]
    for op_type, attrs, version, inputs in checks:
        before = [None if x is None else x.copy() for x in inputs]
        make_op(op_type, attrs, version=version, n_inputs=len(inputs))(*inputs)
        for x, b in zip(inputs, before):
            if x is not None:
                np.testing.assert_array_equal(x, b, err_msg=f"{op_type} modified an input")
