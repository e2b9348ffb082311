"""The quantized ops of the ``com.microsoft`` domain (asyncinfer/ops/contrib/quantized.py).

Oracles, in order of authority:

- the definition, written here in NumPy: linear ops (QLinearAdd/Mul, the pools, Concat,
  LeakyRelu) against *exact* rational arithmetic (``fractions.Fraction``, rounding half to even,
  saturation); transcendental ones (Sigmoid, Softmax) in float64; the integer matmuls with exact
  int64 accumulation and ORT's float32 requantization; the float ops (QAttention,
  QEmbedLayerNormalization, MatMulNBits) in float64. Integer outputs must equal it exactly.
- ONNX Runtime on the same one-node models, as a second opinion: integer outputs within one
  quantization step (its kernels round in other orders, use lookup tables, and its u8×s8 GEMMs
  may saturate on CPUs without VNNI, so int8 weights stay within ±63 where ORT is compared),
  float outputs within 1e-2 relative.
- Real models made by ORT's own tools (quantize_static in QOperator format per tensor and per
  channel, quantize_dynamic and ORT's offline optimization, MatMulNBitsQuantizer) load, contain
  these ops, and agree with ORT: quantized outputs within 2 quantization steps, float outputs
  within 1e-2 relative; the gpu_pixel backend runs them too (these layers on the CPU).
"""
from __future__ import annotations

import collections
import math
from fractions import Fraction

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
from asyncinfer import ops
from asyncinfer.errors import ExecutionError, UnsupportedOperatorError
from asyncinfer.model.ir import Layer
from asyncinfer.ops.schema import attribute_defaults
from op_testing import one_node
from pixel_testing import require_pixel

ort = pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the second opinion")

MS = "com.microsoft"
QOPERATOR_OPS = {"QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool", "QLinearAveragePool", "QLinearConcat",
                 "QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax", "QGemm"}
ALL_OPS = QOPERATOR_OPS | {"DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention", "QEmbedLayerNormalization",
                           "MatMulNBits"}


# -- models and runners ------------------------------------------------------------------------------------
def ms_model(op_type: str, inputs: list, attrs: dict | None = None, n_outputs: int = 1,
             constants: frozenset[int] = frozenset()) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A one-node com.microsoft model (ONNX opset 17) and its feeds; inputs whose index is in
    ``constants`` become initializers, ``None`` is an omitted optional input."""
    return one_node(op_type, inputs, attrs, 17, n_outputs, domain=MS, constants=constants)


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_ours(model: onnx.ModelProto, feeds: dict[str, np.ndarray], backend: str = "cpu") -> list[np.ndarray]:
    loaded = ai.load_model(model.SerializeToString())
    with ai.Worker(loaded, backend, threads=1) as worker:
        got = worker.run_blocking(feeds)
    return [got[o.name] for o in model.graph.output]


def both(op_type: str, inputs: list, attrs: dict | None = None, n_outputs: int = 1,
         constants: frozenset[int] = frozenset()) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(ours through the engine on the CPU, ORT) for a one-node model."""
    model, feeds = ms_model(op_type, inputs, attrs, n_outputs, constants)
    return run_ours(model, feeds), run_ort(model, feeds)


def ms_op(op_type: str, attrs: dict | None = None, n_inputs: int = 5, n_outputs: int = 1):
    layer = Layer(name="layer", op_type=op_type, inputs=[f"i{k}" for k in range(n_inputs)],
                  outputs=[f"o{k}" for k in range(n_outputs)], attrs=dict(attrs or {}), domain=MS, version=1)
    return ops.create(layer)


def assert_within_steps(got: np.ndarray, expected: np.ndarray, steps: int) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.dtype,
                                                                        expected.shape)
    diff = np.abs(got.astype(np.int64) - expected.astype(np.int64))
    assert diff.max(initial=0) <= steps, f"{np.count_nonzero(diff > steps)} values differ by more than {steps}"


def assert_relative(got: np.ndarray, expected: np.ndarray, rel: float = 1e-2) -> None:
    """max |got - expected| <= rel * max |expected| (the scale of the output)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    err = np.abs(got.astype(np.float64) - expected.astype(np.float64)).max(initial=0)
    assert err <= rel * max(np.abs(expected).max(initial=0), 1e-6), (err, np.abs(expected).max(initial=0))


# -- the definition ------------------------------------------------------------------------------------
def q8(rng, dtype, *shape, low=None, high=None) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min if low is None else low, (info.max if high is None else high) + 1,
                        shape).astype(dtype)


def f32(v: float) -> np.ndarray:
    return np.array(v, np.float32)


def frac(v) -> Fraction:
    """The exact value of a float32 number."""
    return Fraction(float(np.float32(v)))


def exact_quantize(values, scale, zp, dtype) -> np.ndarray:
    """saturate(round_half_even(v / scale) + zp) of exact rationals ``values`` (any iterable)."""
    info, s = np.iinfo(dtype), frac(scale)
    out = [min(max(round(v / s) + int(zp), int(info.min)), int(info.max)) for v in values]
    return np.array(out, dtype=np.int64).astype(dtype)


def real(x: np.ndarray, scale, zp) -> list[Fraction]:
    """Exact dequantized values of ``x`` (flattened)."""
    s = frac(scale)
    return [(int(v) - int(zp)) * s for v in x.ravel()]


def float_quantize(v: np.ndarray, scale, zp, dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.clip(np.rint(v / np.float64(np.float32(scale))) + int(zp), info.min, info.max).astype(dtype)


# -- registry --------------------------------------------------------------------------------------------
def test_every_op_is_registered_with_its_defaults():
    table = ops.registered()
    for op_type in ALL_OPS:
        assert table[(MS, op_type)] == [1], op_type
    assert attribute_defaults("QLinearLeakyRelu", 1, MS)["alpha"] == pytest.approx(0.01)
    assert dict(attribute_defaults("QGemm", 1, MS)) == {"alpha": 1.0, "transA": 0, "transB": 0}
    assert attribute_defaults("MatMulNBits", 1, MS)["bits"] == 4
    assert attribute_defaults("QLinearAveragePool", 1, MS)["count_include_pad"] == 0


# -- element-wise ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("op_type", ["QLinearAdd", "QLinearMul"])
def test_binary_equals_exact_arithmetic(op_type, dtype):
    rng = np.random.default_rng(1)
    a, b = q8(rng, dtype, 2, 3, 16, 16), q8(rng, dtype, 3, 1, 16)  # broadcasting
    zps = [q8(rng, dtype, 1)[0] for _ in range(3)]
    sa, sb, sc = f32(0.031), f32(0.047), f32(0.09 if op_type == "QLinearAdd" else 0.37)
    [got], [theirs] = both(op_type, [a, sa, zps[0], b, sb, zps[1], sc, zps[2]])
    ab = np.broadcast_arrays(a, b)
    ra, rb = real(ab[0], sa, zps[0]), real(ab[1], sb, zps[1])
    values = [x + y for x, y in zip(ra, rb)] if op_type == "QLinearAdd" else [x * y for x, y in zip(ra, rb)]
    expected = exact_quantize(values, sc, zps[2], dtype).reshape(ab[0].shape)
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == np.dtype(dtype)
    assert_within_steps(got, theirs, 1)


def test_binary_rounds_half_to_even_and_saturates():
    a = np.array([1, 3, 5, 7, 250, 0], np.uint8)
    b = np.array([0, 0, 0, 0, 250, 0], np.uint8)
    [got], _ = both("QLinearAdd", [a, f32(1), np.uint8(0), b, f32(1), np.uint8(0), f32(2), np.uint8(0)])
    np.testing.assert_array_equal(got, [0, 2, 2, 4, 250, 0])  # 0.5, 1.5, 2.5, 3.5 → even; 500/2 = 250
    [got] = run_ours(*ms_model("QLinearMul", [a, f32(1), None, b, f32(1), None, f32(1)]))  # omitted zero points
    np.testing.assert_array_equal(got, [0, 0, 0, 0, 255, 0])  # 62500 saturates
    signed = np.array([-128, 127], np.int8)
    [got], _ = both("QLinearAdd", [signed, f32(1), np.int8(0), signed, f32(1), np.int8(0), f32(1), np.int8(0)])
    np.testing.assert_array_equal(got, [-128, 127])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_sigmoid_and_leaky_relu_every_code(dtype):
    x = np.arange(256, dtype=np.uint8).view(dtype).reshape(16, 16)
    zx, zy = (np.uint8(120), np.uint8(3)) if dtype == np.uint8 else (np.int8(-5), np.int8(-128))
    sx, sy = f32(0.05), f32(1 / 256)
    [got], [theirs] = both("QLinearSigmoid", [x, sx, zx, sy, zy])
    v = (x.astype(np.int64) - int(zx)) * np.float64(sx)
    np.testing.assert_array_equal(got, float_quantize(1 / (1 + np.exp(-v)), sy, zy, dtype))
    assert_within_steps(got, theirs, 1)

    alpha = 0.125
    [got], [theirs] = both("QLinearLeakyRelu", [x, sx, zx, f32(0.04), zy], {"alpha": alpha})
    values = [v * frac(alpha) if v < 0 else v for v in real(x, sx, zx)]
    np.testing.assert_array_equal(got, exact_quantize(values, f32(0.04), zy, dtype).reshape(x.shape))
    assert_within_steps(got, theirs, 1)
    [default], _ = both("QLinearLeakyRelu", [x, sx, zx, f32(0.04), zy])  # alpha defaults to 0.01
    values = [v * frac(0.01) if v < 0 else v for v in real(x, sx, zx)]
    np.testing.assert_array_equal(default, exact_quantize(values, f32(0.04), zy, dtype).reshape(x.shape))


def _softmax_reference(x: np.ndarray, sx, axis: int, opset: int, sy, zy, dtype) -> np.ndarray:
    v = x.astype(np.float64) * np.float64(sx)  # the input zero point cancels out
    shape = x.shape
    if opset < 13:
        v = v.reshape(math.prod(shape[:axis]), -1)
        axis = 1
    e = np.exp(v - v.max(axis=axis, keepdims=True))
    return float_quantize((e / e.sum(axis=axis, keepdims=True)).reshape(shape), sy, zy, dtype)


@pytest.mark.parametrize("opset,axis", [(12, None), (12, 2), (13, None), (13, 1)])
def test_softmax_follows_the_opset_attribute(opset, axis):
    rng = np.random.default_rng(2)
    x = q8(rng, np.uint8, 2, 3, 7)
    attrs = {"opset": opset} | ({} if axis is None else {"axis": axis})
    sx, sy, zy = f32(0.08), f32(1 / 256), np.uint8(0)
    [got], [theirs] = both("QLinearSoftmax", [x, sx, np.uint8(100), sy, zy], attrs)
    default_axis = 1 if opset < 13 else 2
    np.testing.assert_array_equal(got, _softmax_reference(x, sx, default_axis if axis is None else axis, opset,
                                                          sy, zy, np.uint8))
    if opset >= 13 or axis is not None:  # ORT takes its schema's default axis (-1) whatever the opset
        assert_within_steps(got, theirs, 1)
    # int8 with ORT quantizer's output parameters; a probability near 1 saturates at 127 (ORT wraps
    # there, so it is compared with the definition only)
    xs = q8(rng, np.int8, 2, 3, 7)
    [got] = run_ours(*ms_model("QLinearSoftmax", [xs, sx, np.int8(3), sy, np.int8(-128)], attrs))
    np.testing.assert_array_equal(got, _softmax_reference(xs, sx, default_axis if axis is None else axis, opset,
                                                          sy, np.int8(-128), np.int8))


# -- pools and concat ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("channels_last", [0, 1])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_global_average_pool(dtype, channels_last):
    rng = np.random.default_rng(3)
    x = q8(rng, dtype, 2, 5, 6, 4) if not channels_last else q8(rng, dtype, 2, 6, 4, 5)
    zx, zy = q8(rng, dtype, 1)[0], q8(rng, dtype, 1)[0]
    sx, sy = f32(0.02), f32(0.013)
    [got], [theirs] = both("QLinearGlobalAveragePool", [x, sx, zx, sy, zy], {"channels_last": channels_last})
    axes = (1, 2) if channels_last else (2, 3)
    sums = x.astype(np.int64).sum(axis=axes) - 24 * int(zx)
    expected = exact_quantize([Fraction(int(s)) * frac(sx) / 24 for s in sums.ravel()], sy, zy, dtype)
    expected = expected.reshape((2, 1, 1, 5) if channels_last else (2, 5, 1, 1))
    np.testing.assert_array_equal(got, expected)
    assert_within_steps(got, theirs, 1)


def _average_pool_reference(x, kernel, strides, pads, count_include_pad, ceil_mode, sx, zx, sy, zy):
    """Exact AveragePool of the dequantized NCHW ``x`` by windows, then quantized."""
    n, c, h, w = x.shape
    out_shape = []
    for size, k, s, p0, p1 in zip((h, w), kernel, strides, pads[:2], pads[2:]):
        room = size + p0 + p1 - k
        out_shape.append((-(-room // s) if ceil_mode else room // s) + 1)
    values = []
    for idx in np.ndindex(n, c, *out_shape):
        b, ch, oy, ox = idx
        total, count = Fraction(0), 0
        for ky in range(kernel[0]):
            for kx in range(kernel[1]):
                y, xx = oy * strides[0] - pads[0] + ky, ox * strides[1] - pads[1] + kx
                inside = 0 <= y < h and 0 <= xx < w
                in_pads = -pads[0] <= y < h + pads[2] and -pads[1] <= xx < w + pads[3]
                if inside:
                    total += int(x[b, ch, y, xx]) - int(zx)
                if inside or (count_include_pad and in_pads):
                    count += 1
        values.append(total * frac(sx) / count)
    return exact_quantize(values, sy, zy, x.dtype).reshape((n, c, *out_shape))


@pytest.mark.parametrize("attrs", [
    dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
    dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
    dict(kernel_shape=[2, 3], strides=[2, 2], pads=[0, 1, 1, 0], ceil_mode=1),
    dict(kernel_shape=[3, 3], strides=[2, 2], channels_last=1),
])
def test_average_pool(attrs):
    rng = np.random.default_rng(4)
    x = q8(rng, np.uint8, 1, 3, 7, 8)
    sx, zx, sy, zy = f32(0.03), np.uint8(128), f32(0.02), np.uint8(120)
    nhwc = attrs.get("channels_last", 0)
    feed = np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if nhwc else x
    [got], [theirs] = both("QLinearAveragePool", [feed, sx, zx, sy, zy], attrs)
    expected = _average_pool_reference(x, attrs["kernel_shape"], attrs.get("strides", [1, 1]),
                                       attrs.get("pads", [0, 0, 0, 0]), attrs.get("count_include_pad", 0),
                                       attrs.get("ceil_mode", 0), sx, zx, sy, zy)
    if nhwc:
        expected = expected.transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(got, expected)
    assert_within_steps(got, theirs, 1)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_concat_requantizes_each_input(dtype):
    rng = np.random.default_rng(5)
    sy, zy = f32(0.05), q8(rng, dtype, 1)[0]
    parts = [(q8(rng, dtype, 2, 3, 4), f32(0.02), q8(rng, dtype, 1)[0]),
             (q8(rng, dtype, 2, 1, 4), sy, zy),  # already in the output's parameters: copied
             (q8(rng, dtype, 2, 2, 4), f32(0.11), q8(rng, dtype, 1)[0])]
    inputs = [sy, zy] + [v for triple in parts for v in triple]
    [got], [theirs] = both("QLinearConcat", inputs, {"axis": -2})
    expected = np.concatenate([exact_quantize(real(x, s, z), sy, zy, dtype).reshape(x.shape) for x, s, z in parts],
                              axis=1)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[:, 3:4], parts[1][0])
    assert_within_steps(got, theirs, 1)


# -- integer matmuls -----------------------------------------------------------------------------------------
def _requantize_reference(acc: np.ndarray, multiplier: np.ndarray, zp, dtype) -> np.ndarray:
    """ORT's requantization: round_half_even(float32(acc) * multiplier) + zp, saturated."""
    info = np.iinfo(dtype)
    y = np.rint(acc.astype(np.float32) * multiplier.astype(np.float32)).astype(np.int64) + int(zp)
    return np.clip(y, info.min, info.max).astype(dtype)


@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("trans", [(0, 0), (1, 1)])
@pytest.mark.parametrize("quantized_output", [True, False])
def test_qgemm(per_column, trans, quantized_output):
    rng = np.random.default_rng(6)
    m, k, n = 5, 40, 7
    a, b = q8(rng, np.uint8, m, k), q8(rng, np.int8, k, n, low=-63, high=63)  # ±63: ORT's u8×s8 cannot saturate
    a_zp, alpha = np.uint8(130), 0.75
    b_scale = (rng.uniform(0.01, 0.03, n) if per_column else rng.uniform(0.01, 0.03, ())).astype(np.float32)
    b_zp = np.zeros(b_scale.shape, np.int8)
    if per_column:
        b_zp[:] = rng.integers(-3, 4, n)
    c = rng.integers(-2000, 2000, (n,)).astype(np.int32)
    y_scale, y_zp = f32(0.2), np.uint8(125)
    a_in = np.ascontiguousarray(a.T) if trans[0] else a
    b_in = np.ascontiguousarray(b.T) if trans[1] else b
    inputs = [a_in, f32(0.02), a_zp, b_in, b_scale, b_zp, c] + ([y_scale, y_zp] if quantized_output else [])
    [got], [theirs] = both("QGemm", inputs, {"alpha": alpha, "transA": trans[0], "transB": trans[1]},
                           constants=frozenset({3, 4, 5, 6}))
    acc = (a.astype(np.int64) - int(a_zp)) @ (b.astype(np.int64) - b_zp.astype(np.int64)) + c
    scale = np.float32(alpha) * f32(0.02) * b_scale
    if quantized_output:
        np.testing.assert_array_equal(got, _requantize_reference(acc, scale / y_scale, y_zp, np.uint8))
        assert_within_steps(got, theirs, 1)
    else:
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, acc.astype(np.float32) * scale, rtol=1e-6)
        assert_relative(got, theirs)


def test_qgemm_signed_activations_and_no_bias():
    rng = np.random.default_rng(7)
    a, b = q8(rng, np.int8, 4, 9), q8(rng, np.int8, 9, 3)
    [got] = run_ours(*ms_model("QGemm", [a, f32(0.1), np.int8(-2), b, f32(0.05), np.int8(0), None, f32(0.3),
                                         np.int8(1)]))
    acc = (a.astype(np.int64) + 2) @ b.astype(np.int64)
    np.testing.assert_array_equal(got, _requantize_reference(acc, f32(0.1) * f32(0.05) / f32(0.3), 1, np.int8))


@pytest.mark.parametrize("a_type,b_type", [(np.uint8, np.int8), (np.uint8, np.uint8), (np.int8, np.int8)])
@pytest.mark.parametrize("per_column", [False, True])
def test_matmul_integer_to_float(a_type, b_type, per_column):
    rng = np.random.default_rng(8)
    a = q8(rng, a_type, 2, 3, 24)
    b = q8(rng, b_type, 24, 6, low=-63 if b_type == np.int8 else None, high=63 if b_type == np.int8 else None)
    a_scale, a_zp = f32(0.015), q8(rng, a_type, 1)[0]
    b_scale = rng.uniform(0.01, 0.02, 6 if per_column else ()).astype(np.float32)
    b_zp = q8(rng, b_type, *((6,) if per_column else ()), low=-4 if b_type == np.int8 else 120,
              high=4 if b_type == np.int8 else 130)
    bias = rng.standard_normal(6).astype(np.float32)
    [got], [theirs] = both("MatMulIntegerToFloat", [a, b, a_scale, b_scale, a_zp, b_zp, bias],
                           constants=frozenset({1, 3, 5, 6}))
    acc = (a.astype(np.int64) - int(a_zp)) @ (b.astype(np.int64) - b_zp.astype(np.int64))
    np.testing.assert_allclose(got, acc * (np.float64(a_scale) * b_scale.astype(np.float64)) + bias, rtol=1e-5,
                               atol=1e-5)
    assert got.dtype == np.float32
    assert_relative(got, theirs, 1e-5)


def test_matmul_integer_to_float_half_scales():
    rng = np.random.default_rng(9)
    a, b = q8(rng, np.uint8, 3, 8), q8(rng, np.uint8, 8, 2)
    [got] = run_ours(*ms_model("MatMulIntegerToFloat", [a, b, np.float16(0.01), np.float16(0.02)]))
    assert got.dtype == np.float16
    expected = (a.astype(np.int64) @ b.astype(np.int64)) * (np.float64(np.float16(0.01)) * np.float64(np.float16(0.02)))
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=2e-3)


def _dynamic_quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.float32, int]:
    """ONNX DynamicQuantizeLinear: uint8, range extended to 0, scale (max - min) / 255."""
    lo, hi = np.float32(min(0.0, x.min())), np.float32(max(0.0, x.max()))
    scale = np.float32((hi - lo) / np.float32(255))
    zp = int(np.clip(np.rint(-lo / scale), 0, 255))
    return np.clip(np.rint(x / scale) + zp, 0, 255).astype(np.uint8), scale, zp


@pytest.mark.parametrize("b_type", [np.int8, np.uint8])
def test_dynamic_quantize_matmul(b_type):
    rng = np.random.default_rng(10)
    a = rng.standard_normal((2, 5, 32)).astype(np.float32)
    b = q8(rng, b_type, 32, 8, low=-63 if b_type == np.int8 else None, high=63 if b_type == np.int8 else None)
    b_scale = rng.uniform(0.01, 0.02, 8).astype(np.float32)
    b_zp = np.zeros(8, b_type) if b_type == np.int8 else q8(rng, np.uint8, 8, low=120, high=130)
    bias = rng.standard_normal(8).astype(np.float32)
    [got], [theirs] = both("DynamicQuantizeMatMul", [a, b, b_scale, b_zp, bias], constants=frozenset({1, 2, 3, 4}))
    a_q, a_scale, a_zp = _dynamic_quantize_reference(a)
    acc = (a_q.astype(np.int64) - a_zp) @ (b.astype(np.int64) - b_zp.astype(np.int64))
    np.testing.assert_allclose(got, acc * (np.float64(a_scale) * b_scale) + bias, rtol=1e-5, atol=1e-5)
    assert_relative(got, theirs, 1e-5)


# -- quantized BERT fusions ----------------------------------------------------------------------------------
def _attention_reference(x, w, bias, heads, lengths=None, past=None, unidirectional=False):
    """Self-attention in float64: projections, heads, 1/sqrt(d) scores, keys past each row's length
    get -10000, softmax, times V; returns (output, present)."""
    batch, seq, _ = x.shape
    hidden = w.shape[1] // 3
    d = hidden // heads
    qkv = x @ w + bias
    q, k, v = (qkv[..., i * hidden:(i + 1) * hidden].reshape(batch, seq, heads, d).transpose(0, 2, 1, 3)
               for i in range(3))
    if past is not None:
        k, v = np.concatenate([past[0], k], axis=2), np.concatenate([past[1], v], axis=2)
    total = k.shape[2]
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
    if lengths is not None:
        keep = np.arange(total)[None, :] < lengths[:, None]
        scores = scores + np.where(keep, 0.0, -10000.0)[:, None, None, :]
    if unidirectional:
        offset = total - seq
        causal = np.arange(total)[None, :] <= (np.arange(seq)[:, None] + offset)
        scores = scores + np.where(causal, 0.0, -10000.0)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    out = (e / e.sum(-1, keepdims=True)) @ v
    return out.transpose(0, 2, 1, 3).reshape(batch, seq, hidden), np.stack([k, v])


@pytest.mark.parametrize("weight_type", [np.int8, np.uint8])
@pytest.mark.parametrize("per_column", [False, True])
def test_qattention(weight_type, per_column):
    rng = np.random.default_rng(11)
    batch, seq, din, hidden, heads = 2, 5, 24, 16, 2
    x = q8(rng, np.uint8, batch, seq, din)
    w = q8(rng, weight_type, din, 3 * hidden, low=-63 if weight_type == np.int8 else None,
           high=63 if weight_type == np.int8 else None)
    bias = (rng.standard_normal(3 * hidden) * 0.1).astype(np.float32)
    x_scale, x_zp = f32(0.02), np.uint8(128)
    w_scale = rng.uniform(0.005, 0.01, 3 * hidden if per_column else ()).astype(np.float32)
    w_zp = q8(rng, weight_type, *((3 * hidden,) if per_column else ()),
              low=-3 if weight_type == np.int8 else 125, high=3 if weight_type == np.int8 else 131)
    lengths = np.array([5, 3], np.int32)
    inputs = [x, w, bias, x_scale, w_scale, lengths, x_zp, w_zp]
    [got], [theirs] = both("QAttention", inputs, {"num_heads": heads}, constants=frozenset({1, 2, 4, 7}))
    real_x = (x.astype(np.float64) - int(x_zp)) * np.float64(x_scale)
    real_w = (w.astype(np.float64) - w_zp.astype(np.float64)) * w_scale.astype(np.float64)
    expected, _ = _attention_reference(real_x, real_w, bias.astype(np.float64), heads, lengths)
    assert got.dtype == np.float32 and got.shape == (batch, seq, hidden)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert_relative(got, theirs)


def test_qattention_with_past_and_unidirectional():
    rng = np.random.default_rng(12)
    batch, seq, din, hidden, heads, past_len = 1, 3, 16, 8, 2, 4
    x, w = q8(rng, np.uint8, batch, seq, din), q8(rng, np.int8, din, 3 * hidden, low=-63, high=63)
    bias = (rng.standard_normal(3 * hidden) * 0.1).astype(np.float32)
    past = rng.standard_normal((2, batch, heads, past_len, hidden // heads)).astype(np.float32)
    inputs = [x, w, bias, f32(0.03), f32(0.01), None, np.uint8(120), np.int8(0), past]
    got, theirs = both("QAttention", inputs, {"num_heads": heads, "unidirectional": 1}, n_outputs=2,
                       constants=frozenset({1, 2, 4, 7}))
    real_x = (x.astype(np.float64) - 120) * np.float64(f32(0.03))
    real_w = w.astype(np.float64) * np.float64(f32(0.01))
    expected, present = _attention_reference(real_x, real_w, bias.astype(np.float64), heads, past=past,
                                             unidirectional=True)
    np.testing.assert_allclose(got[0], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], present, rtol=1e-4, atol=1e-5)
    assert got[1].shape == (2, batch, heads, past_len + seq, hidden // heads)
    for g, t in zip(got, theirs):
        assert_relative(g, t)


@pytest.mark.parametrize("with_segment", [True, False])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_qembed_layer_normalization(with_segment, dtype):
    rng = np.random.default_rng(13)
    batch, seq, hidden, vocab = 2, 6, 16, 30
    ids = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    segments = rng.integers(0, 2, (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), np.int32)
    mask[1, 4:] = 0
    tables = {"word": q8(rng, dtype, vocab, hidden), "pos": q8(rng, dtype, 16, hidden), "seg": q8(rng, dtype, 2, hidden),
              "gamma": q8(rng, dtype, hidden), "beta": q8(rng, dtype, hidden)}
    params = {name: (f32(rng.uniform(0.002, 0.01)), q8(rng, dtype, 1)[0]) for name in tables}
    order = ["word", "pos", "seg", "gamma", "beta"]
    use = [n for n in order if with_segment or n != "seg"]

    def opt(name, value):
        return value if name in use else None

    inputs = ([ids, segments if with_segment else None] + [opt(n, tables[n]) for n in order] + [mask]
              + [opt(n, params[n][0]) for n in order] + [opt(n, params[n][1]) for n in order])
    got, theirs = both("QEmbedLayerNormalization", inputs, {"epsilon": 1e-5}, n_outputs=2,
                       constants=frozenset(range(2, 18)))
    deq = {n: (tables[n].astype(np.float64) - int(params[n][1])) * np.float64(params[n][0]) for n in use}
    total = deq["word"][ids] + deq["pos"][np.arange(seq)][None]
    if with_segment:
        total = total + deq["seg"][segments]
    mean, var = total.mean(-1, keepdims=True), total.var(-1, keepdims=True)
    expected = (total - mean) / np.sqrt(var + 1e-5) * deq["gamma"] + deq["beta"]
    np.testing.assert_allclose(got[0], expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[1], np.array([6, 4], np.int32))
    assert_relative(got[0], theirs[0])
    np.testing.assert_array_equal(got[1], theirs[1])


# -- MatMulNBits -------------------------------------------------------------------------------------------
def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``bits``-wide values along the last axis into bytes, first value in the low bits."""
    per_byte = 8 // bits
    padded = np.zeros(values.shape[:-1] + (-(-values.shape[-1] // per_byte) * per_byte,), np.uint8)
    padded[..., :values.shape[-1]] = values
    grouped = padded.reshape(values.shape[:-1] + (-1, per_byte)).astype(np.uint16)
    return sum(grouped[..., i] << (i * bits) for i in range(per_byte)).astype(np.uint8)


def _unpacked(b: np.ndarray, bits: int, k: int) -> np.ndarray:
    """The (N, K) quantized values of a packed (N, blocks, blob) weight, as float64."""
    per_byte = 8 // bits
    flat = b.reshape(b.shape[0], -1)
    values = np.stack([(flat >> (i * bits)) & ((1 << bits) - 1) for i in range(per_byte)], axis=-1)
    return values.reshape(b.shape[0], -1)[:, :k].astype(np.float64)


def nbits_case(rng, n: int, k: int, bits: int, block: int, zero_points: str, g_idx: bool = False,
               scale_type=np.float32):
    """Random quantized weights (N, K) with their packed inputs and the dequantized weight (float64)."""
    blocks = -(-k // block)
    q = rng.integers(0, 1 << bits, (n, blocks * block)).astype(np.uint8)
    q[:, k:] = 0
    scales = rng.uniform(0.01, 0.05, (n, blocks)).astype(scale_type)
    group = rng.permutation(np.arange(k) // block) if g_idx else np.arange(k) // block
    if zero_points == "packed":
        zp = rng.integers(0, 1 << bits, (n, blocks)).astype(np.uint8)
        zp_input, zp_values = pack_bits(zp, bits), zp.astype(np.float64)
    elif zero_points == "float":
        zp_values = rng.uniform(0, (1 << bits) - 1, (n, blocks)).astype(np.float32)
        zp_input, zp_values = zp_values, zp_values.astype(np.float64)
    else:
        zp_input, zp_values = None, np.full((n, blocks), 1 << (bits - 1), np.float64)
    weight = (q[:, :k].astype(np.float64) - zp_values[:, group]) * scales[:, group].astype(np.float64)
    b = pack_bits(q.reshape(n, blocks, block), bits)
    return b, scales, zp_input, (group.astype(np.int32) if g_idx else None), weight


@pytest.mark.parametrize("bits,block,k,zero_points", [
    (4, 32, 64, "packed"), (4, 16, 40, "none"), (4, 32, 96, "float"), (8, 32, 64, "packed"), (8, 16, 50, "none"),
    (2, 16, 48, "packed"),
])
def test_matmul_nbits(bits, block, k, zero_points):
    rng = np.random.default_rng(bits * 1000 + block + k)
    n = 12
    b, scales, zp, _, weight = nbits_case(rng, n, k, bits, block, zero_points)
    a = rng.standard_normal((2, 3, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
    [got], [theirs] = both("MatMulNBits", [a, b, scales, zp, None, bias], attrs, constants=frozenset({1, 2, 3, 5}))
    expected = a.astype(np.float64) @ weight.T + bias
    assert got.dtype == np.float32 and got.shape == (2, 3, n)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert_relative(got, theirs)


def test_matmul_nbits_g_idx_float16_and_accuracy_level():
    rng = np.random.default_rng(14)
    n, k, block = 8, 64, 16
    b, scales, zp, g_idx, weight = nbits_case(rng, n, k, 4, block, "packed", g_idx=True)
    a = rng.standard_normal((5, k)).astype(np.float32)
    attrs = {"K": k, "N": n, "block_size": block, "accuracy_level": 4}  # bits defaults to 4
    [got] = run_ours(*ms_model("MatMulNBits", [a, b, scales, zp, g_idx], attrs, constants=frozenset({1, 2, 3, 4})))
    np.testing.assert_allclose(got, a.astype(np.float64) @ weight.T, rtol=1e-5, atol=1e-5)
    # float16 activations and scales: computed in float32, rounded to float16 at the end
    b, scales, zp, _, weight = nbits_case(rng, n, k, 4, block, "float", scale_type=np.float16)
    half = a.astype(np.float16)
    [got16], [theirs] = both("MatMulNBits", [half, b, scales, zp.astype(np.float16)], attrs,
                             constants=frozenset({1, 2, 3}))
    assert got16.dtype == np.float16
    weight16 = (_unpacked(b, 4, k) - zp.astype(np.float16).astype(np.float64).repeat(block, axis=1)[:, :k]) \
        * scales.astype(np.float64).repeat(block, axis=1)[:, :k]
    expected = half.astype(np.float64) @ weight16.T
    np.testing.assert_allclose(got16.astype(np.float64), expected, rtol=2e-3, atol=2e-3)
    assert_relative(got16, theirs)


# -- errors ---------------------------------------------------------------------------------------------------
def test_unsupported_attributes_are_refused_at_worker_creation():
    for op_type, attrs in [("MatMulNBits", {"K": 32, "N": 4, "bits": 3, "block_size": 16}),
                           ("MatMulNBits", {"K": 32, "N": 4, "block_size": 24}),
                           ("MatMulNBits", {"K": 32, "N": 4, "block_size": 16, "weight_prepacked": 1}),
                           ("QLinearGlobalAveragePool", {"channels_last": 2})]:
        with pytest.raises(UnsupportedOperatorError, match=op_type):
            ms_op(op_type, attrs)


def test_bad_inputs_raise_execution_errors_naming_the_layer():
    rng = np.random.default_rng(15)
    x = q8(rng, np.uint8, 2, 4)
    cases = [
        ("QLinearAdd", [x, f32(0.1), np.array([1, 2], np.uint8), x, f32(0.1), np.uint8(0), f32(0.1), np.uint8(0)],
         {}, "A_zero_point must be a scalar"),
        ("QLinearAdd", [x, f32(0.1), np.uint8(0), x[:, :3], f32(0.1), np.uint8(0), f32(0.1), np.uint8(0)],
         {}, "do not broadcast"),
        ("QLinearConcat", [f32(0.1), np.uint8(0), x, f32(0.1)], {"axis": 0}, "triples"),
        ("QGemm", [x, f32(0.1), np.uint8(0), q8(rng, np.int8, 3, 2), f32(0.1), np.int8(0)], {}, "cannot be multiplied"),
        ("MatMulNBits", [rng.standard_normal((1, 32)).astype(np.float32), np.zeros((4, 2, 8), np.uint8),
                         np.ones((4, 1), np.float32)], {"K": 32, "N": 4, "block_size": 16}, "scales must have shape"),
        ("MatMulNBits", [rng.standard_normal((1, 30)).astype(np.float32), np.zeros((4, 2, 8), np.uint8),
                         np.ones((4, 2), np.float32)], {"K": 32, "N": 4, "block_size": 16}, "K=32"),
    ]
    for op_type, inputs, attrs, message in cases:
        model, feeds = ms_model(op_type, inputs, attrs)
        loaded = ai.load_model(model.SerializeToString())
        with ai.Worker(loaded, "cpu", threads=1) as worker:
            with pytest.raises(ExecutionError, match=message) as info:
                worker.run_blocking(feeds)
            assert "layer" in str(info.value) and op_type in str(info.value)
            # the worker stays usable
            with pytest.raises(ExecutionError):
                worker.run_blocking(feeds)


def test_kernels_leave_their_inputs_unwritten():
    rng = np.random.default_rng(16)
    cases = [("QLinearAdd", [q8(rng, np.uint8, 3, 4), f32(0.1), np.uint8(3), q8(rng, np.uint8, 4), f32(0.2),
                             np.uint8(5), f32(0.3), np.uint8(7)], {}),
             ("QLinearAveragePool", [q8(rng, np.uint8, 1, 4, 5, 3), f32(0.1), np.uint8(3), f32(0.1), np.uint8(3)],
              {"kernel_shape": [2, 2], "channels_last": 1}),
             ("QGemm", [q8(rng, np.uint8, 3, 4), f32(0.1), np.uint8(3), q8(rng, np.int8, 4, 2), f32(0.2),
                        np.int8(1), np.ones(2, np.int32)], {}),
             ("DynamicQuantizeMatMul", [rng.standard_normal((3, 4)).astype(np.float32), q8(rng, np.int8, 4, 2),
                                        f32(0.1)], {})]
    for op_type, inputs, attrs in cases:
        frozen = []
        for x in inputs:
            x = np.array(x)
            x.flags.writeable = False
            frozen.append(x)
        before = [x.copy() for x in frozen]
        ms_op(op_type, attrs, n_inputs=len(inputs))(*frozen)
        for x, b in zip(frozen, before):
            np.testing.assert_array_equal(x, b)


# -- real models made by ORT's tools -----------------------------------------------------------------------
class _RandomImages:
    """A CalibrationDataReader of a few random normalised images."""

    def __init__(self, name: str, shape: tuple[int, ...], count: int = 3):
        rng = np.random.default_rng(0)
        self._data = iter([{name: rng.standard_normal(shape).astype(np.float32)} for _ in range(count)])

    def get_next(self):
        return next(self._data, None)


def _small_cnn() -> onnx.ModelProto:
    """A small CNN whose QOperator quantization uses every com.microsoft QLinear op: conv, LeakyRelu,
    AveragePool, Concat, Sigmoid gate (Mul), residual Add, GlobalAveragePool, Gemm, Softmax."""
    from bench.architectures import FLOAT, GraphBuilder

    g = GraphBuilder("small_cnn", seed=7)
    x = g.input("input", FLOAT, [1, 3, 32, 32])
    y = g.op("Relu", g.conv(x, 3, 16, 3, 2))
    a = g.op("LeakyRelu", g.conv(y, 16, 16, 3), alpha=0.1)
    b = g.op("AveragePool", y, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    c = g.op("Concat", a, b, axis=1)
    m = g.op("Mul", c, g.op("Sigmoid", g.conv(c, 32, 32, 1)))
    r = g.op("Add", m, g.conv(y, 16, 32, 1))
    logits = g.gemm(g.op("Flatten", g.op("GlobalAveragePool", r), axis=1), 32, 10)
    g.output(g.op("Softmax", logits, axis=-1), "probs", FLOAT, [1, 10])
    return g.model()


def _at_size(model: onnx.ModelProto, size: int) -> onnx.ModelProto:
    """A fully convolutional bench model with its 224×224 input made ``size``×``size`` (far less work)."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_value = dims[3].dim_value = size
    return model


def _count_ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node if n.domain == MS)


def _exposed(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every com.microsoft node's outputs added as graph outputs (compared one by one)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    declared = {o.name for o in out.graph.output}
    for node in model.graph.node:
        if node.domain == MS:
            out.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in node.output
                                    if o and o not in declared)
    return out


def _quantized_step(model: onnx.ModelProto, output: str) -> float | None:
    """The quantization step of a float output made by DequantizeLinear, else None."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and output in node.output and node.input[1] in inits:
            return float(inits[node.input[1]].max())
    return None


def _compare_with_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], backend: str = "cpu") -> dict:
    """Run ``model`` (every com.microsoft output exposed) on ``backend`` and in ORT; quantized
    outputs within 2 steps, float outputs within 2 steps where DequantizeLinear made them, else 1e-2
    relative. Returns our outputs."""
    exposed = _exposed(model)
    names = [o.name for o in exposed.graph.output]
    theirs = dict(zip(names, run_ort(exposed, feeds)))
    ours = dict(zip(names, run_ours(exposed, feeds, backend)))
    for name in names:
        g, t = ours[name], theirs[name]
        if t.dtype.kind in "iu":
            assert_within_steps(g, t, 2)
            continue
        step = _quantized_step(model, name)
        if step is not None:
            assert g.dtype == t.dtype and np.abs(g - t).max(initial=0) <= 2 * step + 1e-7, name
        else:
            assert_relative(g, t)
    return ours


@pytest.fixture(scope="module")
def static_models(tmp_path_factory) -> dict[str, onnx.ModelProto]:
    """quantize_static in QOperator format: the small CNN per tensor (u8/u8) and per channel (u8/s8
    with reduce_range, as ORT advises for CPUs without VNNI), ResNet-18 per channel and
    MobileNetV3-small per tensor at 64×64."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    from bench.architectures import mobilenet_v3_small, resnet18

    folder = tmp_path_factory.mktemp("static")
    made = {}
    for name, model, shape, per_channel in [("cnn_per_tensor", _small_cnn(), (1, 3, 32, 32), False),
                                            ("cnn_per_channel", _small_cnn(), (1, 3, 32, 32), True),
                                            ("resnet18", _at_size(resnet18(), 64), (1, 3, 64, 64), True),
                                            ("mobilenet_v3_small", _at_size(mobilenet_v3_small(), 64), (1, 3, 64, 64),
                                             False)]:
        src, dst = folder / f"{name}.onnx", folder / f"{name}_q.onnx"
        onnx.save(model, src)
        quantize_static(str(src), str(dst), _RandomImages(model.graph.input[0].name, shape),
                        quant_format=QuantFormat.QOperator, per_channel=per_channel,
                        activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8 if per_channel else QuantType.QUInt8, reduce_range=per_channel)
        made[name] = onnx.load(dst)
    return made


@pytest.mark.parametrize("name,expected", [
    ("cnn_per_tensor", QOPERATOR_OPS), ("cnn_per_channel", QOPERATOR_OPS),  # every QOperator op of the domain
    ("resnet18", {"QLinearAdd", "QLinearGlobalAveragePool", "QGemm"}),
    ("mobilenet_v3_small", {"QLinearAdd", "QLinearMul", "QGemm"})])
def test_quantize_static_qoperator_models(static_models, name, expected):
    model = static_models[name]
    assert set(_count_ops(model)) == expected
    feeds = {model.graph.input[0].name: np.random.default_rng(3).standard_normal(
        [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)}
    _compare_with_ort(model, feeds)


def _bert_feeds(model: onnx.ModelProto, batch: int = 2, seq: int = 7, vocab: int = 50) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    feeds = {}
    for value in model.graph.input:
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(0, vocab, (batch, seq)).astype(dtype)
        elif "mask" in value.name:
            mask = np.ones((batch, seq), dtype)
            mask[1, seq - 2:] = 0
            feeds[value.name] = mask
        else:
            feeds[value.name] = rng.integers(0, 2, (batch, seq)).astype(dtype)
    return feeds


# ORT's transformer fusions, turned off so the optimized model holds only the quantized matmuls
# (the float com.microsoft ops have their own tests).
_TRANSFORMER_FUSIONS = ["GeluFusion", "GeluFusionL1", "GeluFusionL2", "BiasGeluFusion", "FastGeluFusion",
                        "QuickGeluFusion", "SkipLayerNormFusion", "SimplifiedLayerNormFusion", "MatMulScaleFusion",
                        "AttentionFusion", "EmbedLayerNormFusion", "BiasSoftmaxFusion", "MatmulTransposeFusion"]


def test_quantize_dynamic_bert_after_ort_offline_optimization(tmp_path):
    """quantize_dynamic writes DynamicQuantizeLinear + MatMulInteger; ORT's offline optimization
    (ORT_ENABLE_EXTENDED) fuses them into DynamicQuantizeMatMul and MatMulIntegerToFloat."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from bench.architectures import bert_tiny

    src, dq, optimized = tmp_path / "bert.onnx", tmp_path / "bert_dq.onnx", tmp_path / "bert_dq_opt.onnx"
    onnx.save(bert_tiny(layers=1, hidden=32, heads=2, ffn=64, vocab=50, max_positions=16), src)
    quantize_dynamic(str(src), str(dq), weight_type=QuantType.QInt8, reduce_range=True)  # u8×s8 cannot saturate
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(optimized)
    ort.InferenceSession(str(dq), so, providers=["CPUExecutionProvider"], disabled_optimizers=_TRANSFORMER_FUSIONS)
    model = onnx.load(optimized)
    assert {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"} <= set(_count_ops(model)) <= ALL_OPS
    _compare_with_ort(model, _bert_feeds(model))


def _fused_bert(vocab: int = 50, positions: int = 16, hidden: int = 32, heads: int = 2) -> onnx.ModelProto:
    """The transformer optimizer's BERT shape: EmbedLayerNormalization → Attention → MatMul."""
    rng = np.random.default_rng(0)

    def weight(name, *shape, scale=0.2):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [weight("word", vocab, hidden), weight("pos", positions, hidden), weight("seg", 2, hidden),
             numpy_helper.from_array(np.ones(hidden, np.float32), "gamma"), weight("beta", hidden, scale=0.05),
             weight("qkv_w", hidden, 3 * hidden), weight("qkv_b", 3 * hidden, scale=0.05), weight("out_w", hidden, hidden)]
    nodes = [helper.make_node("EmbedLayerNormalization", ["input_ids", "segment_ids", "word", "pos", "seg", "gamma",
                                                          "beta", "mask"], ["emb", "mask_index"], domain=MS),
             helper.make_node("Attention", ["emb", "qkv_w", "qkv_b", "mask_index"], ["attn"], domain=MS,
                              num_heads=heads),
             helper.make_node("MatMul", ["attn", "out_w"], ["y"])]
    ids = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", "seq"])
           for n in ("input_ids", "segment_ids", "mask")]
    graph = helper.make_graph(nodes, "fused_bert", ids,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("weight_type", ["QInt8", "QUInt8"])
def test_quantize_dynamic_fused_bert_gives_qattention(tmp_path, weight_type):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = tmp_path / "fused.onnx", tmp_path / "fused_q.onnx"
    onnx.save(_fused_bert(), src)
    quantize_dynamic(str(src), str(dst), weight_type=getattr(QuantType, weight_type), reduce_range=True,
                     extra_options={"DefaultTensorType": TensorProto.FLOAT})
    model = onnx.load(dst)
    assert set(_count_ops(model)) == {"QAttention", "QEmbedLayerNormalization"}
    _compare_with_ort(model, _bert_feeds(model))


@pytest.fixture(scope="module")
def nbits_models() -> dict[str, onnx.ModelProto]:
    """MatMulNBitsQuantizer on a two-MatMul MLP (K = 80: the last block is partial)."""
    pytest.importorskip("onnx_ir", reason="onnxruntime's MatMulNBitsQuantizer imports onnx_ir")
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    rng = np.random.default_rng(0)
    k, n, h = 80, 48, 40
    w1 = numpy_helper.from_array((rng.standard_normal((k, n)) * 0.1).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((n, h)) * 0.1).astype(np.float32), "w2")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                               helper.make_node("MatMul", ["r", "w2"], ["y"])], "mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", h])], [w1, w2])
    base = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    base.ir_version = 8
    made = {}
    for name, bits, symmetric, accuracy in [("4bit", 4, False, None), ("4bit_symmetric_acc4", 4, True, 4),
                                            ("8bit", 8, False, None)]:
        model = onnx.ModelProto()
        model.CopyFrom(base)  # the quantizer rewrites the model it is given
        quantizer = MatMulNBitsQuantizer(model, algo_config=DefaultWeightOnlyQuantConfig(
            block_size=32, is_symmetric=symmetric, accuracy_level=accuracy, bits=bits))
        quantizer.process()
        made[name] = quantizer.model.model
    return made


@pytest.mark.parametrize("name", ["4bit", "4bit_symmetric_acc4", "8bit"])
def test_matmul_nbits_quantizer_models(nbits_models, name):
    model = nbits_models[name]
    assert _count_ops(model) == {"MatMulNBits": 2}
    feeds = {"x": np.random.default_rng(5).standard_normal((2, 3, 80)).astype(np.float32)}
    _compare_with_ort(model, feeds)


# -- the gpu_pixel backend: these layers fall back to the CPU --------------------------------------------------
def test_pixel_backend_runs_quantized_models(static_models, tmp_path):
    require_pixel()
    for name in ("cnn_per_tensor", "cnn_per_channel"):
        model = static_models[name]
        feeds = {"input": np.random.default_rng(6).standard_normal((1, 3, 32, 32)).astype(np.float32)}
        loaded = ai.load_model(model.SerializeToString())
        with ai.Worker(loaded, "gpu_pixel", threads=1) as worker:
            placed = worker.placement.layers
            ms_layers = [layer.name for layer in loaded.layers if layer.domain == MS]
            assert ms_layers and all(placed[layer] == "cpu" for layer in ms_layers)
        _compare_with_ort(model, feeds, backend="gpu_pixel")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = tmp_path / "fused.onnx", tmp_path / "fused_q.onnx"
    onnx.save(_fused_bert(), src)
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, reduce_range=True,
                     extra_options={"DefaultTensorType": TensorProto.FLOAT})
    model = onnx.load(dst)
    _compare_with_ort(model, _bert_feeds(model), backend="gpu_pixel")
