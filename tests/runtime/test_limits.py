"""Run limits: kernels that size a tensor from run-time data refuse a bomb before allocating it.

A small model with a data input can ask for a huge tensor (ConstantOfShape of [10^5, 10^5], a
Range of 10^12 steps…). Each such kernel checks ``Limits.max_tensor_elements`` / ``max_tensor_rank``
first and raises ``RequestTooLargeError`` naming the layer; the worker stays usable.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from conftest import make_model, tensor_info

BIG = 10 ** 6  # with max_tensor_elements=10^6 below, any output over 10^6 elements is refused


def _bomb(op_type: str, inputs: list, value_inputs: list, **attrs):
    """A one-node model: ``inputs`` are graph inputs (name, elem type, shape); ``value_inputs``
    are the run's values for them."""
    node = helper.make_node(op_type, [n for n, _, _ in inputs], ["y"], name="bomb", **attrs)
    model = make_model([node], [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return ai.load_model(model, limits=ai.Limits(max_tensor_elements=BIG)), value_inputs


I64, F32 = TensorProto.INT64, TensorProto.FLOAT
CASES = {
    "ConstantOfShape": lambda: _bomb("ConstantOfShape", [("s", I64, [2])], [np.array([10 ** 5, 10 ** 5])]),
    "Expand": lambda: _bomb("Expand", [("x", F32, [1]), ("s", I64, [2])],
                            [np.ones(1, np.float32), np.array([10 ** 4, 10 ** 4])]),
    "Tile": lambda: _bomb("Tile", [("x", F32, [2]), ("r", I64, [1])],
                          [np.ones(2, np.float32), np.array([10 ** 6])]),
    "Range": lambda: _bomb("Range", [("a", F32, []), ("b", F32, []), ("d", F32, [])],
                           [np.float32(0), np.float32(1e12), np.float32(1)]),
    "Pad": lambda: _bomb("Pad", [("x", F32, [1, 1]), ("p", I64, [4])],
                         [np.ones((1, 1), np.float32), np.array([0, 0, 10 ** 4, 10 ** 4])]),
    "OneHot": lambda: _bomb("OneHot", [("i", I64, [4]), ("d", I64, []), ("v", F32, [2])],
                            [np.zeros(4, np.int64), np.int64(10 ** 6), np.array([0, 1], np.float32)]),
    "Resize": lambda: _bomb("Resize", [("x", F32, [1, 1, 2, 2]), ("r", F32, [0]), ("s", F32, [4])],
                            [np.ones((1, 1, 2, 2), np.float32), np.zeros(0, np.float32),
                             np.array([1, 1, 1000, 1000], np.float32)]),
}


@pytest.mark.parametrize("op_type", sorted(CASES))
def test_a_data_sized_output_over_the_limit_is_refused_and_the_worker_survives(op_type):
    model, values = CASES[op_type]()
    with ai.Worker(model) as worker:
        with pytest.raises(ai.RequestTooLargeError, match="'bomb'.*max_tensor_elements") as info:
            worker.run_blocking(*values)
        assert info.value.limit == "max_tensor_elements" and info.value.bound == BIG
        small = [np.array([2, 3]) if v.dtype == np.int64 and v.ndim == 1 and op_type in ("ConstantOfShape", "Expand")
                 else v for v in values]
        if op_type in ("ConstantOfShape", "Expand"):  # the same worker runs a reasonable request
            assert worker.run_blocking(*small)["y"].shape == (2, 3)


def test_a_range_that_never_ends_is_an_execution_error():
    model, _ = _bomb("Range", [("a", I64, []), ("b", I64, []), ("d", I64, [])], [])
    with ai.Worker(model) as worker:
        with pytest.raises(ai.ExecutionError, match="delta is 0"):
            worker.run_blocking(np.int64(0), np.int64(5), np.int64(0))


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_nodes"):
        ai.Limits(max_nodes=0)
    assert ai.Limits().replace(max_nodes=5).max_nodes == 5
