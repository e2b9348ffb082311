"""Kernels of asyncinfer/ops/{elementwise,activation,reduce,softmax}.py.

Every ONNX backend node test case made only of these ops runs through the whole engine on every
backend (tests/node_cases.py); here their data also runs through the kernels alone, checking that
inputs stay unwritten and narrow floats come out exact. Targeted tests cover what the cases do not:
old-opset semantics, dtype preservation, input immutability and refusal of unimplemented attributes.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from asyncinfer import ops
from asyncinfer.errors import UnsupportedOperatorError
from asyncinfer.model.ir import Layer
from asyncinfer.ops.elementwise import _erf_float64, erf_float32
from node_cases import cases_made_of, cases_using, expected_failures_among, node_case
from op_testing import evaluate_with_kernels, to_array

# These tests call kernels directly, on inputs with inf and NaN; the engine's threads run kernels
# with NumPy's floating-point warnings off (ops/base.py), and so do these tests.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

UNARY_MATH = """Abs Neg Reciprocal Floor Ceil Round Sign Sqrt Exp Log Sin Cos Tan Asin Acos Atan Sinh Cosh
    Asinh Acosh Atanh Erf""".split()
ACTIVATIONS = """Relu Sigmoid Tanh HardSigmoid HardSwish LeakyRelu Elu Selu Celu Gelu Softplus Softsign
    ThresholdedRelu Mish Shrink""".split()
OPS = set(UNARY_MATH + ACTIVATIONS + """Add Sub Mul Div Pow Mod BitShift Equal Less LessOrEqual Greater
    GreaterOrEqual And Or Xor Not BitwiseAnd BitwiseOr BitwiseXor BitwiseNot IsNaN IsInf Sum Mean Max Min
    Where Clip Cast CastLike Identity PRelu ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1
    ReduceL2 ReduceLogSum ReduceLogSumExp ReduceSumSquare ArgMax ArgMin CumSum Softmax LogSoftmax
    Hardmax""".split())

# The kernel checks below feed the node cases' inputs as arrays: these cases' are not arrays.
NOT_ARRAYS = {
    "test_identity_sequence": "the input is a tensor sequence",
    "test_identity_opt": "the input is an optional sequence",
}


# Function-expanded cases also feed constants through Constant nodes (kernel written elsewhere).
HELPERS = {"Constant"}


def _own_cases() -> list[str]:
    """Node cases made of this file's ops (plus HELPERS); mixed graphs belong to other tests."""
    return sorted(cases_made_of(OPS | HELPERS).keys() & cases_using(OPS).keys())


def _skip_without_helpers(case) -> None:
    missing = {n.op_type for n in case.model.graph.node} - OPS - {op for _, op in ops.registered()}
    if missing:
        pytest.skip(f"{', '.join(sorted(missing))} kernel not registered")


def _is_ml_float(dtype: np.dtype) -> bool:
    try:
        return dtype.kind == "V" and ml_dtypes.finfo(dtype) is not None
    except ValueError:
        return False


def _narrow_float_cases() -> list[str]:
    """Own cases with an ml_dtypes float output (bfloat16, float8…)."""
    return [n for n in _own_cases() if n not in NOT_ARRAYS
            and any(_is_ml_float(to_array(e).dtype) for e in node_case(n).data_sets[0][1])]


def test_node_case_selection() -> None:
    """These cases run through the whole engine on every backend (tests/node_cases.py): none is
    expected to fail; the kernel checks below leave out only the ones whose inputs are not arrays."""
    names = _own_cases()
    assert len(names) >= 700
    assert not expected_failures_among(names)
    assert set(NOT_ARRAYS) <= set(names)
    assert _narrow_float_cases()


@pytest.mark.parametrize("name", _narrow_float_cases())
def test_narrow_float_node_case_is_exact(name: str) -> None:
    """The kernels' ml_dtypes float outputs equal the expected ones exactly, sign of zero included
    (stricter than the harness's rtol/atol): compared as float32, where NaN == NaN holds."""
    case = node_case(name)
    _skip_without_helpers(case)
    for inputs, expected in case.data_sets:
        for got, want in zip(evaluate_with_kernels(case.model, inputs), expected, strict=True):
            want = to_array(want)
            assert got.dtype == want.dtype and got.shape == want.shape
            g, w = got.astype(np.float32), want.astype(np.float32)
            np.testing.assert_array_equal(g, w, err_msg=case.name)
            np.testing.assert_array_equal(np.signbit(g), np.signbit(w), err_msg=case.name)


@pytest.mark.parametrize("name", [n for n in _own_cases() if n not in NOT_ARRAYS])
def test_node_case_does_not_mutate_inputs(name: str) -> None:
    """Inputs are read-only arrays: any in-place write in a kernel raises."""
    case = node_case(name)
    _skip_without_helpers(case)
    inputs = [np.array(to_array(v)) for v in case.data_sets[0][0]]  # np.array: scalars too
    for a in inputs:
        a.flags.writeable = False
    evaluate_with_kernels(case.model, inputs)


# --------------------------------------------------------------------------------------------
def make(op_type: str, opset: int, **attrs) -> ops.Op:
    return ops.create(Layer(name="n", op_type=op_type, inputs=[], outputs=[], attrs=attrs, version=opset))


def run1(op_type: str, opset: int, *inputs, **attrs) -> np.ndarray:
    (out,) = make(op_type, opset, **attrs)(*inputs)
    return out


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("op_type", UNARY_MATH + ACTIVATIONS + ["Softmax", "LogSoftmax", "Hardmax"])
def test_float_dtype_is_preserved(op_type: str, dtype) -> None:
    x = np.array([[0.25, -0.5, 0.75]], dtype=dtype)
    out = run1(op_type, 22 if op_type not in ("Gelu",) else 20, x)
    assert out.dtype == np.dtype(dtype) and out.shape == x.shape


def test_integer_dtypes_are_preserved() -> None:
    a, b = np.array([7, -7, 7, -7], np.int32), np.array([2, 2, -2, -2], np.int32)
    np.testing.assert_array_equal(run1("Div", 14, a, b), [3, -3, -3, 3])  # truncation, like C
    assert run1("Div", 14, a, b).dtype == np.int32
    assert run1("Sum", 13, a, b, a).dtype == np.int32
    assert run1("ReduceSum", 13, a, np.array([0])).dtype == np.int32
    assert run1("CumSum", 14, a, np.array(0)).dtype == np.int32
    assert run1("ArgMax", 13, a).dtype == np.int64
    assert run1("Less", 13, a, b).dtype == np.bool_
    pow_ = run1("Pow", 15, np.array([2, 1, -1, 3], np.int32), np.array([-1, -3, -3, 2], np.int64))
    np.testing.assert_array_equal(pow_, [0, 1, -1, 9])
    assert pow_.dtype == np.int32


def test_float32_is_not_promoted_by_attributes_or_scalars() -> None:
    x = np.array([-1.0, 2.0], np.float32)
    assert run1("LeakyRelu", 16, x, alpha=0.1).dtype == np.float32
    assert run1("Clip", 13, x, np.array(0.0, np.float64), None).dtype == np.float32
    assert run1("Pow", 15, x, np.array(2.0, np.float64)).dtype == np.float32
    assert run1("Add", 14, np.array(1, np.float32), np.array(2, np.float32)).shape == ()


def test_legacy_broadcast_with_axis() -> None:
    a, b = np.zeros((2, 3, 4), np.float32), np.arange(3, dtype=np.float32)
    out = run1("Add", 6, a, b, broadcast=1, axis=1)
    np.testing.assert_array_equal(out[1, :, 2], [0, 1, 2])
    np.testing.assert_array_equal(run1("Mul", 6, a + 1, np.arange(4, dtype=np.float32), broadcast=1)[0, 0], [0, 1, 2, 3])


def test_old_opset_attribute_forms() -> None:
    x = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    np.testing.assert_allclose(run1("Softmax", 11, x).sum(), 1.0, rtol=1e-6)  # coerced to 2-D at axis 1
    np.testing.assert_allclose(run1("Softmax", 13, x).sum(axis=-1), 1.0, rtol=1e-6)
    assert run1("ReduceSum", 11, x, axes=[-1], keepdims=0).shape == (1, 2)
    assert run1("ReduceMean", 13, x, axes=[0, 2]).shape == (1, 2, 1)
    np.testing.assert_array_equal(run1("Clip", 6, np.array([-3.0, 0.0, 3.0], np.float16), min=-1.0), [-1, 0, 3])
    assert run1("Cast", 1, np.array([1, 2]), to="FLOAT").dtype == np.float32


def test_reduction_axes_input_is_a_value_input() -> None:
    assert type(make("ReduceSum", 13)).value_inputs == (1,)
    assert type(make("ReduceMax", 18)).value_inputs == (1,)
    assert type(make("ReduceMax", 13, axes=[0])).value_inputs == ()


def test_empty_reductions() -> None:
    empty = np.zeros((0, 3), np.float32)
    np.testing.assert_array_equal(run1("ReduceMax", 18, empty, np.array([0]), keepdims=0), [-np.inf] * 3)
    np.testing.assert_array_equal(run1("ReduceProd", 18, empty, np.array([0]), keepdims=0), [1, 1, 1])
    np.testing.assert_array_equal(run1("ReduceMin", 20, np.zeros((0, 2), bool), np.array([0]), keepdims=0), [True, True])


def test_cumsum_exclusive_reverse() -> None:
    out = run1("CumSum", 14, np.array([[1, 2, 3]], np.int64), np.array(1), exclusive=1, reverse=1)
    np.testing.assert_array_equal(out, [[5, 3, 0]])


def test_cast_strings() -> None:
    np.testing.assert_array_equal(run1("Cast", 19, np.array(["1.5", "-INF", "1e2"], object), to=1),
                                  np.array([1.5, -np.inf, 100], np.float32))
    np.testing.assert_array_equal(run1("Cast", 19, np.array(["12345678901234567"], object), to=7), [12345678901234567])
    out = run1("Cast", 19, np.array([1.5, -2.0], np.float32), to=8)
    assert out.dtype == object and list(out) == ["1.5", "-2.0"]


def test_cast_float8_saturation() -> None:
    x = np.array([1000.0, -np.inf, np.nan], np.float32)
    sat = run1("Cast", 19, x, to=17).astype(np.float32)  # FLOAT8E4M3FN, max 448
    np.testing.assert_array_equal(sat, [448, -448, np.nan])
    assert np.isnan(run1("Cast", 19, x, to=17, saturate=0).astype(np.float32)).all()


def test_identity_passes_sequences_through() -> None:
    seq = [np.zeros(2, np.float32), np.ones(3, np.float32)]
    assert run1("Identity", 25, seq) is seq


def test_float64_erf_without_scipy_is_accurate() -> None:
    x = np.linspace(-6, 6, 1201)
    np.testing.assert_allclose(_erf_float64(x), [math.erf(v) for v in x], atol=2e-7)


@pytest.mark.parametrize("op_type, opset, attrs", [
    ("Gelu", 20, {"approximate": "fast"}),
    ("BitShift", 11, {"direction": "UP"}),
    ("Cast", 19, {"to": 0}),
    ("Cast", 1, {"to": "NOT_A_TYPE"}),
    ("Cast", 25, {"to": 24, "round_mode": "sideways"}),
    ("Cast", 19, {}),
])
def test_unsupported_is_refused_at_creation(op_type: str, opset: int, attrs: dict) -> None:
    with pytest.raises(UnsupportedOperatorError):
        make(op_type, opset, **attrs)


def test_activations_are_fusable_and_binary_ops_are_not() -> None:
    for op_type in ACTIVATIONS:
        assert type(make(op_type, 22 if op_type != "Gelu" else 20)).elementwise_unary, op_type
    for op_type in ("PRelu", "Add", "Exp", "Clip"):
        assert not type(make(op_type, 16)).elementwise_unary, op_type


def test_float32_erf_is_accurate_to_a_few_ulp_everywhere():
    """float32 erf runs in float32 (GELU's hot spot), SciPy or not: relative error < 5e-7 against
    math.erf on every float32 binade from 1e-38 to the clamp and at random, tiny values and
    non-contiguous layouts included (the definition: onnx.reference applies math.erf)."""
    rng = np.random.default_rng(5)
    binades = np.concatenate([np.geomspace(1e-38, 6.0, 20000), -np.geomspace(1e-38, 6.0, 2000)])
    x = np.concatenate([rng.standard_normal(5000) * 3, rng.uniform(-1e-3, 1e-3, 500), binades,
                        [0.4999, 0.5, -0.5, 1e-30, 3.9199, 3.92, 9.0]])
    x = x.astype(np.float32)
    x = np.asfortranarray(x[: x.size // 10 * 10].reshape(5, -1, 1).repeat(2, axis=2))[:, ::3]
    got = erf_float32(x)
    exact = np.vectorize(math.erf)(x.astype(np.float64))
    assert got.dtype == np.float32 and got.shape == x.shape
    nonzero = exact != 0
    assert (np.abs(got - exact)[nonzero] / np.abs(exact[nonzero])).max() < 5e-7
    assert np.abs(got).max() <= 1
    np.testing.assert_array_equal(erf_float32(np.array([np.inf, -np.inf, -0.0, 0.0], np.float32)), [1, -1, -0.0, 0.0])
    assert np.signbit(erf_float32(np.array([-0.0], np.float32)))[0]
    assert np.isnan(erf_float32(np.array([np.nan], np.float32))[0])
