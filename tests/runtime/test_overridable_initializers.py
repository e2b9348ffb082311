"""Overridable initializers (asyncinfer/model/onnx_import.py, asyncinfer/runtime/inputs.py): from IR
version 4, an initializer that is also a graph input is a default the caller may override, as ONNX
Runtime reads it. Such inputs come after the others in ``model.inputs``; a run that leaves one out
uses its default; one fed is checked like any input. Other initializers are constants: feeding one
by name is an InputError that says so."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai

ort = pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the second opinion")

BIAS = np.float32([1, 2, 3])


def model(ir_version: int = 8, declared_shape=(3,), declared_type=TensorProto.FLOAT):
    """z = (x + bias) * (k * 2): ``bias`` an initializer listed as a graph input, ``k`` a plain one
    (``k * 2`` is what constant folding would fold)."""
    nodes = [helper.make_node("Add", ["x", "bias"], ["y"]), helper.make_node("Mul", ["k", "two"], ["k2"]),
             helper.make_node("Mul", ["y", "k2"], ["z"])]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
         helper.make_tensor_value_info("bias", declared_type, list(declared_shape))],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(BIAS, "bias"), numpy_helper.from_array(np.float32(0.5), "k"),
         numpy_helper.from_array(np.float32(2), "two")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = ir_version
    return proto


X = np.arange(6, dtype=np.float32).reshape(2, 3)


def test_the_default_is_used_and_a_fed_value_overrides_it_as_in_onnxruntime():
    proto = model()
    loaded = ai.load_model(proto)
    assert [i.name for i in loaded.inputs] == ["x", "bias"] and list(loaded.input_defaults) == ["bias"]
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    other = np.float32([10, 20, 30])
    with ai.Worker(loaded, "cpu") as worker:
        np.testing.assert_array_equal(worker.run_blocking(X)["z"], X + BIAS)
        overridden = worker.run_blocking({"x": X, "bias": other})["z"]
        np.testing.assert_array_equal(overridden, X + other)
        np.testing.assert_array_equal(overridden, session.run(None, {"x": X, "bias": other})[0])
        np.testing.assert_array_equal(worker.run_blocking(X, other)["z"], X + other)  # positionally, after x
        np.testing.assert_array_equal(worker.run_blocking(X)["z"], X + BIAS)  # the default is untouched


def test_an_override_is_checked_like_any_input_and_the_worker_stays_usable():
    with ai.Worker(ai.load_model(model()), "cpu") as worker:
        with pytest.raises(ai.InputError, match="'bias' must be float32"):
            worker.run_blocking({"x": X, "bias": BIAS.astype(np.float64)})
        with pytest.raises(ai.InputError, match=r"'bias' must have shape \(3\)"):
            worker.run_blocking({"x": X, "bias": np.float32([1, 2])})
        np.testing.assert_array_equal(worker.run_blocking({"x": X})["z"], X + BIAS)


def test_a_constant_initializer_fed_by_name_is_a_clear_error():
    with ai.Worker(ai.load_model(model()), "cpu") as worker:
        with pytest.raises(ai.InputError, match=r"unknown input\(s\) \['k'\].*'k': an initializer of the model, "
                                                r"a constant"):
            worker.run_blocking({"x": X, "k": np.float32(3)})


def test_before_ir_4_an_initializer_listed_as_input_is_a_constant():
    loaded = ai.load_model(model(ir_version=3))
    assert [i.name for i in loaded.inputs] == ["x"] and not loaded.input_defaults
    with ai.Worker(loaded, "cpu") as worker:
        np.testing.assert_array_equal(worker.run_blocking(X)["z"], X + BIAS)
        with pytest.raises(ai.InputError, match="'bias': an initializer of the model"):
            worker.run_blocking({"x": X, "bias": BIAS})


def test_an_overridable_initializer_is_not_folded_into_constants():
    nodes = [helper.make_node("Mul", ["k", "two"], ["k2"]), helper.make_node("Mul", ["x", "k2"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
                                           helper.make_tensor_value_info("k", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [3])],
                              [numpy_helper.from_array(np.float32(0.5), "k"),
                               numpy_helper.from_array(np.float32(2), "two")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    x = np.float32([1, 2, 3])
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        np.testing.assert_array_equal(worker.run_blocking(x)["z"], x)
        np.testing.assert_array_equal(worker.run_blocking({"x": x, "k": np.float32(3)})["z"], 6 * x)


def test_declarations_that_disagree_with_the_initializer():
    with pytest.raises(ai.ModelLoadError, match="'bias' is declared int64 but its initializer is float32"):
        ai.load_model(model(declared_type=TensorProto.INT64))
    loaded = ai.load_model(model(declared_shape=(4,)))  # the initializer's own shape is the one kept
    assert loaded.inputs[1].shape == (3,)
    loaded = ai.load_model(model(declared_shape=("c",)))  # a symbolic one stays
    assert loaded.inputs[1].shape == ("c",)


def test_warmup_and_gpu_compute_use_the_default():
    from asyncinfer.backends.cupy import CuPyBackend, HostRuntime

    from asyncinfer.runtime.inputs import example_inputs

    loaded = ai.load_model(model())
    assert example_inputs(loaded)["bias"] is loaded.input_defaults["bias"]
    with ai.Worker(loaded, "cpu") as worker:
        worker.warmup_blocking()
    with ai.Worker(loaded, CuPyBackend(HostRuntime())) as worker:
        np.testing.assert_allclose(worker.run_blocking(X)["z"], X + BIAS)
        np.testing.assert_allclose(worker.run_blocking({"x": X, "bias": -BIAS})["z"], X - BIAS)
