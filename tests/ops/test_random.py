"""Random generators: shapes, dtypes, value ranges, statistics, seeds, and no constant folding."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from conftest import make_model, tensor_info


def _run(node, inputs=(), input_infos=(), out_shape=None, out_type=TensorProto.FLOAT):
    proto = make_model([node], list(input_infos), [tensor_info("y", out_shape, out_type)], extra_domains=())
    with ai.Worker(ai.load_model(proto)) as worker:
        return worker.run_blocking(*inputs)["y"]


def test_random_normal_statistics_and_seed():
    node = helper.make_node("RandomNormal", [], ["y"], shape=[200, 100], mean=3.0, scale=2.0, seed=7.0)
    a = _run(node, out_shape=[200, 100])
    b = _run(node, out_shape=[200, 100])
    assert a.dtype == np.float32 and a.shape == (200, 100)
    assert abs(a.mean() - 3.0) < 0.05 and abs(a.std() - 2.0) < 0.05
    np.testing.assert_array_equal(a, b)  # seeded: every run draws the same values


def test_unseeded_runs_differ_and_are_not_folded():
    node = helper.make_node("RandomUniform", [], ["y"], shape=[64], low=-1.0, high=1.0)
    proto = make_model([node], [], [tensor_info("y", [64])], extra_domains=())
    model = ai.load_model(proto)
    assert [l.op_type for l in model.layers] == ["RandomUniform"]  # constant folding left it alone
    with ai.Worker(model) as worker:
        a, b = worker.run_blocking()["y"], worker.run_blocking()["y"]
    assert not np.array_equal(a, b) and a.min() >= -1 and a.max() < 1


def test_like_variants_take_shape_and_dtype():
    x = np.zeros((3, 5), np.float64)
    info = [tensor_info("x", [3, 5], TensorProto.DOUBLE)]
    y = _run(helper.make_node("RandomNormalLike", ["x"], ["y"]), [x], info, [3, 5], TensorProto.DOUBLE)
    assert y.shape == (3, 5) and y.dtype == np.float64
    y = _run(helper.make_node("RandomUniformLike", ["x"], ["y"], dtype=TensorProto.FLOAT), [x], info, [3, 5])
    assert y.dtype == np.float32 and ((0 <= y) & (y < 1)).all()


def test_bernoulli_follows_the_probabilities():
    p = np.array([0.0, 1.0, 0.5] * 2000, np.float32)
    y = _run(helper.make_node("Bernoulli", ["p"], ["y"], seed=1.0), [p], [tensor_info("p", [6000])], [6000])
    assert (y[0::3] == 0).all() and (y[1::3] == 1).all() and abs(y[2::3].mean() - 0.5) < 0.05


def test_multinomial_draws_the_likely_class():
    logits = np.log(np.array([[0.001, 0.998, 0.001], [0.5, 0.0, 0.5]], np.float32) + 1e-12)
    node = helper.make_node("Multinomial", ["x"], ["y"], sample_size=500, seed=3.0)
    y = _run(node, [logits], [tensor_info("x", [2, 3])], [2, 500], TensorProto.INT32)
    assert y.dtype == np.int32 and y.shape == (2, 500)
    assert (y[0] == 1).mean() > 0.98 and set(np.unique(y[1])) <= {0, 2}


def test_unsupported_dtype_is_refused():
    node = helper.make_node("Multinomial", ["x"], ["y"], dtype=TensorProto.FLOAT)
    proto = make_model([node], [tensor_info("x", [1, 3])], [tensor_info("y", [1, 1])], extra_domains=())
    with pytest.raises(ai.UnsupportedOperatorError, match="Multinomial.*dtype"):
        ai.load_model(proto)
