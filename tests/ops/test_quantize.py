"""Kernels of asyncinfer/ops/quantize.py: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear,
QLinearMatMul, QLinearConv, MatMulInteger, ConvInteger and BitCast.

Every ONNX node case of these ops runs through the engine on every backend (tests/node_cases.py);
random QLinear/Integer matmuls and convs are compared bit for bit with onnx's reference
implementation, the definition (never with onnxruntime: its u8×s8 kernels saturate on CPUs without
AVX-512 VNNI, so such a test would pass only on some CPUs); quantize/dequantize, whose results do
not depend on the CPU, also with onnxruntime. Rounding ties, per-axis and blocked parameters,
saturation, refusal of unimplemented attributes and input immutability are checked directly.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from asyncinfer.conformance import load_cases
from asyncinfer.errors import ExecutionError, UnsupportedOperatorError
from node_cases import expected_failures_among
from op_testing import make_op, ort_run, reference_run

CASES = r"^test_(quantizelinear|dequantizelinear|dynamicquantizelinear|qlinear|matmulinteger|convinteger|bitcast)"


def test_case_selection():
    names = [c.name for c in load_cases(CASES)]
    assert len(names) >= 55
    assert not expected_failures_among(names)  # every node case of these ops passes on the CPU


# -- helpers ------------------------------------------------------------------------------------------
def run_checked(op_type: str, inputs: list, attrs: dict | None = None, opset: int = 21, n_outputs: int = 1):
    """Run our kernel on read-only inputs (any write raises) and check they are unchanged."""
    before = [None if x is None else x.copy() for x in inputs]
    frozen = []
    for x in inputs:
        if x is not None:
            x = np.array(x)  # a copy, and an array even for NumPy scalars
            x.flags.writeable = False
        frozen.append(x)
    got = make_op(op_type, attrs, opset, len(inputs), n_outputs)(*frozen)
    for x, b in zip(frozen, before):
        if x is not None:
            np.testing.assert_array_equal(x, b)
    return got


def assert_same_as_ort(op_type: str, inputs: list, attrs: dict | None = None, opset: int = 21, n_outputs: int = 1):
    """Ours equals onnxruntime exactly: same dtypes, shapes and values (CPU-independent ops only)."""
    _assert_same(run_checked(op_type, inputs, attrs, opset, n_outputs), ort_run(op_type, inputs, attrs, opset, n_outputs))


def assert_same_as_definition(op_type: str, inputs: list, attrs: dict | None = None, opset: int = 21,
                              n_outputs: int = 1):
    """Ours equals onnx's reference implementation exactly: same dtypes, shapes and values."""
    _assert_same(run_checked(op_type, inputs, attrs, opset, n_outputs),
                 reference_run(op_type, inputs, attrs, opset, n_outputs))


def _assert_same(got: list, expected: list) -> None:
    for g, e in zip(got, expected):
        assert (g.dtype, g.shape) == (e.dtype, e.shape)
        np.testing.assert_array_equal(g, e)


def q8(rng, dtype, *shape) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)


def scale(rng, *shape, low: float = 0.002, high: float = 0.05) -> np.ndarray:
    return rng.uniform(low, high, shape).astype(np.float32)


# -- QLinearConv / ConvInteger -----------------------------------------------------------------------
QCONV_CASES = {
    # name: (x shape, out channels, kernel, attrs, per-channel weights)
    "3x3_pad": ((1, 8, 10, 10), 6, (3, 3), dict(pads=[1, 1, 1, 1]), False),
    "3x3_per_channel_stride2": ((2, 4, 11, 9), 8, (3, 3), dict(strides=[2, 2], pads=[1, 0, 1, 2]), True),
    "1x1": ((1, 16, 7, 7), 8, (1, 1), {}, True),
    "grouped": ((1, 12, 8, 8), 6, (3, 3), dict(group=3, pads=[1, 1, 1, 1]), True),
    "depthwise_dilated": ((1, 8, 12, 12), 8, (3, 3), dict(group=8, dilations=[2, 2], pads=[2, 2, 2, 2]), True),
    "same_upper": ((1, 3, 9, 10), 4, (3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2]), False),
    "long_dot_float64_path": ((1, 64, 6, 6), 4, (3, 3), dict(pads=[1, 1, 1, 1]), True),  # 576 terms > 256
    "conv1d": ((2, 4, 15), 5, (3,), dict(strides=[2]), True),
}


@pytest.mark.parametrize("types", [(np.uint8, np.int8, np.uint8), (np.uint8, np.uint8, np.uint8),
                                   (np.int8, np.int8, np.int8)], ids=lambda t: "-".join(np.dtype(d).name for d in t))
@pytest.mark.parametrize("name", sorted(QCONV_CASES))
def test_qlinearconv_matches_the_definition(name, types, rng):
    shape, m, kernel, attrs, per_channel = QCONV_CASES[name]
    tx, tw, ty = types
    group = attrs.get("group", 1)
    wshape = (m,) if per_channel else ()
    w_zp = q8(rng, tw, *wshape)
    inputs = [q8(rng, tx, *shape), scale(rng), q8(rng, tx), q8(rng, tw, m, shape[1] // group, *kernel),
              scale(rng, *wshape), w_zp, scale(rng, low=0.05, high=0.2), q8(rng, ty),
              rng.integers(-5000, 5000, m).astype(np.int32)]
    attrs = dict(attrs, kernel_shape=list(kernel))
    if len(kernel) == 2:
        assert_same_as_definition("QLinearConv", inputs, attrs, opset=10)
        return
    # onnx's reference takes 2-D only: a 1-D conv is the 2-D one over a height of 1
    got = run_checked("QLinearConv", inputs, attrs, opset=10)[0]
    lifted = [x[:, :, None] if k in (0, 3) else x for k, x in enumerate(inputs)]
    lifted_attrs = {key: ([1] + v if key in ("kernel_shape", "strides", "dilations") else
                          [0] + v[:1] + [0] + v[1:] if key == "pads" else v) for key, v in attrs.items()}
    want = reference_run("QLinearConv", lifted, lifted_attrs, opset=10)[0][:, :, 0]
    _assert_same([got], [want])


@pytest.mark.parametrize("name", ["3x3_pad", "3x3_per_channel_stride2", "grouped", "long_dot_float64_path"])
def test_convinteger_matches_the_definition(name, rng):
    shape, m, kernel, attrs, _ = QCONV_CASES[name]
    x = q8(rng, np.uint8, *shape)
    w = q8(rng, np.uint8, m, shape[1] // attrs.get("group", 1), *kernel)
    assert_same_as_definition("ConvInteger", [x, w, q8(rng, np.uint8), q8(rng, np.uint8)],
                       dict(attrs, kernel_shape=list(kernel)), opset=10)


def test_convinteger_per_channel_zero_point(rng):
    """onnxruntime only takes a scalar w zero point: per channel equals shifting each filter first."""
    x, w = q8(rng, np.uint8, 1, 3, 6, 6), q8(rng, np.uint8, 4, 3, 3, 3)
    w_zp = q8(rng, np.uint8, 4)
    got = run_checked("ConvInteger", [x, w, np.array(7, np.uint8), w_zp], dict(kernel_shape=[3, 3]), opset=10)[0]
    shifted = (w.astype(np.int32) - w_zp.astype(np.int32)[:, None, None, None]).astype(np.float32)
    conv = make_op("Conv", dict(kernel_shape=[3, 3]), 11, 2)
    np.testing.assert_array_equal(got, conv(x.astype(np.float32) - 7, shifted)[0].astype(np.int32))


# -- QLinearMatMul / MatMulInteger ---------------------------------------------------------------------
QMATMUL_SHAPES = {"2d": ((5, 7), (7, 3)), "batched": ((2, 4, 9), (2, 9, 6)), "broadcast": ((3, 2, 4, 8), (8, 5)),
                  "long_dot": ((3, 300), (300, 4))}


@pytest.mark.parametrize("opset", [10, 21])
@pytest.mark.parametrize("types", [(np.uint8, np.int8, np.uint8), (np.int8, np.int8, np.int8),
                                   (np.uint8, np.uint8, np.uint8)], ids=lambda t: "-".join(np.dtype(d).name for d in t))
@pytest.mark.parametrize("name", sorted(QMATMUL_SHAPES))
def test_qlinearmatmul_matches_the_definition(name, types, opset, rng):
    (sa, sb), (ta, tb, ty) = QMATMUL_SHAPES[name], types
    inputs = [q8(rng, ta, *sa), scale(rng), q8(rng, ta), q8(rng, tb, *sb), scale(rng), q8(rng, tb),
              scale(rng, low=0.05, high=0.3), q8(rng, ty)]
    assert_same_as_definition("QLinearMatMul", inputs, opset=opset)


def test_qlinearmatmul_per_row_and_column(rng):
    """a's parameters per row (M,), b's per column (N,): each output element uses its own pair."""
    a, b = q8(rng, np.uint8, 4, 6), q8(rng, np.int8, 6, 3)
    a_s, a_zp, b_s, b_zp = scale(rng, 4), q8(rng, np.uint8, 4), scale(rng, 3), q8(rng, np.int8, 3)
    y_s, y_zp = np.array(0.1, np.float32), np.array(3, np.uint8)
    got = run_checked("QLinearMatMul", [a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp])[0]
    for i in range(4):
        for j in range(3):
            single = run_checked("QLinearMatMul", [a[i:i + 1], a_s[i], a_zp[i], b[:, j:j + 1], b_s[j], b_zp[j],
                                                   y_s, y_zp])[0]
            assert got[i, j] == single[0, 0]


def test_qlinearmatmul_float8(rng):
    """Opset 21 float8 operands: dequantize, multiply, quantize back (rounding in the cast, saturating).
    Power-of-two scales and small integer products keep every step before the cast exact."""
    f8 = ml_dtypes.float8_e4m3fn
    a, b = rng.integers(-4, 5, (3, 4)).astype(f8), rng.integers(-4, 5, (4, 2)).astype(f8)
    zero = np.array(0, f8)
    y = run_checked("QLinearMatMul", [a, np.array(0.5, np.float32), zero, b, np.array(2, np.float32), zero,
                                      np.array(0.25, np.float32), zero])[0]
    assert y.dtype == f8
    exact = (a.astype(np.float32) @ b.astype(np.float32)) * 4
    np.testing.assert_array_equal(y.astype(np.float32), exact.astype(f8).astype(np.float32))
    big = np.full((1, 4), 8, f8)  # 4 * 64 * 4 = 1024 > 448: saturates
    y = run_checked("QLinearMatMul", [big, np.array(1, np.float32), zero, big.T.copy(), np.array(1, np.float32), zero,
                                      np.array(0.25, np.float32), zero])[0]
    assert y.astype(np.float32)[0, 0] == 448


def test_matmulinteger_matches_the_definition(rng):
    for (sa, sb) in QMATMUL_SHAPES.values():
        assert_same_as_definition("MatMulInteger", [q8(rng, np.uint8, *sa), q8(rng, np.int8, *sb),
                                             q8(rng, np.uint8), q8(rng, np.int8)], opset=10)
    a, b = q8(rng, np.uint8, 4, 5), q8(rng, np.uint8, 5, 3)  # per-row a and per-column b zero points
    a_zp, b_zp = q8(rng, np.uint8, 4), q8(rng, np.uint8, 3)
    got = run_checked("MatMulInteger", [a, b, a_zp, b_zp], opset=10)[0]
    expected = (a.astype(np.int64) - a_zp[:, None]) @ (b.astype(np.int64) - b_zp)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def test_matmulinteger_wraps_in_int32():
    """Accumulation may overflow, and then only in 32 bits: the exact sum wraps around."""
    k = 40000
    a, b = np.full((1, k), 255, np.uint8), np.full((k, 1), 255, np.uint8)
    got = run_checked("MatMulInteger", [a, b], opset=10)[0]
    assert got[0, 0] == np.int64(255 * 255 * k).astype(np.int32)


@pytest.mark.parametrize("a_shape,b_shape", [((3, 1100), (1100, 5)), ((2, 3, 700), (700, 4)), ((700,), (700,)),
                                             ((2, 600), (3, 600, 2))])
def test_matmulinteger_is_exact_when_k_is_cut_into_float32_chunks(a_shape, b_shape, rng):
    """Full-range operands allow 258 terms per exact float32 chunk: these K take 2 to 5 chunks,
    whose sums must add up to the exact integer result."""
    a, b = rng.integers(0, 256, a_shape).astype(np.uint8), rng.integers(-128, 128, b_shape).astype(np.int8)
    a_zp, b_zp = np.array(255, np.uint8), np.array(-128, np.int8)  # |a - a_zp| and |b - b_zp| up to 255
    got = run_checked("MatMulInteger", [a, b, a_zp, b_zp], opset=10)[0]
    expected = np.matmul(a.astype(np.int64) - 255, b.astype(np.int64) + 128)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def test_constant_weights_are_shifted_once_and_fed_weights_every_run(rng):
    """A constant B is converted on the first run and kept (Op.derived); a B fed as an input is not
    kept: each run multiplies the B it was given."""
    import onnx
    from onnx import helper, numpy_helper

    import asyncinfer as ai

    w = rng.integers(-128, 128, (300, 6)).astype(np.int8)
    nodes = [helper.make_node("MatMulInteger", ["a", "w"], ["y_const"], name="with_constant"),
             helper.make_node("MatMulInteger", ["a", "b"], ["y_fed"], name="with_input")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", onnx.TensorProto.UINT8, [2, 300]),
                     helper.make_tensor_value_info("b", onnx.TensorProto.INT8, [300, 6])],
        [helper.make_tensor_value_info(n, onnx.TensorProto.INT32, [2, 6]) for n in ("y_const", "y_fed")],
        [numpy_helper.from_array(w, "w")])
    model = ai.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    with ai.Worker(model) as worker:
        for _ in range(2):
            a = rng.integers(0, 256, (2, 300)).astype(np.uint8)
            b = rng.integers(-128, 128, (300, 6)).astype(np.int8)
            out = worker.run_blocking({"a": a, "b": b})
            np.testing.assert_array_equal(out["y_const"], a.astype(np.int64) @ w.astype(np.int64))
            np.testing.assert_array_equal(out["y_fed"], a.astype(np.int64) @ b.astype(np.int64))
        ops = {n.layer.name: n.step.op for n in worker._plan.nodes}
        assert "b" in ops["with_constant"]._derived and not ops["with_input"]._derived


# -- QuantizeLinear / DequantizeLinear -----------------------------------------------------------------
def test_quantize_rounds_half_to_even_before_the_zero_point():
    x = np.arange(-6, 6, dtype=np.float32) + 0.5
    for zp in (np.array(3, np.uint8), np.array(-3, np.int8)):
        assert_same_as_ort("QuantizeLinear", [x, np.array(1, np.float32), zp], opset=19)
        y = run_checked("QuantizeLinear", [x, np.array(1, np.float32), zp], opset=21)[0]
        np.testing.assert_array_equal(y.astype(np.int32), np.clip(np.rint(x) + zp, *_limits(zp.dtype)))


def _limits(dtype):
    info = ml_dtypes.iinfo(dtype)
    return int(info.min), int(info.max)


@pytest.mark.parametrize("opset", [13, 21])
def test_quantize_per_axis_matches_onnxruntime(opset, rng):
    x = rng.normal(0, 3, (3, 4, 5)).astype(np.float32)
    assert_same_as_ort("QuantizeLinear", [x, scale(rng, 4, low=0.01, high=0.1), q8(rng, np.uint8, 4)],
                       dict(axis=1), opset)
    assert_same_as_ort("QuantizeLinear", [x, scale(rng, 5, low=0.01, high=0.1), q8(rng, np.int8, 5)],
                       dict(axis=-1), opset)


def test_blocked_quantize_dequantize_match_onnxruntime(rng):
    x = rng.normal(0, 3, (4, 7, 5)).astype(np.float32)  # 7 is not a multiple of the block
    s, zp = scale(rng, 4, 3, 5, low=0.01, high=0.1), q8(rng, np.uint8, 4, 3, 5)
    assert_same_as_ort("QuantizeLinear", [x, s, zp], dict(axis=1, block_size=3))
    q = q8(rng, np.uint8, 4, 7, 5)
    assert_same_as_ort("DequantizeLinear", [q, s, zp], dict(axis=1, block_size=3))


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.int32])
def test_dequantize_wide_integers_match_onnxruntime(dtype, rng):
    x = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, 64, endpoint=True).astype(dtype)
    zp = [] if dtype is np.int32 else [np.array(7, dtype)]
    assert_same_as_ort("DequantizeLinear", [x, np.array(0.37, np.float32)] + zp)


def test_quantize_saturation_of_narrow_types():
    x = np.array([-1e6, -3.3, 0, 2.6, 1e6, np.inf], np.float32)
    one = np.array(1, np.float32)
    for dtype in (ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2, np.int16, np.uint16):
        y = run_checked("QuantizeLinear", [x, one, np.array(0, dtype)], opset=25)[0]
        assert y.dtype == dtype
        np.testing.assert_array_equal(y.astype(np.float64), np.clip(np.rint(x), *_limits(dtype)))
    e4m3 = ml_dtypes.float8_e4m3fn
    sat = run_checked("QuantizeLinear", [x, one, np.array(0, e4m3)], opset=21)[0]
    np.testing.assert_array_equal(sat.astype(np.float32), [-448, -3.25, 0, 2.5, 448, 448])
    raw = run_checked("QuantizeLinear", [x, one, np.array(0, e4m3)], dict(saturate=0), opset=21)[0]
    assert np.isnan(raw.astype(np.float32)[[0, 4, 5]]).all()  # e4m3fn has no inf: out of range is NaN
    fp4 = run_checked("QuantizeLinear", [x, one, np.array(0, ml_dtypes.float4_e2m1fn)], opset=23)[0]
    np.testing.assert_array_equal(fp4.astype(np.float32), [-6, -3, 0, 3, 6, 6])


def test_quantize_output_dtype_and_default_uint8():
    x, one = np.array([-2.0, 300.0], np.float32), np.array(1, np.float32)
    assert run_checked("QuantizeLinear", [x, one], opset=21)[0].dtype == np.uint8
    y = run_checked("QuantizeLinear", [x, one], dict(output_dtype=5), opset=21)[0]  # INT16
    assert y.dtype == np.int16 and y.tolist() == [-2, 300]


def test_quantize_precision_follows_the_scale_from_opset_23():
    """Opset 23+: a float16 scale divides in float16 (unless ``precision`` says otherwise); before,
    runtimes divide in float32. 1796 / 7 = 256.571 is 256.5 in float16, which rounds to even 256."""
    x, s, zp = np.array([1796], np.float16), np.array(7, np.float16), np.array(0, np.int16)
    assert run_checked("QuantizeLinear", [x, s, zp], opset=21)[0][0] == 257
    assert run_checked("QuantizeLinear", [x, s, zp], opset=23)[0][0] == 256
    assert run_checked("QuantizeLinear", [x, s, zp], dict(precision=1), opset=23)[0][0] == 257  # FLOAT


def test_dequantize_output_dtype_and_float8(rng):
    x = rng.integers(0, 255, 10).astype(np.uint8)
    y = run_checked("DequantizeLinear", [x, np.array(0.5, np.float32), np.array(3, np.uint8)],
                    dict(output_dtype=10), opset=23)[0]  # FLOAT16
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, ((x.astype(np.float32) - 3) * 0.5).astype(np.float16))
    f8 = np.array([-448, -1.5, 0, 0.875, 448], ml_dtypes.float8_e4m3fn)
    y = run_checked("DequantizeLinear", [f8, np.array(2, np.float32)], opset=19)[0]
    np.testing.assert_array_equal(y, f8.astype(np.float32) * 2)


def test_quantize_dequantize_bad_parameter_shape_is_an_execution_error():
    op = make_op("QuantizeLinear", dict(axis=0), 21, 3)
    with pytest.raises(ExecutionError, match="per-axis"):
        op(np.zeros((3, 2), np.float32), np.ones(2, np.float32), np.zeros(2, np.uint8))
    op = make_op("DequantizeLinear", dict(axis=1, block_size=2), 21, 3)
    with pytest.raises(ExecutionError, match="block_size"):
        op(np.zeros((3, 4), np.uint8), np.ones((3, 3), np.float32))


# -- DynamicQuantizeLinear -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape,loc", [((3, 17), 0.0), ((40,), 5.0), ((2, 3, 4), -7.0)])
def test_dynamicquantizelinear_matches_onnxruntime(shape, loc, rng):
    x = rng.normal(loc, 3, shape).astype(np.float32)
    assert_same_as_ort("DynamicQuantizeLinear", [x], opset=11, n_outputs=3)


def test_dynamicquantizelinear_all_zeros():
    """The formula gives scale 0 (onnxruntime reports 1): values and zero point quantize to 0."""
    y, s, zp = run_checked("DynamicQuantizeLinear", [np.zeros((2, 3), np.float32)], opset=11, n_outputs=3)
    assert y.dtype == np.uint8 and not y.any() and s.dtype == np.float32 and s == 0 and zp == 0


# -- BitCast -------------------------------------------------------------------------------------------
def test_bitcast_reinterprets_bits():
    x = np.array([[1.0, -2.5], [np.inf, 0.0]], np.float32)
    y = run_checked("BitCast", [x], dict(to=6), opset=26)[0]  # INT32
    assert y.dtype == np.int32 and y.shape == x.shape
    np.testing.assert_array_equal(y, x.view(np.int32))
    back = run_checked("BitCast", [y], dict(to=1), opset=26)[0]
    np.testing.assert_array_equal(back, x)
    h = run_checked("BitCast", [np.array([1.0, -0.0], np.float16)], dict(to=16), opset=26)[0]  # BFLOAT16
    assert h.dtype == ml_dtypes.bfloat16 and h.view(np.uint16).tolist() == [0x3C00, 0x8000]


def test_bitcast_sub_byte_types():
    x = np.array([-8, -1, 0, 7], ml_dtypes.int4)
    u = run_checked("BitCast", [x], dict(to=21), opset=26)[0]  # UINT4
    assert u.dtype == ml_dtypes.uint4 and u.astype(np.int32).tolist() == [8, 15, 0, 7]
    f = run_checked("BitCast", [u], dict(to=23), opset=26)[0]  # FLOAT4E2M1
    assert f.astype(np.float32).tolist() == [-0.0, -6.0, 0.0, 6.0]


def test_bitcast_width_mismatch_is_an_execution_error():
    with pytest.raises(ExecutionError, match="bits"):
        make_op("BitCast", dict(to=7), 26)(np.zeros(3, np.float32))  # float32 → int64


# -- refusals --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op_type,attrs,opset", [
    ("QuantizeLinear", dict(output_dtype=1), 21),          # FLOAT is not a quantized type
    ("QuantizeLinear", dict(block_size=-2), 21),
    ("QuantizeLinear", dict(precision=999), 23),
    ("DequantizeLinear", dict(output_dtype=3), 23),        # INT8 is not a dequantized type
    ("QLinearConv", dict(auto_pad="WRAP"), 10),
    ("ConvInteger", dict(strides=[0, 1]), 10),
    ("BitCast", dict(to=8), 26),                           # STRING
    ("QuantizeLinear", {}, 9),                             # before the op existed
])
def test_unsupported_attributes_are_refused(op_type, attrs, opset):
    with pytest.raises(UnsupportedOperatorError):
        make_op(op_type, attrs, opset)
