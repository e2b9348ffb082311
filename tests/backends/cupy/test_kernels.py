"""gpu_compute kernels (asyncinfer/backends/cupy/kernels) against the CPU ops.

Each kernel is written against an array module ``xp``; here every case runs with ``xp = numpy``
(the CI machine has no GPU) and, where CUDA is present, again with ``xp = cupy``. The reference
is the CPU op of the same layer, so both backends must agree on attribute parsing, defaults and
opset differences. Tolerances (float32): element-wise, reductions, normalisations rtol 1e-4 /
atol 1e-5; Conv, MatMul, Gemm rtol 1e-3 / atol 1e-4 (different summation order, and TF32 or
cuBLAS reordering on a GPU). float16 cases: rtol 1e-2 / atol 1e-2 (the CPU computes some of
them in float32 and rounds once; the device may round intermediate sums).
"""
from __future__ import annotations

import numpy as np
import pytest

from asyncinfer import ops
from asyncinfer.backends.cupy.device import cuda_unavailable_reason
from asyncinfer.backends.cupy.hostdevice import HostRuntime
from asyncinfer.backends.cupy.kernels import SUPPORTED_OPS, apply_activations, can_fuse, kernel_class
from asyncinfer.errors import ExecutionError
from asyncinfer.model.ir import Layer
from asyncinfer.ops.registry import lookup

NO_CUDA = "no CUDA device (CuPy not installed or no GPU)"
ELEMENTWISE = dict(rtol=1e-4, atol=1e-5)
GEMM = dict(rtol=1e-3, atol=1e-4)
HALF = dict(rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module", params=["numpy", "cuda"])
def ctx(request):
    """The kernels' context: NumPy (always), or CuPy on the first CUDA device (skipped without one)."""
    if request.param == "numpy":
        return HostRuntime().start()
    if cuda_unavailable_reason() is not None:
        pytest.skip(NO_CUDA)
    from asyncinfer.backends.cupy.device import CudaRuntime

    return CudaRuntime(use_cudnn=False).start()


def to_host(x):
    if x is None or isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy.asnumpy(x)
    return np.asarray(x)


def make_layer(op_type, n_inputs, attrs=None, version=17, n_outputs=1, missing=()):
    return Layer(name=f"{op_type.lower()}_layer", op_type=op_type,
                 inputs=["" if k in missing else f"i{k}" for k in range(n_inputs)],
                 outputs=[f"o{k}" for k in range(n_outputs)], attrs=dict(attrs or {}), version=version)


def host_inputs(layer):
    cls = kernel_class(layer)
    return frozenset(lookup(layer.op_type, layer.version).value_inputs) | cls.host_inputs


def check(ctx, op_type, inputs, attrs=None, version=17, n_outputs=1, tol=ELEMENTWISE, out_types=None):
    """Run the kernel and the CPU op on ``inputs``; assert the kernel accepts the layer, agrees
    with the CPU in dtype, shape and values, and leaves its inputs unchanged. Returns the outputs."""
    layer = make_layer(op_type, len(inputs), attrs, version, n_outputs,
                       missing={k for k, x in enumerate(inputs) if x is None})
    op = ops.create(layer)
    expected = [np.asarray(e) if e is not None else None for e in op(*inputs)]
    cls = kernel_class(layer)
    assert cls is not None, f"no gpu_compute kernel for {op_type}"
    host = host_inputs(layer)
    types = {f"i{k}": x.dtype for k, x in enumerate(inputs) if x is not None}
    types.update({f"o{k}": (out_types or {}).get(k, None if e is None else e.dtype) for k, e in enumerate(expected)})
    assert cls.accepts(layer, op, types, host), f"{op_type} {attrs} refused with types {types}"
    kernel = cls(layer, op)
    device = [None if x is None else (x if k in host else ctx.to_device(x)) for k, x in enumerate(inputs)]
    snapshot = [None if d is None else to_host(d).copy() for d in device]
    got = kernel(ctx, *device)
    for d, s in zip(device, snapshot):
        if d is not None:
            np.testing.assert_array_equal(to_host(d), s, err_msg="the kernel modified an input")
    assert len(got) >= len([o for o in layer.outputs if o])
    results = []
    for g, e in zip(got, expected):
        g = to_host(g)
        assert g.dtype == e.dtype and g.shape == e.shape, (op_type, g.dtype, g.shape, e.dtype, e.shape)
        if e.dtype.kind == "f":
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), **tol, err_msg=op_type)
        else:
            np.testing.assert_array_equal(g, e, err_msg=op_type)
        results.append(g)
    return results


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# -- convolution -----------------------------------------------------------------------------------
CONV_CASES = {
    "3x3_pad1": ((2, 4, 9, 9), (6, 4, 3, 3), dict(pads=[1, 1, 1, 1])),
    "stem_7x7_s2": ((1, 3, 20, 20), (8, 3, 7, 7), dict(pads=[3, 3, 3, 3], strides=[2, 2])),
    "pointwise": ((2, 8, 5, 5), (4, 8, 1, 1), {}),
    "pointwise_strided": ((1, 8, 7, 7), (4, 8, 1, 1), dict(strides=[2, 2])),
    "grouped": ((1, 6, 8, 8), (4, 3, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    "depthwise": ((2, 5, 7, 7), (5, 1, 3, 3), dict(group=5, pads=[1, 1, 1, 1], strides=[2, 2])),
    "depthwise_multiplier": ((1, 3, 6, 6), (6, 1, 3, 3), dict(group=3)),
    "dilated": ((1, 2, 11, 11), (3, 2, 3, 3), dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    "asymmetric_pads": ((1, 2, 6, 7), (3, 2, 3, 2), dict(pads=[0, 1, 2, 0])),
    "same_upper": ((1, 2, 7, 7), (3, 2, 4, 4), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    "same_lower": ((1, 2, 7, 7), (3, 2, 4, 4), dict(auto_pad="SAME_LOWER")),
    "valid": ((1, 2, 7, 6), (3, 2, 3, 3), dict(auto_pad="VALID")),
    "rect_kernel_strides": ((1, 3, 10, 9), (2, 3, 1, 5), dict(strides=[3, 1], pads=[0, 2, 0, 2])),
    "conv1d": ((2, 3, 12), (4, 3, 5), dict(pads=[2, 2])),
    "conv3d": ((1, 2, 5, 6, 4), (3, 2, 3, 3, 3), dict(pads=[1, 1, 1, 1, 1, 1])),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv(ctx, rng, case, bias):
    xs, ws, attrs = CONV_CASES[case]
    inputs = [randn(rng, *xs), randn(rng, *ws)] + ([randn(rng, ws[0])] if bias else [])
    check(ctx, "Conv", inputs, attrs, tol=GEMM)


def test_conv_float16(ctx, rng):
    inputs = [randn(rng, 1, 4, 8, 8, dtype=np.float16), randn(rng, 3, 4, 3, 3, dtype=np.float16) * np.float16(0.3),
              randn(rng, 3, dtype=np.float16)]
    check(ctx, "Conv", inputs, dict(pads=[1, 1, 1, 1]), tol=HALF)


def test_conv_with_fused_relu_runs_in_place(ctx, rng):
    x, w, b = randn(rng, 2, 3, 6, 6), randn(rng, 4, 3, 3, 3), randn(rng, 4)
    conv = make_layer("Conv", 3, dict(pads=[1, 1, 1, 1]))
    relu = make_layer("Relu", 1)
    kernel = kernel_class(conv)(conv, ops.create(conv))
    y = kernel(ctx, ctx.to_device(x), ctx.to_device(w), ctx.to_device(b))[0]
    out = apply_activations(ctx, y, [(ops.create(relu), [])], fresh=kernel.fresh_output)
    assert out is y, "a fused Relu on the conv's fresh output must not allocate"
    expected = np.maximum(ops.create(conv)(x, w, b)[0], 0)
    np.testing.assert_allclose(to_host(out), expected, **GEMM)


# -- linear algebra ----------------------------------------------------------------------------------
@pytest.mark.parametrize("a_shape, b_shape", [((5, 7), (7, 3)), ((2, 4, 6), (6, 5)), ((3, 1, 4, 6), (2, 6, 5)),
                                              ((7,), (7, 3)), ((4, 7), (7,)), ((7,), (7,))])
def test_matmul(ctx, rng, a_shape, b_shape):
    check(ctx, "MatMul", [randn(rng, *a_shape), randn(rng, *b_shape)], tol=GEMM)


def test_matmul_float16(ctx, rng):
    check(ctx, "MatMul", [randn(rng, 3, 8, dtype=np.float16), randn(rng, 8, 5, dtype=np.float16)], tol=HALF)


@pytest.mark.parametrize("attrs, c_shape", [
    ({}, None), (dict(transB=1), (5,)), (dict(transA=1, transB=1, alpha=0.5, beta=2.0), (3, 5)),
    (dict(alpha=2.0, beta=0.0), (1, 5)), (dict(beta=0.5), ()), (dict(transA=1), (3, 1)),
])
def test_gemm(ctx, rng, attrs, c_shape):
    a = randn(rng, 4, 3) if attrs.get("transA") else randn(rng, 3, 4)
    b = randn(rng, 5, 4) if attrs.get("transB") else randn(rng, 4, 5)
    inputs = [a, b] + ([] if c_shape is None else [randn(rng, *c_shape)])
    check(ctx, "Gemm", inputs, attrs, version=13, tol=GEMM)


# -- element-wise ----------------------------------------------------------------------------------
UNARY_DOMAINS = {"Sqrt": (0.1, 4), "Log": (0.1, 4), "Reciprocal": (0.5, 3), "Asin": (-0.9, 0.9),
                 "Acos": (-0.9, 0.9), "Atanh": (-0.9, 0.9), "Acosh": (1.1, 4)}
UNARY_VERSIONS = {"Round": 11, "Sign": 13, "Erf": 13, "Gelu": 20, "Mish": 18, "HardSwish": 14, "Celu": 12,
                  "Shrink": 9}
UNARY = ["Abs", "Neg", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Sqrt", "Exp", "Log", "Sin", "Cos", "Tan",
         "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Erf", "Relu", "Sigmoid", "Tanh",
         "HardSigmoid", "HardSwish", "LeakyRelu", "Elu", "Selu", "Celu", "Softplus", "Softsign", "ThresholdedRelu",
         "Mish", "Shrink", "Gelu"]


def _unary_input(rng, op_type, dtype=np.float32):
    lo, hi = UNARY_DOMAINS.get(op_type, (-3, 3))
    x = rng.uniform(lo, hi, (3, 4, 5)).astype(dtype)
    if op_type == "Round":
        x[0, 0, :3] = np.array([0.5, 1.5, -2.5], dtype)  # halves round to even
    return x


@pytest.mark.parametrize("op_type", UNARY)
def test_unary(ctx, rng, op_type):
    check(ctx, op_type, [_unary_input(rng, op_type)], version=UNARY_VERSIONS.get(op_type, 17))


@pytest.mark.parametrize("op_type, attrs", [("LeakyRelu", dict(alpha=0.2)), ("Elu", dict(alpha=0.5)),
                                            ("HardSigmoid", dict(alpha=0.3, beta=0.4)),
                                            ("ThresholdedRelu", dict(alpha=0.5)), ("Celu", dict(alpha=2.0)),
                                            ("Gelu", dict(approximate="tanh")), ("Shrink", dict(lambd=1.0, bias=0.3)),
                                            ("Selu", dict(alpha=1.5, gamma=2.0))])
def test_activation_attributes(ctx, rng, op_type, attrs):
    check(ctx, op_type, [_unary_input(rng, op_type)], attrs, version=UNARY_VERSIONS.get(op_type, 17))


@pytest.mark.parametrize("op_type", ["Relu", "Sigmoid", "Tanh", "Exp", "Erf", "Gelu"])
def test_unary_float16(ctx, rng, op_type):
    check(ctx, op_type, [_unary_input(rng, op_type, np.float16)], version=UNARY_VERSIONS.get(op_type, 17), tol=HALF)


@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "Div", "Pow", "PRelu"])
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 5)), ((), (2, 2))])
def test_binary_broadcasting(ctx, rng, op_type, shapes):
    a, b = randn(rng, *shapes[0]), randn(rng, *shapes[1])
    if op_type == "Pow":
        a = np.abs(a) + np.float32(0.5)
    if op_type == "Div":
        b = np.where(np.abs(b) < 0.1, np.float32(1), b)
    if op_type == "PRelu" and a.ndim < b.ndim:
        a, b = b, a  # the slope broadcasts to x
    check(ctx, op_type, [a, b])


def test_pow_with_integer_exponent(ctx, rng):
    check(ctx, "Pow", [randn(rng, 3, 4), np.array(3, np.int64)])


def test_binary_float16(ctx, rng):
    check(ctx, "Add", [randn(rng, 2, 3, dtype=np.float16), randn(rng, 3, dtype=np.float16)], tol=HALF)
    check(ctx, "Mul", [randn(rng, 2, 3, dtype=np.float16), randn(rng, 2, 1, dtype=np.float16)], tol=HALF)


@pytest.mark.parametrize("op_type", ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"])
def test_comparisons(ctx, rng, op_type):
    a = np.round(randn(rng, 3, 4))
    b = np.round(randn(rng, 4))  # rounded so that ties exist
    check(ctx, op_type, [a, b])


@pytest.mark.parametrize("op_type", ["And", "Or", "Xor"])
def test_logic(ctx, rng, op_type):
    check(ctx, op_type, [rng.random((3, 4)) > 0.5, rng.random((4,)) > 0.5], version=7)


def test_not(ctx, rng):
    check(ctx, "Not", [rng.random((3, 4)) > 0.5], version=1)


@pytest.mark.parametrize("op_type", ["Sum", "Mean", "Max", "Min"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_variadic(ctx, rng, op_type, n):
    shapes = [(2, 3, 4), (3, 1), (4,)][:n]
    check(ctx, op_type, [randn(rng, *s) for s in shapes], version=13)


def test_where(ctx, rng):
    check(ctx, "Where", [rng.random((3, 4)) > 0.5, randn(rng, 3, 4), randn(rng, 4)])
    check(ctx, "Where", [rng.random((2, 1)) > 0.5, np.arange(4, dtype=np.int64), np.zeros((2, 4), np.int64)])


@pytest.mark.parametrize("version, attrs, bounds", [(6, dict(min=-0.5, max=0.7), []), (13, {}, [-0.5, 0.7]),
                                                    (13, {}, [None, 0.2]), (13, {}, [0.1]), (13, {}, [0.9, 0.1]),
                                                    (6, dict(min=-1.0), [])])
def test_clip(ctx, rng, version, attrs, bounds):
    inputs = [randn(rng, 3, 5)] + [None if v is None else np.array(v, np.float32) for v in bounds]
    check(ctx, "Clip", inputs, attrs, version=version)


@pytest.mark.parametrize("src, dst", [(np.int64, np.float32), (np.int32, np.float16), (np.bool_, np.float32),
                                      (np.float32, np.float16), (np.float16, np.float32)])
def test_cast(ctx, rng, src, dst):
    from onnx import helper

    x = (rng.standard_normal((3, 4)) * 5).astype(src) if src != np.bool_ else rng.random((3, 4)) > 0.5
    check(ctx, "Cast", [x], dict(to=helper.np_dtype_to_tensor_dtype(np.dtype(dst))), version=13)


# -- fused activations ----------------------------------------------------------------------------
@pytest.mark.parametrize("op_type", ["Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "Elu", "Gelu", "Clip"])
@pytest.mark.parametrize("fresh", [True, False])
def test_fused_activation(ctx, rng, op_type, fresh):
    assert can_fuse(op_type)
    x = randn(rng, 4, 6)
    act = make_layer(op_type, 3 if op_type == "Clip" else 1, version=20 if op_type == "Gelu" else 13)
    extras = [np.array(-0.25, np.float32), np.array(0.5, np.float32)] if op_type == "Clip" else []
    expected = ops.create(act)(x, *extras)[0]
    y = ctx.to_device(x)
    out = apply_activations(ctx, y, [(ops.create(act), extras)], fresh=fresh)
    np.testing.assert_allclose(to_host(out), expected, **ELEMENTWISE)
    if not fresh:  # not ours to overwrite: the producer's value must be intact
        np.testing.assert_array_equal(to_host(y), x)


def test_fused_activation_chain(ctx, rng):
    x = randn(rng, 5, 5)
    relu, clip = make_layer("Relu", 1), make_layer("Clip", 3, version=13)
    extras = [np.array(0.1, np.float32), np.array(0.6, np.float32)]
    out = apply_activations(ctx, ctx.to_device(x), [(ops.create(relu), []), (ops.create(clip), extras)], fresh=False)
    np.testing.assert_allclose(to_host(out), np.clip(np.maximum(x, 0), 0.1, 0.6), **ELEMENTWISE)


# -- reductions ------------------------------------------------------------------------------------
REDUCE = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op_type", REDUCE)
@pytest.mark.parametrize("axes, keepdims", [([1], 1), ([0, 2], 0), ([-1], 1), (None, 0)])
def test_reduce_axes_attribute(ctx, rng, op_type, axes, keepdims):
    x = rng.uniform(0.5, 1.5, (3, 4, 5)).astype(np.float32)  # positive: ReduceLogSum, small: ReduceProd
    attrs = {"keepdims": keepdims} | ({} if axes is None else {"axes": axes})
    check(ctx, op_type, [x], attrs, version=11)


@pytest.mark.parametrize("op_type", REDUCE)
def test_reduce_axes_input(ctx, rng, op_type):
    x = rng.uniform(0.5, 1.5, (2, 3, 4)).astype(np.float32)
    check(ctx, op_type, [x, np.array([0, -1], np.int64)], dict(keepdims=0), version=18)


def test_reduce_noop_with_empty_axes(ctx, rng):
    x = randn(rng, 2, 3)
    check(ctx, "ReduceSum", [x, np.array([], np.int64)], dict(noop_with_empty_axes=1), version=13)
    check(ctx, "ReduceMean", [x, None], dict(noop_with_empty_axes=0), version=18)


def test_reduce_float16(ctx, rng):
    check(ctx, "ReduceMean", [randn(rng, 4, 64, dtype=np.float16)], dict(axes=[1]), version=13, tol=HALF)


@pytest.mark.parametrize("op_type", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("attrs", [{}, dict(axis=1, keepdims=0), dict(axis=-1, select_last_index=1)])
def test_arg_reduce(ctx, rng, op_type, attrs):
    x = np.round(randn(rng, 3, 4, 5))  # ties: first vs last index matters
    check(ctx, op_type, [x], attrs, version=13)


# -- softmax and normalisation -----------------------------------------------------------------------
@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("version, axis", [(13, -1), (13, 1), (11, 1), (11, 2), (11, None), (13, None)])
def test_softmax(ctx, rng, op_type, version, axis):
    x = randn(rng, 2, 3, 4) * np.float32(5)
    check(ctx, op_type, [x], {} if axis is None else dict(axis=axis), version=version)


def test_softmax_float16(ctx, rng):
    check(ctx, "Softmax", [randn(rng, 3, 50, dtype=np.float16)], version=13, tol=HALF)


@pytest.mark.parametrize("axis, bias", [(-1, True), (1, True), (-2, False)])
def test_layer_normalization(ctx, rng, axis, bias):
    x = randn(rng, 2, 3, 8) * np.float32(3) + np.float32(1)
    norm_shape = x.shape[axis:]
    inputs = [x, randn(rng, *norm_shape)] + ([randn(rng, *norm_shape)] if bias else [])
    check(ctx, "LayerNormalization", inputs, dict(axis=axis, epsilon=1e-3), n_outputs=3)


def test_layer_normalization_float16(ctx, rng):
    x = randn(rng, 4, 16, dtype=np.float16)
    check(ctx, "LayerNormalization", [x, randn(rng, 16, dtype=np.float16), randn(rng, 16, dtype=np.float16)],
          n_outputs=1, tol=HALF)


def test_batch_normalization(ctx, rng):
    x = randn(rng, 2, 4, 5, 5)
    stats = [randn(rng, 4), randn(rng, 4), randn(rng, 4), rng.uniform(0.5, 2, 4).astype(np.float32)]
    check(ctx, "BatchNormalization", [x] + stats, dict(epsilon=1e-3), version=15)


def test_batch_normalization_folds_once_per_statistics(ctx, rng):
    layer = make_layer("BatchNormalization", 5, version=15)
    op = ops.create(layer)
    kernel = kernel_class(layer)(layer, op)
    stats = [ctx.to_device(v) for v in (randn(rng, 3), randn(rng, 3), randn(rng, 3),
                                        rng.uniform(0.5, 2, 3).astype(np.float32))]
    x = randn(rng, 1, 3, 2, 2)
    first = to_host(kernel(ctx, ctx.to_device(x), *stats)[0])
    folded = kernel._folded
    second = to_host(kernel(ctx, ctx.to_device(x), *stats)[0])
    assert kernel._folded is folded, "the same statistics must not be folded again"
    np.testing.assert_array_equal(first, second)
    other = [ctx.to_device(v) for v in (randn(rng, 3), randn(rng, 3), randn(rng, 3), np.ones(3, np.float32))]
    third = to_host(kernel(ctx, ctx.to_device(x), *other)[0])
    np.testing.assert_allclose(third, op(x, *[to_host(s) for s in other])[0], **ELEMENTWISE)


def test_instance_normalization(ctx, rng):
    check(ctx, "InstanceNormalization", [randn(rng, 2, 3, 4, 5), randn(rng, 3), randn(rng, 3)],
          dict(epsilon=1e-4), version=6)


@pytest.mark.parametrize("attrs", [dict(size=5, alpha=1e-4, beta=0.75, bias=1.0), dict(size=4, alpha=0.01, beta=0.5),
                                   dict(size=3, alpha=5e-4, beta=0.75, bias=2.0), dict(size=1)])
def test_lrn(ctx, rng, attrs):
    check(ctx, "LRN", [randn(rng, 2, 7, 4, 3) * np.float32(3)], attrs, version=13)


# -- pooling ---------------------------------------------------------------------------------------
POOL_CASES = {
    "3x3_s2_pad1": ((2, 3, 9, 9), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "2x2_s2": ((1, 2, 8, 8), dict(kernel_shape=[2, 2], strides=[2, 2])),
    "ceil_mode": ((1, 2, 8, 7), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    "ceil_mode_pads": ((1, 2, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 0, 0], ceil_mode=1)),
    "same_upper": ((1, 2, 7, 7), dict(kernel_shape=[3, 2], strides=[2, 1], auto_pad="SAME_UPPER")),
    "asymmetric_pads": ((1, 3, 5, 6), dict(kernel_shape=[2, 3], pads=[0, 1, 1, 2])),
    "global_7x7": ((2, 4, 7, 7), dict(kernel_shape=[7, 7])),
    "pool1d": ((2, 3, 10), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    "pool3d": ((1, 2, 4, 5, 6), dict(kernel_shape=[2, 2, 3], strides=[2, 1, 2])),
}


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_max_pool(ctx, rng, case):
    shape, attrs = POOL_CASES[case]
    check(ctx, "MaxPool", [randn(rng, *shape)], attrs, version=12)


def test_max_pool_dilated(ctx, rng):
    check(ctx, "MaxPool", [randn(rng, 1, 2, 9, 9)], dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[2, 2, 2, 2]),
          version=12)


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("case", list(POOL_CASES))
def test_average_pool(ctx, rng, case, count_include_pad):
    shape, attrs = POOL_CASES[case]
    check(ctx, "AveragePool", [randn(rng, *shape)], dict(attrs, count_include_pad=count_include_pad), version=19)


def test_pool_float16(ctx, rng):
    x = randn(rng, 1, 2, 6, 6, dtype=np.float16)
    check(ctx, "MaxPool", [x], dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]), version=12, tol=HALF)
    check(ctx, "AveragePool", [x], dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]), version=19, tol=HALF)


@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 4, 6), (1, 2, 3, 3, 2)])
def test_global_pool(ctx, rng, op_type, shape):
    check(ctx, op_type, [randn(rng, *shape)], version=1)


# -- data movement ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, target, attrs", [((2, 3, 4), [4, -1], {}), ((2, 3, 4), [0, 12], {}),
                                                  ((2, 3, 4), [2, 0, 2, 2], {}), ((0, 3), [3, 0], dict(allowzero=1))])
def test_reshape(ctx, rng, shape, target, attrs):
    check(ctx, "Reshape", [randn(rng, *shape), np.array(target, np.int64)], attrs, version=14)


def test_reshape_of_int64_values(ctx):
    check(ctx, "Reshape", [np.arange(12, dtype=np.int64), np.array([3, 4], np.int64)], version=14)


def test_reshape_error_names_the_layer(ctx, rng):
    with pytest.raises(ExecutionError, match="reshape_layer.*cannot reshape"):
        check(ctx, "Reshape", [randn(rng, 2, 3), np.array([4, 4], np.int64)], version=14)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_flatten(ctx, rng, axis):
    check(ctx, "Flatten", [randn(rng, 2, 3, 4)], dict(axis=axis), version=13)


def test_squeeze_unsqueeze(ctx, rng):
    x = randn(rng, 1, 3, 1, 4)
    check(ctx, "Squeeze", [x, np.array([0, -2], np.int64)], version=13)
    check(ctx, "Squeeze", [x], version=13)
    check(ctx, "Squeeze", [x], dict(axes=[2]), version=11)
    check(ctx, "Unsqueeze", [randn(rng, 3, 4), np.array([0, -1], np.int64)], version=13)
    check(ctx, "Unsqueeze", [randn(rng, 3, 4)], dict(axes=[1]), version=11)


@pytest.mark.parametrize("perm", [None, [0, 2, 1, 3, 4], [4, 3, 2, 1, 0]])
def test_transpose(ctx, rng, perm):
    check(ctx, "Transpose", [randn(rng, 2, 3, 4, 1, 5)], {} if perm is None else dict(perm=perm))


def test_concat(ctx, rng):
    check(ctx, "Concat", [randn(rng, 2, 3, 4), randn(rng, 2, 5, 4), randn(rng, 2, 1, 4)], dict(axis=1), version=13)
    check(ctx, "Concat", [randn(rng, 2, 3), randn(rng, 2, 2)], dict(axis=-1), version=13)


@pytest.mark.parametrize("version, attrs, split, n", [(13, dict(axis=1), [2, 4], 2), (13, dict(axis=-1), None, 3),
                                                      (11, dict(axis=0, split=[1, 1]), None, 2),
                                                      (18, dict(axis=1, num_outputs=4), None, 4)])
def test_split(ctx, rng, version, attrs, split, n):
    inputs = [randn(rng, 2, 6, 5)] + ([] if split is None else [np.array(split, np.int64)])
    check(ctx, "Split", inputs, attrs, version=version, n_outputs=n)


@pytest.mark.parametrize("starts, ends, axes, steps", [([1], [3], [0], None), ([0, -1], [2, -4], [1, 2], [1, -1]),
                                                       ([10], [-100], [1], [-2]), ([-3], [1000], None, None)])
def test_slice(ctx, rng, starts, ends, axes, steps):
    inputs = [randn(rng, 4, 5, 6), np.array(starts, np.int64), np.array(ends, np.int64),
              None if axes is None else np.array(axes, np.int64), None if steps is None else np.array(steps, np.int64)]
    while inputs[-1] is None:
        inputs.pop()
    check(ctx, "Slice", inputs, version=13)


def test_slice_version1_attributes(ctx, rng):
    check(ctx, "Slice", [randn(rng, 4, 5)], dict(starts=[1, 0], ends=[3, -1], axes=[0, 1]), version=1)


@pytest.mark.parametrize("axis, indices", [(0, [2, 0, -1]), (1, [[0, 1], [-2, 3]]), (-1, 2), (0, [])])
def test_gather(ctx, rng, axis, indices):
    check(ctx, "Gather", [randn(rng, 4, 5, 3), np.array(indices, np.int64)], dict(axis=axis), version=13)


def test_gather_int32_indices_and_embedding_rows(ctx, rng):
    check(ctx, "Gather", [randn(rng, 10, 8), np.array([[1, 9, 3]], np.int32)], version=13)


def test_gather_out_of_range_is_an_execution_error(ctx, rng):
    with pytest.raises(ExecutionError, match="out of range"):
        check(ctx, "Gather", [randn(rng, 3, 2), np.array([3], np.int64)], version=13)


def test_gather_reuses_the_device_copy_of_constant_indices(ctx, rng):
    layer = make_layer("Gather", 2, version=13)
    kernel = kernel_class(layer)(layer, ops.create(layer))
    uploads = []
    counting = type(ctx)(xp=ctx.xp, to_device=lambda a: uploads.append(a) or ctx.to_device(a), erf=ctx.erf)
    data, idx = ctx.to_device(randn(rng, 5, 2)), np.array([4, 1], np.int64)
    first = to_host(kernel(counting, data, idx)[0])
    second = to_host(kernel(counting, data, idx)[0])
    assert len(uploads) == 1
    np.testing.assert_array_equal(first, second)
    kernel(counting, data, np.array([0], np.int64))  # other indices: copied again
    assert len(uploads) == 2


@pytest.mark.parametrize("shape, target", [((3, 1), [2, 3, 4]), ((1, 4), [3, 1]), ((), [2, 2])])
def test_expand(ctx, rng, shape, target):
    check(ctx, "Expand", [randn(rng, *shape), np.array(target, np.int64)], version=13)


def test_tile(ctx, rng):
    check(ctx, "Tile", [randn(rng, 2, 3), np.array([2, 3], np.int64)], version=13)


@pytest.mark.parametrize("mode, pads, value", [("constant", [1, 0, 2, 1], 1.5), ("constant", [0, -1, 1, 2], None),
                                               ("reflect", [2, 1, 1, 2], None), ("edge", [1, 2, 0, 3], None)])
def test_pad(ctx, rng, mode, pads, value):
    inputs = [randn(rng, 4, 5), np.array(pads, np.int64)] + ([] if value is None else [np.array(value, np.float32)])
    check(ctx, "Pad", inputs, dict(mode=mode), version=13)


def test_pad_version2_attributes(ctx, rng):
    check(ctx, "Pad", [randn(rng, 3, 4)], dict(pads=[1, 1, 0, 2], value=-2.0), version=2)


@pytest.mark.parametrize("op_type, mode", [("DepthToSpace", "DCR"), ("DepthToSpace", "CRD"), ("SpaceToDepth", "DCR")])
def test_block_rearrangement(ctx, rng, op_type, mode):
    x = randn(rng, 2, 8, 3, 3) if op_type == "DepthToSpace" else randn(rng, 2, 2, 4, 6)
    attrs = dict(blocksize=2) | ({"mode": mode} if op_type == "DepthToSpace" else {})
    check(ctx, op_type, [x], attrs, version=13)


def test_identity_and_dropout(ctx, rng):
    x = randn(rng, 3, 4)
    check(ctx, "Identity", [x], version=16)
    check(ctx, "Dropout", [x], dict(ratio=0.5), version=9, n_outputs=2)  # mask: same type before opset 10
    check(ctx, "Dropout", [x], version=13, n_outputs=2, out_types={1: np.dtype(bool)})


# -- refusals (these layers fall back to the CPU) ---------------------------------------------------
def _accepts(op_type, types, n_inputs=1, attrs=None, version=17, n_outputs=1):
    layer = make_layer(op_type, n_inputs, attrs, version, n_outputs)
    return kernel_class(layer).accepts(layer, ops.create(layer), types, host_inputs(layer))


def test_refuses_unsupported_types():
    f32, f64, i64 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64)
    assert _accepts("Relu", {"i0": f32, "o0": f32})
    assert not _accepts("Relu", {"i0": f64, "o0": f64}), "float64 is not a device type"
    assert not _accepts("Relu", {"i0": None, "o0": f32}), "an unknown type must be refused"
    assert not _accepts("Add", {"i0": i64, "i1": i64, "o0": i64}, 2), "integer math stays on the CPU"
    assert not _accepts("Add", {"i0": f32, "i1": np.dtype(np.float16), "o0": f32}, 2)
    assert _accepts("Reshape", {"i0": i64, "o0": i64}, 2, version=14), "data movement carries int64"
    assert not _accepts("Reshape", {"i0": f64, "o0": f64}, 2, version=14)
    assert not _accepts("Conv", {"i0": f64, "i1": f64, "o0": f64}, 2)
    assert not _accepts("Gather", {"i0": f32, "i1": None, "o0": f32}, 2, version=13)


def test_refuses_unsupported_attribute_combinations():
    f32 = np.dtype(np.float32)
    types = {"i0": f32, "i1": f32, "o0": f32, "o1": np.dtype(np.int64)}
    assert not _accepts("MaxPool", types, attrs=dict(kernel_shape=[2, 2]), version=12, n_outputs=2), \
        "MaxPool's Indices output is not computed on the device"
    assert not _accepts("Add", types, 2, attrs=dict(broadcast=1, axis=0), version=6), "legacy axis broadcast"
    assert not _accepts("Cast", {"i0": f32, "o0": np.dtype(np.int64)}, attrs=dict(to=7), version=13)
    assert not _accepts("LayerNormalization", types, 2, attrs=dict(stash_type=11))
    assert not _accepts("Pad", {"i0": f32, "o0": f32}, 2, attrs=dict(mode="wrap"), version=19)
    assert not _accepts("Dropout", {"i0": f32, "i1": f32, "i2": np.dtype(bool), "o0": f32}, 3, version=13), \
        "a training_mode input may be true at run time"


def test_kernel_table_covers_the_light_models_and_transformer_ops():
    needed = {"Conv", "Relu", "LRN", "MaxPool", "AveragePool", "GlobalAveragePool", "Concat", "Reshape",
              "Transpose", "Gemm", "Softmax", "Sum", "Add", "Mul", "BatchNormalization", "Dropout",
              "MatMul", "LayerNormalization", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather", "Where",
              "ReduceMean", "ReduceSum", "Sub", "Div", "Pow", "Sqrt", "Erf", "Tanh", "Cast", "Split", "Expand"}
    assert needed <= set(SUPPORTED_OPS), needed - set(SUPPORTED_OPS)


# -- fused epilogues: a layer's last step and its activations -----------------------------------------
def _activation(op_type, version=13, **attrs):
    return ops.create(make_layer(op_type, 3 if op_type == "Clip" else 1, attrs, version=version))


CHAINS = {
    "relu": [(_activation("Relu"), [])],
    "relu6": [(_activation("Clip"), [np.array(0, np.float32), np.array(6, np.float32)])],
    "clip_attrs": [(_activation("Clip", version=6, min=-0.5, max=0.5), [])],
    "leaky_sigmoid": [(_activation("LeakyRelu", alpha=0.2), []), (_activation("Sigmoid"), [])],
    "tanh": [(_activation("Tanh"), [])],
    "gelu": [(_activation("Gelu", version=20), [])],
}


def _apply_cpu(y, chain):
    for op, extras in chain:
        y = op(y, *extras)[0]
    return y


def _run_with_activations(ctx, op_type, inputs, chain, attrs=None, version=17):
    layer = make_layer(op_type, len(inputs), attrs, version)
    op = ops.create(layer)
    kernel = kernel_class(layer)(layer, op)
    assert kernel.takes_activations
    device = [ctx.to_device(x) for x in inputs]
    got = to_host(kernel(ctx, *device, activations=chain)[0])
    for d, x in zip(device, inputs):
        np.testing.assert_array_equal(to_host(d), x, err_msg="an input was overwritten")
    return got, _apply_cpu(op(*inputs)[0], chain)


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("bias", [True, False])
def test_conv_with_activations(ctx, rng, chain, bias):
    inputs = [randn(rng, 2, 3, 6, 6), randn(rng, 4, 3, 3, 3)] + ([randn(rng, 4)] if bias else [])
    got, want = _run_with_activations(ctx, "Conv", inputs, CHAINS[chain], dict(pads=[1, 1, 1, 1]))
    np.testing.assert_allclose(got, want, **GEMM)


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("c_shape, beta", [((5,), 1.0), ((3, 5), 0.5), (None, 1.0)])
def test_gemm_with_activations(ctx, rng, chain, c_shape, beta):
    inputs = [randn(rng, 3, 4), randn(rng, 5, 4)] + ([] if c_shape is None else [randn(rng, *c_shape)])
    got, want = _run_with_activations(ctx, "Gemm", inputs, CHAINS[chain], dict(transB=1, beta=beta), version=13)
    np.testing.assert_allclose(got, want, **GEMM)


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("op_type, shapes", [("Add", [(2, 3, 4), (3, 1)]), ("Sum", [(2, 3, 4), (2, 3, 4)]),
                                             ("Sum", [(3, 4), (4,), (3, 4)]), ("Mul", [(3, 4), (4,)]),
                                             ("Max", [(3, 4), (3, 4)])])
def test_elementwise_with_activations(ctx, rng, chain, op_type, shapes):
    inputs = [randn(rng, *s) * np.float32(3) for s in shapes]
    got, want = _run_with_activations(ctx, op_type, inputs, CHAINS[chain], version=13)
    np.testing.assert_allclose(got, want, **ELEMENTWISE)


def test_epilogue_uses_the_fused_kernel_when_the_device_has_one(rng):
    """The wiring, with a stand-in for the CUDA fuser: Conv and Gemm fuse in place into their own
    fresh output; Add and Sum into a new buffer; a chain the fuser declines runs op by op."""
    from asyncinfer.backends.cupy.kernels import KernelContext

    base = HostRuntime().start()
    calls = []

    def fuse(x, b, activations, out):
        calls.append((x, b, out))
        if any(op.op_type == "Gelu" for op, _ in activations):
            return None  # declined: the caller must fall back
        y = x + b if b is not None else x.copy()
        y = _apply_cpu(y, activations)
        if out is not None:
            out[...] = y
            return out
        return y

    ctx = KernelContext(xp=np, to_device=base.to_device, erf=base.erf, fuse=fuse)
    got, want = _run_with_activations(ctx, "Conv", [randn(rng, 1, 2, 5, 5), randn(rng, 3, 2, 3, 3), randn(rng, 3)],
                                      CHAINS["relu"], dict(pads=[1, 1, 1, 1]))
    np.testing.assert_allclose(got, want, **GEMM)
    x, b, out = calls[-1]
    assert out is x and b.shape == (3, 1, 1), "Conv fuses bias + activation into its own output"
    got, want = _run_with_activations(ctx, "Add", [randn(rng, 3, 4), randn(rng, 4)], CHAINS["relu6"], version=13)
    np.testing.assert_allclose(got, want, **ELEMENTWISE)
    assert calls[-1][2] is None, "Add must not overwrite its inputs"
    n = len(calls)
    got, want = _run_with_activations(ctx, "Sum", [randn(rng, 3, 4)] * 2, CHAINS["gelu"], version=13)
    np.testing.assert_allclose(got, want, **ELEMENTWISE)
    assert len(calls) == n + 1
    _run_with_activations(ctx, "Gemm", [randn(rng, 2, 3), randn(rng, 3, 4)], [], version=13)
    assert len(calls) == n + 1, "nothing to fuse without activations"


def test_fusion_code_generation():
    """The fused epilogue's CUDA C comes from the element-wise table (ops/pointwise.py)."""
    from asyncinfer.backends.cupy.fusion import chain_code

    assert chain_code(CHAINS["relu"]) == "v = (ai_relu(v));"
    assert chain_code(CHAINS["relu6"]) == "v = (ai_min(ai_max(v, 0.0f), 6.0f));"
    assert chain_code(CHAINS["leaky_sigmoid"]) == ("v = (ai_pick(ai_ge(v, 0.0f), v, 0.20000000298023224f * v)); "
                                                   "v = (1.0f / (1.0f + ai_exp(-v)));")
    assert chain_code(CHAINS["gelu"]) == "v = (0.5f * v * (1.0f + ai_erf_(v * 0.7071067811865476f)));"
    lowest = [(_activation("Clip"), [np.array(-np.inf, np.float32), np.array(1, np.float32)])]
    assert chain_code(lowest) == "v = (ai_min(v, 1.0f));", "an infinite lower bound changes nothing"
    assert chain_code([(_activation("Clip"), [np.array(np.nan, np.float32)])]) == \
        "v = (ai_max(v, __int_as_float(0x7fc00000)));"


@pytest.mark.parametrize("chain", ["relu", "relu6", "gelu"])
def test_batch_normalization_with_activations(ctx, rng, chain):
    inputs = [randn(rng, 2, 4, 3, 3), randn(rng, 4), randn(rng, 4), randn(rng, 4),
              rng.uniform(0.5, 2, 4).astype(np.float32)]
    got, want = _run_with_activations(ctx, "BatchNormalization", inputs, CHAINS[chain], version=15)
    np.testing.assert_allclose(got, want, **ELEMENTWISE)
