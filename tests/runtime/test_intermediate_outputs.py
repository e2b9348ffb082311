"""Intermediate outputs: any value of the graph by name, checked against onnx.reference's own
intermediate values, kept alive only for the runs that ask, with clear errors for names the graph
does not hold."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from asyncinfer.runtime.execution import RELEASED
from asyncinfer.runtime.outputs import MAX_CACHED_PLANS

RNG = np.random.default_rng(7)
WEIGHT = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
BIAS = RNG.standard_normal(4).astype(np.float32)
DENSE = RNG.standard_normal((64, 5)).astype(np.float32) * 0.2
SHIFT = RNG.standard_normal(5).astype(np.float32)

# x -> Conv -> conv_out -> Relu -> hidden_relu -> MaxPool -> pooled -> Flatten -> flat
#   -> MatMul(dense) -> projected -> Add(shift) -> shifted -> Softmax -> y
# (conv_out and projected are fused away: the Relu runs inside the Conv, the bias row's Add
# inside the MatMul)
INTERMEDIATES = ["hidden_relu", "pooled", "flat", "shifted"]


def build_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Conv", ["x", "weight", "bias"], ["conv_out"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["conv_out"], ["hidden_relu"], name="relu"),
             helper.make_node("MaxPool", ["hidden_relu"], ["pooled"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
             helper.make_node("Flatten", ["pooled"], ["flat"], name="flatten"),
             helper.make_node("MatMul", ["flat", "dense"], ["projected"], name="matmul"),
             helper.make_node("Add", ["projected", "shift"], ["shifted"], name="add"),
             helper.make_node("Softmax", ["shifted"], ["y"], axis=-1, name="softmax")]
    inits = [numpy_helper.from_array(WEIGHT, "weight"), numpy_helper.from_array(BIAS, "bias"),
             numpy_helper.from_array(DENSE, "dense"), numpy_helper.from_array(SHIFT, "shift")]
    graph = helper.make_graph(nodes, "intermediates", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def reference_values(names: list[str], x: np.ndarray) -> dict[str, np.ndarray]:
    """onnx.reference's values of ``names``: each made a graph output of a copy of the model."""
    proto = build_model()
    del proto.graph.output[:]
    proto.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    return dict(zip(names, ReferenceEvaluator(proto).run(None, {"x": x})))


X = RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)


@pytest.mark.anyio
async def test_intermediate_values_match_onnx_reference(any_backend):
    model = ai.load_model(build_model())
    want = reference_values(INTERMEDIATES + ["y"], X)
    rtol, atol = (1e-5, 1e-6) if any_backend == "cpu" else (1e-4, 1e-5)
    async with ai.Worker(model, any_backend) as worker:
        got = await worker.run(X, outputs=INTERMEDIATES)
        assert list(got) == INTERMEDIATES  # the names asked for, in that order, and only them
        for name in INTERMEDIATES:
            np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)
        blocking = worker.run_blocking(X, outputs=["pooled", "y"])
        np.testing.assert_allclose(blocking["pooled"], want["pooled"], rtol=rtol, atol=atol)
        np.testing.assert_allclose(blocking["y"], want["y"], rtol=rtol, atol=atol)
        execution = worker.schedule(X, outputs=["flat"])
        assert list(execution.outputs) == ["flat"]
        np.testing.assert_allclose(execution.peek_output("flat").readback_and_clone().numpy(), want["flat"],
                                   rtol=rtol, atol=atol)
        np.testing.assert_allclose(worker.peek_output("y").readback_and_clone().numpy(), want["y"],  # still readable
                                   rtol=rtol, atol=atol)
        assert worker.peek_output().name == "flat"


def test_the_fused_away_value_is_an_error_that_says_how_to_keep_it(any_backend):
    model = ai.load_model(build_model())
    with ai.Worker(model, any_backend) as worker:
        with pytest.raises(ai.InputError, match=r"'conv_out'.*fused Relu 'relu' into layer 'conv'.*optimize=False"):
            worker.schedule(X, outputs=["conv_out"])
    unoptimized = ai.load_model(build_model(), optimize=False)
    with ai.Worker(unoptimized, any_backend) as worker:
        got = worker.run_blocking(X, outputs=["conv_out", "hidden_relu"])
    want = reference_values(["conv_out", "hidden_relu"], X)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_unknown_names_are_input_errors_listing_near_names():
    with ai.Worker(ai.load_model(build_model())) as worker:
        with pytest.raises(ai.InputError, match=r"no value 'hiden_relu'.*nearest names: \['hidden_relu'"):
            worker.schedule(X, outputs=["hiden_relu"])
        with pytest.raises(ai.InputError, match="at least one"):
            worker.schedule(X, outputs=[])
        with pytest.raises(ai.InputError, match=r"write \['pooled'\]"):
            worker.schedule(X, outputs="pooled")
        with pytest.raises(ai.InputError, match="strings"):
            worker.schedule(X, outputs=[3])
        with pytest.raises(ai.AsyncInferError, match="no output 'pooled'"):
            worker.schedule(X).peek_output("pooled")  # a run that did not ask for it


def test_inputs_and_constants_are_values_too():
    with ai.Worker(ai.load_model(build_model())) as worker:
        got = worker.run_blocking(X, outputs=["x", "dense", "y", "x"])  # repeats count once
    assert list(got) == ["x", "dense", "y"]
    np.testing.assert_array_equal(got["x"], X)
    np.testing.assert_array_equal(got["dense"], DENSE)


def test_values_are_kept_only_for_runs_that_ask(add_chain_model, monkeypatch):
    monkeypatch.setenv("ASYNCINFER_RUN_MODE", "parallel")  # (a serial run takes its plan's serial variant)
    model = ai.load_model(add_chain_model(4), optimize=False)  # y = x + 1 + 1 + 1 + 1 via t0, t1, t2
    x = np.zeros((1, 4), np.float32)
    with ai.Worker(model) as worker:
        plain = worker.schedule(x)
        plain.wait_blocking(30)
        t1 = plain.plan.refs["t1"]
        assert plain.step_future(t1[0]).peek()[t1[1]] is RELEASED  # freed after its last reader
        asked = worker.schedule(x, outputs=["t1"])
        asked.wait_blocking(30)
        np.testing.assert_array_equal(asked.step_future(t1[0]).peek()[t1[1]], np.full((1, 4), 2, np.float32))
        again = worker.schedule(x)
        again.wait_blocking(30)
        assert again.step_future(t1[0]).peek()[t1[1]] is RELEASED  # the default plan is untouched
        # One plan per requested set, cached (bounded: names may come from untrusted requests).
        assert worker._plans.get(["t1"]) is asked.plan and asked.plan is not plain.plan
        assert worker._plans.get(["y"]) is plain.plan
        for names in list(itertools.permutations(["x", "t0", "t1", "t2", "y"], 3))[:MAX_CACHED_PLANS + 5]:
            worker._plans.get(names)
        assert len(worker._plans._plans) <= MAX_CACHED_PLANS
        np.testing.assert_array_equal(worker.run_blocking(x)["y"], np.full((1, 4), 4, np.float32))


def test_a_value_the_optimizer_removed_is_an_error_that_says_so():
    nodes = [helper.make_node("Identity", ["x"], ["copied"], name="identity"),
             helper.make_node("Relu", ["copied"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "identity", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.array([-1, 2], np.float32)
    with ai.Worker(ai.load_model(proto)) as worker:
        with pytest.raises(ai.InputError, match=r"'copied' no longer exists: the optimizer removed it.*optimize=False"):
            worker.run_blocking(x, outputs=["copied"])
    with ai.Worker(ai.load_model(proto, optimize=False)) as worker:
        np.testing.assert_array_equal(worker.run_blocking(x, outputs=["copied"])["copied"], x)
