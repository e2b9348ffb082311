"""``ai.onnx.preview.training::Gradient`` (asyncinfer/ops/gradient.py, the forward graph from
asyncinfer/model/gradient_graph.py), checked against central finite differences in float64 for
every differentiable op (broadcast inputs included) and for a small network, and against the two
cases of ONNX's backend test; what it cannot differentiate is refused at load, naming the op."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
from asyncinfer.ops.gradient import RULES

TRAINING = "ai.onnx.preview.training"
F64 = TensorProto.DOUBLE


def model_of(nodes, inputs: dict[str, np.ndarray], xs: list[str], y: str, zs=(), constants=None,
             opset: int = 17) -> onnx.ModelProto:
    """``nodes`` computing ``y`` from ``inputs`` (fed) and ``constants`` (initializers), plus a
    Gradient node giving ``d_<x>`` for each x; outputs y and the gradients."""
    grads = [f"d_{x}" for x in xs]
    gradient = helper.make_node("Gradient", list(xs) + list(zs), grads, domain=TRAINING, xs=list(xs), y=y,
                                **({"zs": list(zs)} if zs else {}))
    graph = helper.make_graph(
        list(nodes) + [gradient], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in inputs.items()],
        [helper.make_empty_tensor_value_info(n) for n in [y] + grads],
        [numpy_helper.from_array(v, n) for n, v in (constants or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(TRAINING, 1)])
    model.ir_version = 8
    return model


def finite_differences(worker: ai.Worker, feeds: dict[str, np.ndarray], x: str, y: str, eps=1e-6) -> np.ndarray:
    """d(sum y)/dx by central differences, running the model's forward pass."""
    grad = np.zeros_like(feeds[x])
    for index in np.ndindex(feeds[x].shape):
        total = []
        for step in (eps, -eps):
            moved = feeds[x].copy()
            moved[index] += step
            total.append(worker.run_blocking({**feeds, x: moved})[y].sum())
        grad[index] = (total[0] - total[1]) / (2 * eps)
    return grad


def check_against_finite_differences(model, feeds, xs, y="y", rtol=1e-6, atol=1e-7):
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        got = worker.run_blocking(feeds)
        for x in xs:
            assert got[f"d_{x}"].shape == feeds[x].shape and got[f"d_{x}"].dtype == feeds[x].dtype, x
            np.testing.assert_allclose(got[f"d_{x}"], finite_differences(worker, feeds, x, y), rtol=rtol, atol=atol,
                                       err_msg=x)


rng = np.random.default_rng(0)
A = rng.standard_normal((2, 3))
B_ROW = rng.standard_normal((1, 3))  # broadcast along axis 0
B_COL = rng.standard_normal((2, 1))
POSITIVE = rng.uniform(0.5, 2.0, (2, 3))

# op -> (attributes, fed inputs (named a, b, …; all differentiated), constant inputs)
CASES = {
    "Add": ({}, [A, B_ROW], []),
    "Sub": ({}, [B_COL, A], []),
    "Mul": ({}, [A, rng.standard_normal(3)], []),
    "Div": ({}, [A, POSITIVE[:, :1] + 1], []),
    "Pow": ({}, [POSITIVE, rng.uniform(0.5, 2.0, (1, 3))], []),
    "Neg": ({}, [A], []),
    "Abs": ({}, [A], []),
    "Sqrt": ({}, [POSITIVE], []),
    "Exp": ({}, [A], []),
    "Log": ({}, [POSITIVE], []),
    "Relu": ({}, [A], []),
    "Sigmoid": ({}, [A], []),
    "Tanh": ({}, [A], []),
    "Identity": ({}, [A], []),
    "Sum": ({}, [A, B_ROW, B_COL], []),
    "MatMul": ({}, [rng.standard_normal((2, 1, 3, 4)), rng.standard_normal((3, 4, 2))], []),
    "Gemm": (dict(transA=1, transB=1, alpha=0.5, beta=2.0), [rng.standard_normal((4, 2)),
                                                             rng.standard_normal((3, 4)), rng.standard_normal(3)], []),
    "ReduceSum": (dict(keepdims=0), [rng.standard_normal((2, 3, 4))], [np.array([0, 2], np.int64)]),
    "ReduceMean": (dict(keepdims=1), [rng.standard_normal((2, 3, 4))], [np.array([-1], np.int64)]),
    "Reshape": ({}, [rng.standard_normal((2, 3, 2))], [np.array([3, -1], np.int64)]),
    "Flatten": (dict(axis=2), [rng.standard_normal((2, 3, 2))], []),
    "Squeeze": ({}, [rng.standard_normal((2, 1, 3))], [np.array([1], np.int64)]),
    "Unsqueeze": ({}, [A], [np.array([0, 3], np.int64)]),
    "Transpose": (dict(perm=[2, 0, 1]), [rng.standard_normal((2, 3, 4))], []),
}


def test_every_rule_is_tested():
    assert set(CASES) == set(RULES)


@pytest.mark.parametrize("op_type", sorted(CASES))
def test_each_op_against_finite_differences(op_type):
    attrs, fed, constant = CASES[op_type]
    names = [chr(ord("a") + k) for k in range(len(fed))]
    const_names = [f"c{k}" for k in range(len(constant))]
    opset = 18 if op_type == "ReduceMean" else 17
    node = helper.make_node(op_type, names + const_names, ["y"], **attrs)
    model = model_of([node], dict(zip(names, fed)), names, "y", constants=dict(zip(const_names, constant)),
                     opset=opset)
    check_against_finite_differences(model, dict(zip(names, fed)), names)


def test_a_small_network_with_zs_and_constants():
    """y = ReduceMean((Tanh(x @ W + b) - t)^2): W and b differentiated, x and t given as zs, a
    constant exponent; an op that reads only zs (Floor) needs no rule."""
    feeds = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(3), "x": rng.standard_normal((5, 4)),
             "t": rng.standard_normal((5, 3))}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["z"]),
             helper.make_node("Tanh", ["z"], ["h"]), helper.make_node("Floor", ["t"], ["tf"]),
             helper.make_node("Sub", ["h", "tf"], ["e"]), helper.make_node("Pow", ["e", "two"], ["e2"]),
             helper.make_node("ReduceMean", ["e2"], ["y"], keepdims=0)]
    model = model_of(nodes, feeds, ["w", "b"], "y", zs=["x", "t"], constants={"two": np.array(2.0)})
    check_against_finite_differences(model, feeds, ["w", "b"])


def test_the_backend_test_cases():
    a, b = np.array(1.0, np.float32), np.array(2.0, np.float32)
    feeds = {"a": a, "b": b}
    nodes = [helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Mul", ["c", "a"], ["y"])]
    model = model_of(nodes, feeds, ["a", "b"], "y", opset=12)
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        got = worker.run_blocking(feeds)
    assert got["d_a"] == 2 * a + b and got["d_b"] == a and got["d_a"].dtype == np.float32


def test_gradient_at_other_values_and_of_an_intermediate():
    """The inputs of Gradient are the values at which y is differentiated (the spec's H_1 example)."""
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((3, 3))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Sigmoid", ["h"], ["y"]),
             helper.make_node("Gradient", ["h1"], ["dy_dh"], domain=TRAINING, xs=["h"], y="y")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F64, v.shape)
                                           for n, v in (("x", x), ("w", w), ("h1", x))],
                              [helper.make_empty_tensor_value_info("y"), helper.make_empty_tensor_value_info("dy_dh")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)])
    h1 = rng.standard_normal((2, 3))
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        got = worker.run_blocking({"x": x, "w": w, "h1": h1})
    s = 1 / (1 + np.exp(-h1))
    np.testing.assert_allclose(got["dy_dh"], s * (1 - s), rtol=1e-12)
    np.testing.assert_allclose(got["y"], 1 / (1 + np.exp(-x @ w)), rtol=1e-12)  # the model's own y


def test_a_y_that_does_not_depend_on_an_x_has_zero_gradient():
    feeds = {"a": A, "b": A.copy()}
    model = model_of([helper.make_node("Exp", ["a"], ["y"])], feeds, ["a", "b"], "y")
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        got = worker.run_blocking(feeds)
    np.testing.assert_allclose(got["d_a"], np.exp(A))
    np.testing.assert_array_equal(got["d_b"], np.zeros_like(A))


def test_an_op_without_a_rule_on_the_path_is_refused_at_load():
    feeds = {"a": A}
    model = model_of([helper.make_node("Softmax", ["a"], ["s"]), helper.make_node("Exp", ["s"], ["y"])],
                     feeds, ["a"], "y")
    with pytest.raises(ai.UnsupportedOperatorError, match=r"differentiating Softmax"):
        ai.load_model(model)


def test_second_order_is_refused_and_integer_xs_are_errors():
    feeds = {"a": A}
    first = helper.make_node("Gradient", ["a"], ["da"], domain=TRAINING, xs=["a"], y="s")
    nodes = [helper.make_node("Exp", ["a"], ["s"]), first, helper.make_node("Exp", ["da"], ["y"])]
    with pytest.raises(ai.UnsupportedOperatorError, match="second-order"):
        ai.load_model(model_of(nodes, feeds, ["a"], "y"))
    ints = {"a": np.arange(6, dtype=np.int64).reshape(2, 3)}
    model = model_of([helper.make_node("Neg", ["a"], ["y"])], ints, ["a"], "y")
    with ai.Worker(ai.load_model(model), "cpu") as worker, pytest.raises(ai.ExecutionError, match="floating-point"):
        worker.run_blocking(ints)


def test_malformed_gradient_nodes_are_load_errors():
    feeds = {"a": A}
    model = model_of([helper.make_node("Exp", ["a"], ["y"])], feeds, ["a"], "y")
    model.graph.node[-1].input.append("a")  # two inputs for one name in xs
    with pytest.raises(ai.ModelLoadError, match="inputs for the 1 values"):
        ai.load_model(model)


def test_forward_graphs_count_against_the_node_limit():
    """Each Gradient copies the nodes it differentiates: their total is bounded by max_nodes, so
    many Gradients over one long chain cannot make load quadratic."""
    chain = [helper.make_node("Exp", [f"v{k}"], [f"v{k + 1}"]) for k in range(10)]
    grads = [helper.make_node("Gradient", ["v0"], [f"g{k}"], domain=TRAINING, xs=["v0"], y="v10") for k in range(10)]
    graph = helper.make_graph(chain + grads, "g", [helper.make_tensor_value_info("v0", F64, [2])],
                              [helper.make_empty_tensor_value_info(f"g{k}") for k in range(10)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)])
    loaded = ai.load_model(model, limits=ai.Limits(max_nodes=200))
    assert [layer.op_type for layer in loaded.layers].count("Gradient") == 10
    with pytest.raises(ai.ModelTooLargeError, match="Gradient nodes included: 60 exceeds Limits.max_nodes"):
        ai.load_model(model, limits=ai.Limits(max_nodes=50))
