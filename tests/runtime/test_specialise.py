"""Shape specialisation (asyncinfer/runtime/specialise.py): the shape arithmetic of a run is
computed once per input signature, later runs of that signature do not dispatch it, results stay
those of the definition for every signature, and models whose shapes may depend on data are never
specialised."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from asyncinfer.runtime import specialise
from conftest import make_model, shape_arithmetic_model, tensor_info


def _expected(proto, x):
    return ReferenceEvaluator(proto).run(None, {"x": x})[0]


@pytest.mark.parametrize("backend", ["cpu", "gpu_pixel"])
def test_shape_arithmetic_runs_once_per_signature_and_results_follow_each_signature(backend):
    proto = shape_arithmetic_model()
    with ai.Worker(ai.load_model(proto), backend) as worker:
        names = {worker._plan.nodes[i].layer.name for i in worker._shape_plans.nodes}
        assert names == {"shape", "slice", "concat"}
        rng = np.random.default_rng(0)
        for n in (2, 5, 2, 1, 5, 2):  # signatures come back: each must get its own values
            x = rng.standard_normal((n, 2, 3)).astype(np.float32)
            execution = worker.schedule(x)
            np.testing.assert_allclose(execution.take_output("y").readback_and_clone().numpy(), _expected(proto, x))
        specialised = worker.schedule(x).plan
        assert sorted(worker._plan.nodes[i].layer.name for i in specialised.precomputed) == ["concat", "shape", "slice"]
        assert len(worker._shape_plans._plans) == 3


def test_a_specialised_run_dispatches_no_shape_layer():
    with ai.Worker(ai.load_model(shape_arithmetic_model())) as worker:
        x = np.ones((3, 2, 3), np.float32)
        worker.run_blocking(x)  # the first run of the signature records the values
        profile = ai.Profile()
        with worker.profile(profile):
            worker.run_blocking(x)
        assert sorted(r.layer for r in profile.records) == ["relu", "reshape"]


def test_signatures_are_bounded(monkeypatch):
    monkeypatch.setattr(specialise, "MAX_SIGNATURES", 4)
    with ai.Worker(ai.load_model(shape_arithmetic_model())) as worker:
        worker._shape_plans._size = 4
        for n in range(1, 11):
            worker.run_blocking(np.ones((n, 2, 3), np.float32))
        assert len(worker._shape_plans._plans) == 4


def test_concurrent_first_runs_of_a_signature_record_once():
    from asyncinfer.concurrency.future import TaskFuture

    with ai.Worker(ai.load_model(shape_arithmetic_model())) as worker:
        shapes = worker._shape_plans
        signature = specialise.signature({"x": TaskFuture.completed([np.ones((2, 2, 3), np.float32)])})
        first, key = shapes.plan_for(signature)
        second, again = shapes.plan_for(signature)  # while the first is still recording
        assert key == signature and again is None
        assert first is not worker._plan and second is worker._plan  # only the first keeps the values
        shapes._forget(key)  # a first run that failed: the next run of the signature records instead
        assert shapes.plan_for(signature)[1] == key
        assert shapes.plan_for(None) == (worker._plan, None)  # an input still pending: the general plan


def test_models_whose_shapes_may_depend_on_data_are_not_specialised():
    # NonZero's output shape is data: everything after it may differ for equal input shapes.
    nodes = [helper.make_node("NonZero", ["x"], ["nz"]), helper.make_node("Shape", ["nz"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", ["N"])], [tensor_info("y", [2], 7)], extra_domains=())
    with ai.Worker(ai.load_model(proto)) as worker:
        assert worker._shape_plans.nodes == ()
        np.testing.assert_array_equal(worker.run_blocking(np.array([0, 1, 1], np.float32))["y"], [1, 2])
        np.testing.assert_array_equal(worker.run_blocking(np.array([1, 1, 1], np.float32))["y"], [1, 3])


def test_a_reshape_target_read_from_data_disables_specialisation():
    # The target comes from an input's values, not its shape: a Shape after it depends on data.
    nodes = [helper.make_node("Reshape", ["x", "target"], ["r"]), helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Cast", ["s"], ["y"], to=1)]
    proto = make_model(nodes, [tensor_info("x", [6]), tensor_info("target", [2], 7)], [tensor_info("y", [2])],
                       extra_domains=())
    with ai.Worker(ai.load_model(proto)) as worker:
        assert worker._shape_plans.nodes == ()
        x = np.arange(6, dtype=np.float32)
        for target in ([2, 3], [3, 2], [2, 3]):
            got = worker.run_blocking(x, np.array(target, np.int64))["y"]
            np.testing.assert_array_equal(got, target)


def test_large_shape_determined_values_are_computed_every_run(monkeypatch):
    monkeypatch.setattr(specialise, "MAX_PRECOMPUTED_ELEMENTS", 10)
    # ConstantOfShape(Shape(x)) is shape-determined but large: it is not held per signature.
    value = numpy_helper.from_array(np.array([2.0], np.float32), "v")
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("ConstantOfShape", ["s"], ["twos"], value=value, name="fill"),
             helper.make_node("Mul", ["x", "twos"], ["y"], name="mul")]
    proto = make_model(nodes, [tensor_info("x", ["N", 8])], [tensor_info("y", ["N", 8])], extra_domains=())
    with ai.Worker(ai.load_model(proto)) as worker:
        x = np.ones((4, 8), np.float32)
        worker.run_blocking(x)
        np.testing.assert_array_equal(worker.run_blocking(x)["y"], 2 * x)
        plan = worker.schedule(x).plan
        assert [worker._plan.nodes[i].layer.name for i in plan.precomputed] == ["shape"]


def test_a_value_only_its_shape_is_read_from_is_not_computed_in_a_specialised_run():
    """``t = Tanh(x)`` is read only by ``Shape``: once a run recorded the shape, later runs of the
    signature skip Tanh too, and its layer future says why instead of holding a value."""
    nodes = [helper.make_node("Tanh", ["x"], ["t"], name="tanh"), helper.make_node("Shape", ["t"], ["s"], name="shape"),
             helper.make_node("Reshape", ["x", "s"], ["r"], name="reshape"),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    proto = make_model(nodes, [tensor_info("x", ["n", 3])], [tensor_info("y", ["n", 3])], extra_domains=())
    with ai.Worker(ai.load_model(proto)) as worker:
        x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
        worker.run_blocking(x)  # records the shape
        profile = ai.Profile()
        with worker.profile(profile):
            execution = worker.schedule(x)
            y = execution.take_output("y").readback_and_clone().numpy()
        np.testing.assert_array_equal(y, np.maximum(x, 0))
        assert sorted(r.layer for r in profile.records) == ["relu", "reshape"]
        tanh = execution.layer_future("tanh")
        assert tanh.failed() and "did not run" in str(tanh.exception())
