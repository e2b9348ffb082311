"""gpu_pixel kernels for MatMul, Gemm, Softmax/LogSoftmax, LayerNormalization, RMSNormalization
and the Reduce ops, each checked against the CPU backend on the same one-node model.

Shapes are picked to reach every path of the kernels: K and N that are not multiples of 4 (the
unrolled tail, the padding lanes), split-K products (a long K over few output texels), NCHW
operands (channel-blocked layouts that need a copy into rows), constant and runtime B, and for the
folds the blocked, inner and generic walks. Tolerances: float32 sums in another order than BLAS
or NumPy, so rtol 1e-4 for products and normalisations, 1e-5 for the rest.
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import helper
from pixel_testing import assert_close, one_node_model, run_both

RNG = np.random.default_rng(1234)

PRODUCT_TOL = dict(rtol=1e-4, atol=1e-5)
LONG_K_TOL = dict(rtol=1e-4, atol=1e-4)
FOLD_TOL = dict(rtol=1e-5, atol=1e-5)
NORM_TOL = dict(rtol=1e-4, atol=1e-5)


def normal(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def check(op_type: str, inputs: list, attrs: dict | None = None, *, tol: dict, opset: int = 17,
          constants: dict | None = None, n_outputs: int = 1) -> None:
    """Run a one-node model on gpu_pixel and on cpu (inputs in ``constants`` become initializers)."""
    model = one_node_model(op_type, inputs, attrs, opset=opset, n_outputs=n_outputs, constants=constants)
    feeds = {f"i{k}": x for k, x in enumerate(inputs) if x is not None and k not in (constants or {})}
    got, expected, _ = run_both(model, feeds)
    assert_close(got, expected, **tol)


# -- MatMul -------------------------------------------------------------------------------------------
MATMUL_SHAPES = [
    ((3, 5), (5, 7)),            # K and N not multiples of 4
    ((4, 13), (13, 6)),
    ((2, 3, 8), (8, 4)),         # batched A, shared B, no tails
    ((2, 3, 4, 5), (2, 3, 5, 9)),  # rank 4: channel-blocked operands are copied into rows
    ((2, 1, 3, 9), (4, 9, 5)),   # batch broadcasting on both sides
    ((3, 9), (2, 9, 5)),         # 2-D A against a batched B
    ((7,), (7, 3)),              # 1-D A
    ((7,), (2, 7, 3)),
    ((2, 3, 7), (7,)),           # 1-D B
    ((5,), (5,)),                # dot product: a scalar
    ((1, 300), (300, 10)),       # split-K, two chunks
    ((2, 3, 515), (515, 6)),     # split-K over a batch, K % 4 = 3 in the last chunk
]


@pytest.mark.parametrize("constant_b", [False, True], ids=["runtime_b", "constant_b"])
@pytest.mark.parametrize("a_shape,b_shape", MATMUL_SHAPES, ids=[f"{a}x{b}" for a, b in MATMUL_SHAPES])
def test_matmul(a_shape, b_shape, constant_b):
    a, b = normal(*a_shape), normal(*b_shape)
    check("MatMul", [a, b], tol=PRODUCT_TOL, constants={1: b} if constant_b else None)


def test_matmul_long_k_split():
    # 1030 = 257 k-steps of 4 and a tail of 2: eight chunks, the tail in the last one
    a, b = normal(1, 1030), normal(1030, 13)
    check("MatMul", [a, b], tol=LONG_K_TOL, constants={1: b})


# -- Gemm -----------------------------------------------------------------------------------------------
C_SHAPES = [None, (), (5,), (1, 5), (3, 1), (3, 5)]


@pytest.mark.parametrize("constant_b", [False, True], ids=["runtime_b", "constant_b"])
@pytest.mark.parametrize("c_shape", C_SHAPES, ids=[f"C{s}" for s in C_SHAPES])
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([0, 1], repeat=2)))
def test_gemm(trans_a, trans_b, c_shape, constant_b):
    m, k, n = 3, 7, 5
    a = normal(*((k, m) if trans_a else (m, k)))
    b = normal(*((n, k) if trans_b else (k, n)))
    inputs = [a, b] + ([] if c_shape is None else [normal(*c_shape)])
    attrs = dict(transA=trans_a, transB=trans_b, alpha=0.5, beta=2.0)
    check("Gemm", inputs, attrs, tol=PRODUCT_TOL, constants={1: b} if constant_b else None)


@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (-1.5, 0.0), (1.0, 0.25)])
def test_gemm_alpha_beta_constant_c(alpha, beta):
    a, b, c = normal(6, 11), normal(9, 11), normal(9)
    check("Gemm", [a, b, c], dict(transB=1, alpha=alpha, beta=beta), tol=PRODUCT_TOL, constants={1: b, 2: c})


def test_gemm_classifier_shape_split_k():
    # a batch-1 classifier layer (vgg-like, scaled down): constant B with transB, bias, split K
    a, b, c = normal(1, 2050), normal(37, 2050, scale=0.05), normal(37)
    check("Gemm", [a, b, c], dict(transB=1), tol=LONG_K_TOL, constants={1: b, 2: c})


def _two_node_model(op_type: str, inputs: list, attrs: dict, constants: dict) -> onnx.ModelProto:
    """``op_type`` followed by a Relu, which the optimizer fuses into it (the ``post`` path)."""
    model = one_node_model(op_type, inputs, attrs, constants=constants)
    graph = model.graph
    graph.node[0].output[0] = "pre"
    graph.node.append(helper.make_node("Relu", ["pre"], ["o0"]))
    del graph.value_info[:]
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("a_shape,b_shape", [((3, 7), (5, 7)), ((1, 1030), (6, 1030))], ids=["direct", "split_k"])
def test_gemm_fused_relu(a_shape, b_shape):
    a, b, c = normal(*a_shape), normal(*b_shape), normal(b_shape[0])
    model = _two_node_model("Gemm", [a, b, c], dict(transB=1), {1: b})
    got, expected, worker = run_both(model, {"i0": a, "i2": c})
    assert_close(got, expected, **LONG_K_TOL)
    assert (got["o0"] >= 0).all()


# -- Softmax and LogSoftmax ---------------------------------------------------------------------------
SOFTMAX_CASES = [((7,), 0), ((3, 5), -1), ((3, 5), 0), ((2, 3, 7), -1), ((2, 3, 7), 1), ((2, 3, 7), 0),
                 ((2, 6, 3, 5), 1), ((2, 6, 3, 5), -1), ((2, 6, 3, 5), 2)]


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape,axis", SOFTMAX_CASES, ids=[f"{s}-axis{a}" for s, a in SOFTMAX_CASES])
def test_softmax(shape, axis, op_type, opset):
    # all negative: a padding lane leaking into the maximum would read as 0
    x = -np.abs(normal(*shape, scale=3.0)) - 0.5
    check(op_type, [x], dict(axis=axis), tol=FOLD_TOL, opset=opset)


def test_softmax_default_axis_per_opset():
    x = normal(2, 3, 5, scale=2.0)
    check("Softmax", [x], None, tol=FOLD_TOL, opset=11)  # rows of 3·5 values
    check("Softmax", [x], None, tol=FOLD_TOL, opset=13)  # rows of 5 values


def test_softmax_classifier_row():
    x = normal(1, 1000, scale=4.0)
    check("Softmax", [x], dict(axis=-1), tol=FOLD_TOL, opset=13)


# -- LayerNormalization and RMSNormalization -----------------------------------------------------------
NORM_CASES = [((3, 5), -1), ((2, 3, 7), -1), ((2, 3, 7), 1), ((2, 3, 8), -2), ((2, 6, 3, 5), -1),
              ((2, 6, 3, 5), 1)]


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape,axis", NORM_CASES, ids=[f"{s}-axis{a}" for s, a in NORM_CASES])
def test_layernorm(shape, axis, with_bias):
    x = normal(*shape, scale=2.0) + 3.0  # an offset mean: the variance must be taken centred
    scale, bias = normal(*shape[axis:]), normal(*shape[axis:])
    check("LayerNormalization", [x, scale, bias if with_bias else None], dict(axis=axis, epsilon=1e-3),
          tol=NORM_TOL)


@pytest.mark.parametrize("shape,axis", [((2, 3, 7), -1), ((2, 6, 3, 5), 2)])
def test_layernorm_mean_and_invstddev_outputs(shape, axis):
    x, scale = normal(*shape) + 1.0, normal(*shape[axis:])
    check("LayerNormalization", [x, scale, normal(*shape[axis:])], dict(axis=axis), tol=NORM_TOL, n_outputs=3)


def test_layernorm_constant_scale_broadcast():
    x = normal(2, 4, 6)
    scale, bias = normal(6), normal(6)
    check("LayerNormalization", [x, scale, bias], dict(axis=1), tol=NORM_TOL, constants={1: scale, 2: bias})


@pytest.mark.parametrize("shape,axis", [((3, 5), -1), ((2, 3, 7), 1), ((2, 6, 3, 5), -1)])
def test_rmsnorm(shape, axis):
    x, scale = normal(*shape, scale=2.0), normal(*shape[axis:])
    check("RMSNormalization", [x, scale], dict(axis=axis, epsilon=1e-4), tol=NORM_TOL, opset=23)


# -- Reduce ops ---------------------------------------------------------------------------------------------
REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceSumSquare", "ReduceLogSumExp", "ReduceLogSum"]
# (shape, axes, keepdims): NCHW spatial (inner walk), channels (blocked), last axis of NCHW and
# mixed axes (generic), rows of a 2-D/3-D tensor (blocked, with padding lanes), everything
REDUCE_CASES = [((2, 6, 3, 5), [2, 3], 1), ((2, 6, 3, 5), [1], 0), ((2, 6, 3, 5), [-1, 1], 1),
                ((3, 5), [1], 0), ((2, 3, 7), [0, 2], 1), ((2, 3, 7), None, 0)]


def reduce_input(op_type: str, shape: tuple[int, ...]) -> np.ndarray:
    """Values the op is well defined on; Max reads negatives and Min positives, so a padding lane
    (0) leaking in would show."""
    magnitude = RNG.uniform(0.5, 1.5, shape).astype(np.float32)
    if op_type == "ReduceMax":
        return -magnitude
    if op_type in ("ReduceSum", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp", "ReduceMean"):
        return magnitude * RNG.choice([-1.0, 1.0], shape).astype(np.float32)
    return magnitude


@pytest.mark.parametrize("shape,axes,keepdims", REDUCE_CASES, ids=[f"{s}-{a}-k{k}" for s, a, k in REDUCE_CASES])
@pytest.mark.parametrize("op_type", REDUCE_OPS)
def test_reduce_axes_input(op_type, shape, axes, keepdims):
    x = reduce_input(op_type, shape)
    axes_value = None if axes is None else np.array(axes, np.int64)
    check(op_type, [x, axes_value], dict(keepdims=keepdims), tol=FOLD_TOL, opset=18,
          constants=None if axes is None else {1: axes_value})


@pytest.mark.parametrize("op_type", REDUCE_OPS)
def test_reduce_axes_attribute(op_type):
    x = reduce_input(op_type, (2, 6, 3, 5))
    opset = 11 if op_type == "ReduceSum" else 13
    check(op_type, [x], dict(axes=[0, 3], keepdims=0), tol=FOLD_TOL, opset=opset)


@pytest.mark.parametrize("noop", [0, 1])
def test_reduce_empty_axes(noop):
    x = normal(2, 3, 5)
    empty = np.array([], np.int64)
    check("ReduceSum", [x, empty], dict(noop_with_empty_axes=noop, keepdims=1), tol=FOLD_TOL, opset=18,
          constants={1: empty})


def test_reduce_runtime_axes_input():
    # axes computed on the host at run time (a graph input rather than an initializer)
    x, axes = normal(2, 6, 3, 5), np.array([1, 2], np.int64)
    check("ReduceMean", [x, axes], dict(keepdims=0), tol=FOLD_TOL, opset=18)
