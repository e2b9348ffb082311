"""The GLSL that gpu_pixel generates from the element-wise tables, drawn on the pixel backend
(Mesa's llvmpipe in CI) and compared with the CPU backend.

Every unary entry with a device expression runs as a one-node model (each activation also with
non-default attributes), and every fusable activation once more fused into an Add, i.e. drawn
through ``activation_chain`` as the post-expression of another shader. Every binary entry runs on
same-shaped inputs (the ``vec4`` path) and broadcast ones (one element at a time), every
variadic one on one, two and three broadcast inputs. Inputs are finite and
inside each function's domain (GLSL built-ins are not specified at NaN or ±inf; the CUDA
expressions are checked there, in tests/backends/cupy/test_pointwise_cuda.py). Tolerance: rtol 1e-4,
atol 1e-5 (exp-based forms of tanh/sinh/cosh and the erf polynomial); Asin and Acos 1e-3/1e-3:
llvmpipe's asin/acos built-ins are polynomial approximations (errors up to ~4e-4 seen).
"""
from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import helper

import asyncinfer as ai
from asyncinfer.backends.pixel.kernels.elementwise import BINARY, GLSL_BUILTINS, UNARY, VARIADIC
from asyncinfer.backends.pixel.shader import HELPERS
from asyncinfer.ops.pointwise import ACTIVATIONS, BINARY_OPS, DIALECT, UNARY_OPS
from pixel_testing import assert_close, require_pixel, run_both

TOL = dict(rtol=1e-4, atol=1e-5)
LOOSE = {"Asin": dict(rtol=1e-3, atol=1e-3), "Acos": dict(rtol=1e-3, atol=1e-3)}
ATTRIBUTES = {"HardSigmoid": dict(alpha=0.3, beta=0.4), "LeakyRelu": dict(alpha=0.2), "Elu": dict(alpha=0.5),
              "Selu": dict(alpha=1.5, gamma=2.0), "Celu": dict(alpha=2.0), "ThresholdedRelu": dict(alpha=0.5),
              "Shrink": dict(lambd=1.0, bias=0.3), "Gelu": dict(approximate="tanh"), "Swish": dict(alpha=-0.5)}
DOMAINS = {"Sqrt": (0.1, 4), "Log": (0.1, 4), "Reciprocal": (0.5, 3), "Asin": (-0.9, 0.9), "Acos": (-0.9, 0.9),
           "Atanh": (-0.9, 0.9), "Acosh": (1.1, 4)}
DEVICE = sorted(name for name, entry in UNARY_OPS.items() if entry.on_device)
CASES = [(name, {}) for name in DEVICE] + sorted(ATTRIBUTES.items())
IDS = [name + "".join(f"-{k}={v}" for k, v in attrs.items()) for name, attrs in CASES]


def opset(name: str) -> int:
    return max({**UNARY_OPS, **BINARY_OPS}[name].versions)


def sample(rng, name: str, shape=(2, 5, 6)) -> np.ndarray:
    if UNARY_OPS[name].bool_input:
        return rng.random(shape) > 0.5
    lo, hi = DOMAINS.get(name, (-4, 4))
    x = rng.uniform(lo, hi, shape).astype(np.float32)
    if name == "Round":
        x.flat[:4] = [0.5, 1.5, -2.5, 2.5]  # halves round to even
    if name == "IsNaN":
        x.flat[::3] = np.nan
    return x


def model_of(nodes: list, inputs: dict[str, np.ndarray], output_type: int, name: str) -> onnx.ModelProto:
    infos = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
             for n, x in inputs.items()]
    shape = next(iter(inputs.values())).shape
    graph = helper.make_graph(nodes, "g", infos, [helper.make_tensor_value_info("y", output_type, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset(name))])
    model.ir_version = onnx.IR_VERSION
    return model


@pytest.fixture(autouse=True)
def _pixel():
    require_pixel()


def test_the_glsl_prelude_and_builtins_cover_the_dialect():
    defined = set(re.findall(r"\b(?:float|vec4) (\w+)\(", HELPERS))
    assert set(DIALECT) <= defined | GLSL_BUILTINS, set(DIALECT) - defined - GLSL_BUILTINS
    assert set(UNARY) == set(DEVICE), "every table entry with a device expression has a shader"
    assert set(BINARY) | set(VARIADIC) == {name for name, entry in BINARY_OPS.items() if entry.on_device}


@pytest.mark.parametrize("name, attrs", CASES, ids=IDS)
def test_standalone_layer_matches_the_cpu(name, attrs, rng):
    x = sample(rng, name)
    out_type = onnx.TensorProto.BOOL if UNARY_OPS[name].to_bool else onnx.TensorProto.FLOAT
    model = model_of([helper.make_node(name, ["x"], ["y"], **attrs)], {"x": x}, out_type, name)
    got, expected, _ = run_both(model, {"x": x})
    assert_close(got, expected, **LOOSE.get(name, TOL))


@pytest.mark.parametrize("name, attrs", [c for c in CASES if c[0] in ACTIVATIONS],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] in ACTIVATIONS])
def test_activation_fused_into_add_matches_the_cpu(name, attrs, rng):
    a, b = sample(rng, name), sample(rng, name, (5, 6))
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node(name, ["s"], ["y"], **attrs)]
    model = model_of(nodes, {"a": a, "b": b * np.float32(0.5)}, onnx.TensorProto.FLOAT, name)
    loaded = ai.load_model(model.SerializeToString())
    assert [layer.kind for layer in loaded.layers] == [f"Add+{name}"], "the optimizer fuses it into Add"
    got, expected, _ = run_both(model, {"a": a, "b": b * np.float32(0.5)})
    assert_close(got, expected, **TOL)


def test_a_chain_of_clip_and_an_activation_fused_into_add(rng):
    """Add+Clip+Mish as one shader: Clip's bounds come from constant inputs (its expression is
    made by the table's ``clip_template``), Mish's expression is nested around it."""
    a, b = sample(rng, "Relu"), sample(rng, "Relu", (5, 6))
    lo, hi = np.array(-1.0, np.float32), np.array(2.0, np.float32)
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]),
             helper.make_node("Clip", ["s", "lo", "hi"], ["c"]),
             helper.make_node("Mish", ["c"], ["y"])]
    infos = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, x.shape) for n, x in (("a", a), ("b", b))]
    graph = helper.make_graph(nodes, "g", infos, [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, a.shape)],
                              [onnx.numpy_helper.from_array(lo, "lo"), onnx.numpy_helper.from_array(hi, "hi")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = onnx.IR_VERSION
    assert [layer.kind for layer in ai.load_model(model.SerializeToString()).layers] == ["Add+Clip+Mish"]
    got, expected, _ = run_both(model, {"a": a, "b": b})
    assert_close(got, expected, **TOL)


# -- binary and variadic ----------------------------------------------------------------------------------
def binary_sample(rng, name: str, shape) -> np.ndarray:
    entry = BINARY_OPS[name]
    if entry.logical:
        return rng.random(shape) > 0.5
    x = rng.uniform(-4, 4, shape).astype(np.float32)
    if entry.to_bool:
        x = np.round(x)  # ties, so that Equal and the *OrEqual comparisons see some
    return x


@pytest.mark.parametrize("shapes", [((2, 5, 6), (2, 5, 6)), ((2, 5, 6), (6,)), ((3, 1), (1, 7))],
                         ids=["same", "suffix", "outer"])
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_layer_matches_the_cpu(name, shapes, rng):
    a, b = (binary_sample(rng, name, shape) for shape in shapes)
    if name == "Pow":
        a = np.abs(a) + np.float32(0.25)  # negative bases are tested with integral exponents below
    if name == "Div":
        b = np.where(np.abs(b) < 0.25, np.float32(1), b)
    out = onnx.TensorProto.BOOL if BINARY_OPS[name].to_bool else onnx.TensorProto.FLOAT
    model = model_of([helper.make_node(name, ["a", "b"], ["y"])], {"a": a, "b": b}, out, name)
    model.graph.output[0].type.tensor_type.ClearField("shape")
    got, expected, _ = run_both(model, {"a": a, "b": b})
    assert_close(got, expected, **TOL)


def test_pow_of_negative_bases_with_integral_exponents(rng):
    a = rng.uniform(-3, 3, (4, 6)).astype(np.float32)
    b = rng.integers(-3, 4, (4, 6)).astype(np.float32)
    model = model_of([helper.make_node("Pow", ["a", "b"], ["y"])], {"a": a, "b": b}, onnx.TensorProto.FLOAT, "Pow")
    got, expected, _ = run_both(model, {"a": a, "b": b})
    assert_close(got, expected, **TOL)


@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(VARIADIC))
def test_variadic_layer_matches_the_cpu(name, count, rng):
    shapes = [(2, 3, 4), (3, 1), (4,)][:count]
    xs = {f"x{k}": rng.uniform(-4, 4, shape).astype(np.float32) for k, shape in enumerate(shapes)}
    model = model_of([helper.make_node(name, list(xs), ["y"])], xs, onnx.TensorProto.FLOAT, name)
    model.graph.output[0].type.tensor_type.ClearField("shape")
    got, expected, _ = run_both(model, xs)
    assert_close(got, expected, **TOL)
