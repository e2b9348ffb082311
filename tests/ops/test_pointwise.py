"""The element-wise tables (asyncinfer/ops/pointwise.py): every entry's generated CPU op against
the entry's own array-API function (float32 and float16, NaN and ±inf included; attribute defaults
taken independently from ``onnx.defs``) and against onnx's reference implementation on a one-node
model; the registration (names, versions, fusability) and the expression dialect's checks.

The device side of the same entries is tested in tests/backends/pixel/test_pointwise_glsl.py (GLSL,
drawn on gpu_pixel) and tests/backends/cupy/test_pointwise_cuda.py (CUDA C, compiled with g++).
"""
from __future__ import annotations

import re

import numpy as np
import onnx
import onnx.defs
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from asyncinfer import ops
from asyncinfer.errors import UnsupportedOperatorError
from asyncinfer.model.attributes import attribute_value
from asyncinfer.model.ir import Layer
from asyncinfer.ops.elementwise import compute_dtype
from asyncinfer.ops.pointwise import (ACTIVATIONS, BINARY_OPS, DIALECT, OP_CLASSES, UNARY_OPS, check_expression,
                                      clip_template, fill, fold_expression, placeholders, rename, substitute,
                                      to_cuda)

# These tests call kernels directly, on inputs with inf and NaN; the engine's threads run kernels
# with NumPy's floating-point warnings off (ops/base.py), and so do these tests.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TABLE = {**UNARY_OPS, **BINARY_OPS}

#: Non-default attributes per entry (every entry is also run with none: ONNX's defaults).
ATTRIBUTES = {"HardSigmoid": dict(alpha=0.3, beta=0.4), "LeakyRelu": dict(alpha=0.2), "Elu": dict(alpha=0.5),
              "Selu": dict(alpha=1.5, gamma=2.0), "Celu": dict(alpha=2.0), "ThresholdedRelu": dict(alpha=0.5),
              "Shrink": dict(lambd=1.0, bias=0.3), "Gelu": dict(approximate="tanh"), "Swish": dict(alpha=-0.5),
              "Mod": dict(fmod=1), "BitShift": dict(direction="RIGHT")}
REQUIRED = {"BitShift": dict(direction="LEFT")}  # attributes without a default
CASES = [(name, REQUIRED.get(name, {})) for name in sorted(TABLE)] + sorted(ATTRIBUTES.items())
IDS = [name + "".join(f"-{k}={v}" for k, v in attrs.items()) for name, attrs in CASES]

SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5, -0.5, 1.5, -2.5, 1.0, -1.0, 1e-4, -1e-4, 0.99, 6.0, -6.0,
            30.0, -30.0, 100.0, -100.0]
INTEGERS = {"BitwiseNot", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitShift"}


def opset(name: str) -> int:
    return max(TABLE[name].versions)


def n_inputs(name: str) -> int:
    entry = TABLE[name]
    return 1 if name in UNARY_OPS else 3 if entry.variadic else 2


def make(name: str, attrs: dict, version: int | None = None) -> ops.Op:
    layer = Layer(name="n", op_type=name, inputs=[f"i{k}" for k in range(n_inputs(name))], outputs=["y"],
                  attrs=dict(attrs), version=opset(name) if version is None else version)
    return ops.create(layer)


def inputs(name: str, dtype, rng) -> list[np.ndarray]:
    """Random values around the interesting range plus NaN, ±inf, ±0, halves and large values;
    every pair of them for two-input ops (and broadcast shapes for the variadic ones)."""
    entry = TABLE[name]
    if getattr(entry, "bool_input", False) or getattr(entry, "logical", False):
        return [rng.random((6, 8)) > 0.5 for _ in range(n_inputs(name))]
    if name == "BitShift":
        return [rng.integers(0, 1000, 48).astype(np.uint32), rng.integers(0, 8, 48).astype(np.uint32)]
    if name in INTEGERS:
        return [rng.integers(-1000, 1000, 48).astype(np.int32) for _ in range(n_inputs(name))]
    values = np.concatenate([rng.standard_normal(44) * 3, SPECIALS]).astype(dtype)
    if n_inputs(name) == 1:
        return [values]
    a, b = np.meshgrid(values, values)  # every pair, specials included
    if name == "Mod" and not entry.values(make(name, {})).get("fmod"):  # fmod=0: integers only
        return [rng.integers(-50, 50, (8, 8)).astype(np.int32), rng.integers(1, 9, (8, 8)).astype(np.int32)]
    if entry.variadic:
        return [a, b[:1], values[:, None][: a.shape[0]]]
    return [a, b]


def schema_attributes(name: str) -> dict:
    """The attributes of ``name``'s newest implemented version, with their defaults (None: none),
    read from onnx.defs here."""
    schema = onnx.defs.get_schema(name, opset(name), "")
    return {k: (attribute_value(a.default_value) if a.default_value is not None and a.default_value.type != 0
                else None) for k, a in schema.attributes.items()}


def one_node_model(name: str, xs: list[np.ndarray], attrs: dict, out_shape) -> onnx.ModelProto:
    names = [f"i{k}" for k in range(len(xs))]
    node = helper.make_node(name, names, ["y"], **attrs)
    out_type = onnx.TensorProto.BOOL if TABLE[name].to_bool else helper.np_dtype_to_tensor_dtype(xs[0].dtype)
    infos = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
             for n, x in zip(names, xs)]
    graph = helper.make_graph([node], "g", infos, [helper.make_tensor_value_info("y", out_type, out_shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset(name))])
    model.ir_version = onnx.IR_VERSION
    return model


# -- registration ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(TABLE))
def test_every_entry_is_registered_for_each_of_its_versions(name):
    entry = TABLE[name]
    for version in entry.versions:
        assert onnx.defs.get_schema(name, version, "").since_version == version, "versions are schema versions"
        cls = ops.lookup(name, version)
        assert cls is OP_CLASSES[name]
        assert cls.elementwise_unary == (name in ACTIVATIONS)
    if getattr(entry, "inplace", None) is not None:  # only fusable activations run in place
        assert name in ACTIVATIONS


def test_fusable_activations_all_have_a_device_expression():
    assert {"Relu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu", "Selu", "Celu", "Softplus",
            "Softsign", "ThresholdedRelu", "Mish", "Shrink", "Gelu", "Swish"} <= set(ACTIVATIONS)
    assert all(entry.on_device for entry in ACTIVATIONS.values())
    cpu_only = {n for n, e in TABLE.items() if not e.on_device}
    assert cpu_only <= {"BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "Mod"}, \
        "the GPU backends must not lose an op"


@pytest.mark.parametrize("name", sorted(TABLE))
def test_attributes_are_the_schema_s(name):
    """An entry's attributes (its function's keyword parameters) are attributes of the ONNX op at
    every version implemented, with a default (but for REQUIRED ones), so ``Op.attr`` gives it:
    none is restated."""
    for version in TABLE[name].versions:
        schema = onnx.defs.get_schema(name, version, "")
        for attribute in TABLE[name].attributes:
            assert attribute in schema.attributes, (version, attribute)
            default = schema.attributes[attribute].default_value
            assert attribute in REQUIRED.get(name, {}) or (default is not None and default.type != 0), \
                (version, attribute)


# -- the CPU op is the entry's function -----------------------------------------------------------------------
def _direct(name: str, attrs: dict, xs: list[np.ndarray]) -> np.ndarray:
    """The entry's function on NumPy, called here with the schema's defaults, as the CPU op should."""
    entry = TABLE[name]
    values = {k: v for k, v in {**schema_attributes(name), **attrs}.items() if k in entry.attributes}
    dtype = xs[0].dtype
    with np.errstate(all="ignore"):
        if name in UNARY_OPS and entry.inplace is not None and dtype.itemsize >= 4:
            out = entry.inplace(np, xs[0].copy(), **values)  # the op computes in place, on a copy
        elif name in UNARY_OPS:
            out = np.asarray(entry.fn(np, xs[0].astype(compute_dtype(dtype)), **values))
        else:
            out = xs[0]
            for x in xs[1:]:
                out = entry.fn(np, out, x, **values)
            out = np.asarray(out)
            if name == "Mean":
                out = out / np.asarray(len(xs), dtype)
        return out.astype(bool) if entry.to_bool else out.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("name, attrs", CASES, ids=IDS)
def test_cpu_op_equals_the_array_function(name, attrs, dtype, rng):
    xs = inputs(name, dtype, rng)
    for x in xs:
        x.flags.writeable = False  # the op must not write into its inputs
    (got,) = make(name, attrs)(*xs)
    want = _direct(name, attrs, xs)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_run_inplace_writes_into_its_input(rng):
    (x,) = inputs("Relu", np.float32, rng)
    op = make("Relu", {})
    (want,) = op(x)
    out = op.run_inplace(x)
    assert np.shares_memory(out, x)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("name, attrs", [("Gelu", dict(approximate="erf")), ("BitShift", dict(direction="UP"))])
def test_unknown_string_choices_are_refused(name, attrs):
    with pytest.raises(UnsupportedOperatorError, match=f"{next(iter(attrs))}="):
        make(name, attrs)


def test_legacy_broadcast_aligns_b_from_axis():
    a, b = np.ones((2, 3, 4), np.float32), np.arange(3, dtype=np.float32)
    (got,) = make("Add", dict(broadcast=1, axis=1), version=6)(a, b)
    np.testing.assert_array_equal(got, a + b[:, None])


# -- the CPU op agrees with onnx's reference implementation ------------------------------------------------------
#: float16: onnx's reference computes in float16 where the CPU op computes in float32 and rounds once.
REFERENCE_TOLERANCE = {np.float32: dict(rtol=2e-6, atol=1e-6), np.float16: dict(rtol=2e-3, atol=2e-3)}
#: Where onnx's reference implementation departs from the ONNX semantics: the elements to leave out.
REFERENCE_WRONG = {
    # the spec says x for x >= 0; the reference computes where(x > 0, x, x * slope): 0 * inf = NaN at x = 0
    "PRelu": lambda a, b: (a == 0) & ~np.isfinite(b),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("name, attrs", CASES, ids=IDS)
def test_cpu_op_matches_onnx_reference(name, attrs, dtype, rng):
    xs = inputs(name, dtype, rng)
    (got,) = make(name, attrs)(*xs)
    with np.errstate(all="ignore"):
        (want,) = ReferenceEvaluator(one_node_model(name, xs, attrs, got.shape)).run(
            None, {f"i{k}": x for k, x in enumerate(xs)})
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    if name in REFERENCE_WRONG:
        keep = ~np.broadcast_to(REFERENCE_WRONG[name](*xs), got.shape)
        got, want = got[keep], want[keep]
    if got.dtype.kind == "f":
        np.testing.assert_allclose(got, want, equal_nan=True, **REFERENCE_TOLERANCE[dtype])
    else:
        np.testing.assert_array_equal(got, want)


# -- the dialect ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in sorted(TABLE) if TABLE[n].on_device])
def test_every_expression_is_in_the_dialect(name):
    entry = TABLE[name]
    templates = list(entry.templates())
    assert templates
    for template in templates:
        check_expression(template, entry.variables)
        assert set(placeholders(template)) <= set(entry.attributes)
        assert set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", template)) <= set(DIALECT)


@pytest.mark.parametrize("bad", ["x > 0.0 ? x : 0.0", "foo(x)", "max(x, 0)", "x + y", "x[0]", "x % 2.0"])
def test_the_dialect_check_refuses(bad):
    with pytest.raises(ValueError):
        check_expression(bad)


def test_fill_rename_substitute_and_cuda_spelling():
    template = "pick(lt(x, -{lambd}), x + {bias}, 0.0)"
    assert fill(template, dict(lambd=-0.5, bias=2), repr) == "pick(lt(x, -(-0.5)), x + 2.0, 0.0)"
    assert rename("x * exp(x)", "x", "(v + 1.0)") == "((v + 1.0) * exp((v + 1.0)))"
    assert substitute("max(a, b)", {"a": "b", "b": "c"}) == "(max(b, c))", "simultaneous, not one after the other"
    assert to_cuda("expm1(x) * 0.5 + max(x, 1e-05) / 6.0") == "ai_expm1(x) * 0.5f + ai_max(x, 1e-05f) / 6.0f"


def test_variadic_expressions_fold():
    assert fold_expression(BINARY_OPS["Max"], "max(a, b)", ["a", "b", "c"]) == "(max((max(a, b)), c))"
    assert fold_expression(BINARY_OPS["Mean"], "a + b", ["a", "b"]) == "(a + b) / 2.0"
    assert fold_expression(BINARY_OPS["Sum"], "a + b", ["a"]) == "a"


def test_clip_template_leaves_out_bounds_that_cannot_clip():
    assert clip_template(None, None) == ("x", {})
    assert clip_template(-np.inf, np.float32(6)) == ("min(x, {max})", {"max": 6.0})
    assert clip_template(0.0, np.inf) == ("max(x, {min})", {"min": 0.0})
    assert clip_template(np.array(1.0), 0.5) == ("min(max(x, {min}), {max})", {"min": 1.0, "max": 0.5})


@pytest.mark.parametrize("name", sorted(n for n, e in UNARY_OPS.items() if e.inplace is not None))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_in_place_activations_equal_their_out_of_place_form(name, dtype):
    """A fused activation runs in place on its layer's fresh output: the same bits as the op, and
    the entry's array function to float rounding (inf, NaN and -0.0 included)."""
    from asyncinfer.model.ir import Layer
    from asyncinfer.ops import registry

    entry = UNARY_OPS[name]
    attrs = {"alpha": 0.3, "beta": 0.4} if name == "HardSigmoid" else {}
    op = registry.create(Layer(name="act", op_type=name, inputs=["x"], outputs=["y"], attrs=attrs,
                               version=max(entry.versions)))
    x = (np.random.default_rng(3).standard_normal(4096) * 8).astype(dtype)
    x[:6] = [np.inf, -np.inf, np.nan, -0.0, 0.0, 6e4 if dtype == np.float16 else 1e30]
    np.testing.assert_array_equal(op.run_inplace(x.copy()), op(x)[0])
    values = {k: v for k, v in op.values.items()}
    with np.errstate(all="ignore"):
        direct = np.asarray(entry.fn(np, x.astype(np.float32) if dtype == np.float16 else x, **values)).astype(dtype)
    tol = {np.float16: 1e-3, np.float32: 1e-6, np.float64: 1e-6}[dtype]
    np.testing.assert_allclose(op.run_inplace(x.copy()), direct, rtol=tol, atol=tol)
