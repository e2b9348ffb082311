"""``com.microsoft::QLinearConv`` (asyncinfer/ops/contrib/quantized.py ``MsQLinearConv``): ONNX's
QLinearConv kernel (the same class) with ORT's ``channels_last``.

The oracle is exact integer arithmetic: the int32 accumulator summed in Python integers, and
scales chosen so that ``x_scale * w_scale / y_scale`` is a power of two, which makes the
requantization ``round_half_even(acc * multiplier)`` exact too. ONNX Runtime is the second opinion
(weights kept within ±64 where the u8×s8 product pairs of its non-VNNI path would saturate int16).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import asyncinfer as ai
from asyncinfer import ops
from op_testing import one_node

ort = pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the second opinion")

MS = "com.microsoft"
TYPES = [(np.uint8, np.uint8), (np.uint8, np.int8), (np.int8, np.int8)]


def exact_conv(x, x_zp, w, w_zp, bias, strides, pads, group):
    """The int accumulator of a 2-D grouped convolution of NCHW ``x``, in Python integers."""
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    xs = np.pad(x.astype(np.int64) - int(x_zp), [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])])
    ws = w.astype(np.int64) - np.asarray(w_zp, np.int64).reshape(-1, 1, 1, 1)
    oh = (h + pads[0] + pads[2] - kh) // strides[0] + 1
    ow = (wd + pads[1] + pads[3] - kw) // strides[1] + 1
    acc = np.zeros((n, m, oh, ow), dtype=object)
    for b, o, i, j in itertools.product(range(n), range(m), range(oh), range(ow)):
        g = o // (m // group)
        patch = xs[b, g * cg:(g + 1) * cg, i * strides[0]:i * strides[0] + kh, j * strides[1]:j * strides[1] + kw]
        acc[b, o, i, j] = int((patch * ws[o]).sum()) + (0 if bias is None else int(bias[o]))
    return acc


def requantize(acc, shift_per_channel, y_zp, dtype):
    """``round_half_even(acc / 2**shift) + y_zp``, saturated, exactly."""
    info = np.iinfo(dtype)
    out = np.empty(acc.shape, dtype)
    for index in np.ndindex(acc.shape):
        q = acc[index] / 2 ** shift_per_channel[index[1]]  # exact in binary floating point
        out[index] = min(max(round(q) + int(y_zp), info.min), info.max)  # round(): half to even
    return out


def _case(rng, xt, wt, *, channels_last, group, per_channel, bias, weight_bound=None):
    c, m = 4, 6
    x = rng.integers(np.iinfo(xt).min, np.iinfo(xt).max + 1, (2, c, 5, 6)).astype(xt)
    low, high = (np.iinfo(wt).min, np.iinfo(wt).max + 1) if weight_bound is None else (-weight_bound, weight_bound)
    low = max(low, np.iinfo(wt).min)
    w = rng.integers(low, high, (m, c // group, 3, 3)).astype(wt)
    shifts = rng.integers(3, 8, m) if per_channel else np.full(m, 5)
    x_scale, y_scale = np.float32(0.5), np.float32(4.0)
    w_scale = (np.float32(2.0) ** -(shifts - 3)).astype(np.float32)  # x_scale * w_scale / y_scale = 2**-shift
    if not per_channel:
        w_scale = w_scale[:1].reshape(())
    x_zp, y_zp = xt(3), xt(-5 if xt is np.int8 else 7)
    w_zp = np.zeros(m if per_channel else (), wt)
    b = rng.integers(-3000, 3000, m).astype(np.int32) if bias else None
    attrs = dict(group=group, pads=[1, 0, 1, 2], strides=[1, 2], channels_last=int(channels_last))
    feed = np.ascontiguousarray(np.moveaxis(x, 1, -1)) if channels_last else x
    model, feeds = one_node("QLinearConv", [feed, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, b], attrs,
                            opset=13, domain=MS, constants=range(1, 9))
    acc = exact_conv(x, x_zp, w, w_zp, b, [1, 2], [1, 0, 1, 2], group)
    expected = requantize(acc, shifts, y_zp, xt)
    return model, feeds, (np.ascontiguousarray(np.moveaxis(expected, 1, -1)) if channels_last else expected)


def run_ours(model, feeds):
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        return worker.run_blocking(feeds)["o0"]


def run_ort(model, feeds):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("xt, wt", TYPES)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("group, per_channel, bias", [(1, False, True), (2, True, True), (1, True, False)])
def test_equals_exact_integer_arithmetic_and_onnxruntime(xt, wt, channels_last, group, per_channel, bias):
    rng = np.random.default_rng(hash((xt, wt, channels_last, group, per_channel, bias)) % 2 ** 32)
    bound = 64 if (xt, wt) == (np.uint8, np.int8) else None
    model, feeds, expected = _case(rng, xt, wt, channels_last=channels_last, group=group, per_channel=per_channel,
                                   bias=bias, weight_bound=bound)
    got = run_ours(model, feeds)
    assert got.dtype == np.dtype(xt) and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, run_ort(model, feeds))


def test_full_range_weights_still_equal_exact_arithmetic():
    rng = np.random.default_rng(11)
    model, feeds, expected = _case(rng, np.uint8, np.int8, channels_last=True, group=2, per_channel=True, bias=True)
    np.testing.assert_array_equal(run_ours(model, feeds), expected)


def test_it_is_the_onnx_domain_kernel():
    from asyncinfer.ops.quantize import QLinearConv

    cls = ops.lookup("QLinearConv", 1, MS)
    assert issubclass(cls, QLinearConv) and cls.run is not QLinearConv.run  # only the layout is its own
    assert "convolve" not in vars(cls) and "accumulate" not in vars(cls)


def test_channels_last_on_a_low_rank_input_and_a_bad_attribute_are_errors():
    rng = np.random.default_rng(3)
    model, feeds, _ = _case(rng, np.uint8, np.uint8, channels_last=True, group=1, per_channel=False, bias=False)
    feeds = {"i0": feeds["i0"][0, 0]}
    model.graph.input[0].type.tensor_type.shape.ClearField("dim")
    for size in feeds["i0"].shape:
        model.graph.input[0].type.tensor_type.shape.dim.add().dim_value = size
    with ai.Worker(ai.load_model(model), "cpu") as worker, pytest.raises(ai.ExecutionError, match="rank >= 3"):
        worker.run_blocking(feeds)
    bad, _, _ = _case(rng, np.uint8, np.uint8, channels_last=False, group=1, per_channel=False, bias=False)
    next(a for a in bad.graph.node[0].attribute if a.name == "channels_last").i = 2
    with pytest.raises(ai.UnsupportedOperatorError, match="channels_last"):
        ai.load_model(bad)


def test_a_model_optimized_by_onnxruntime_into_nhwc(tmp_path):
    """quantize_static (QOperator, per channel) then ORT's offline optimization at ORT_ENABLE_ALL,
    whose NHWC transformer writes com.microsoft QLinearConv with channels_last=1: the model loads
    and agrees with ORT (quantized outputs within 2 steps, as the other ORT-tool models)."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    from .test_quantized import _compare_with_ort, _RandomImages, _small_cnn

    onnx.save(_small_cnn(), tmp_path / "cnn.onnx")
    quantize_static(str(tmp_path / "cnn.onnx"), str(tmp_path / "q.onnx"), _RandomImages("input", (1, 3, 32, 32)),
                    quant_format=QuantFormat.QOperator, per_channel=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, reduce_range=True)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "nhwc.onnx")
    ort.InferenceSession(str(tmp_path / "q.onnx"), options, providers=["CPUExecutionProvider"])
    model = onnx.load(tmp_path / "nhwc.onnx")
    convs = [n for n in model.graph.node if n.domain == MS and n.op_type == "QLinearConv"]
    assert convs and all(any(a.name == "channels_last" and a.i == 1 for a in n.attribute) for n in convs)
    x = np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)
    _compare_with_ort(model, {"input": x})
