"""Constant folding of untrusted models: data-propagation bombs are predicted, never computed.

A small graph can fold to a huge constant (``ConstantOfShape([100000, 100000])``, an Expand, Tile,
Range, Pad, OneHot, Gather or MatMul of small constants). The optimizer predicts each fold's size
from the op's constant inputs and from shape inference before computing it, and leaves layers
over ``Limits.max_folded_bytes`` to run time, where the kernels' run limits refuse them.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

import asyncinfer as ai
from asyncinfer import ops
from asyncinfer.loader import optimize as optimizer
from asyncinfer.ops.base import Op
from conftest import make_model, tensor_info

BIG = 100_000  # BIG x BIG float32 is 40 GB


def _i64(name, values):
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def _f32(name, values):
    return numpy_helper.from_array(np.asarray(values, np.float32), name)


BOMBS = {
    "ConstantOfShape": ([helper.make_node("ConstantOfShape", ["shape"], ["y"], name="bomb")],
                        [_i64("shape", [BIG, BIG])]),
    "Expand": ([helper.make_node("Expand", ["one", "shape"], ["y"], name="bomb")],
               [_f32("one", [1.0]), _i64("shape", [BIG, BIG])]),
    "Tile": ([helper.make_node("Tile", ["row", "reps"], ["y"], name="bomb")],
             [_f32("row", np.ones((1, 1000))), _i64("reps", [BIG, 100])]),
    "Range": ([helper.make_node("Range", ["start", "limit", "delta"], ["y"], name="bomb")],
              [_f32("start", 0.0), _f32("limit", 1e12), _f32("delta", 1.0)]),
    "Pad": ([helper.make_node("Pad", ["one", "pads"], ["y"], name="bomb")],
            [_f32("one", np.ones((1, 1))), _i64("pads", [0, 0, BIG, BIG])]),
    "OneHot": ([helper.make_node("OneHot", ["idx", "depth", "values"], ["y"], name="bomb")],
               [_i64("idx", np.zeros(BIG)), _i64("depth", BIG), _f32("values", [0.0, 1.0])]),
    "Gather": ([helper.make_node("Gather", ["row", "idx"], ["y"], axis=0, name="bomb")],
               [_f32("row", np.ones((1, BIG))), _i64("idx", np.zeros(BIG))]),
    "MatMul": ([helper.make_node("MatMul", ["col", "row"], ["y"], name="bomb")],
               [_f32("col", np.ones((BIG, 1))), _f32("row", np.ones((1, BIG)))]),
    "Add": ([helper.make_node("Add", ["col", "row"], ["y"], name="bomb")],
            [_f32("col", np.ones((BIG, 1))), _f32("row", np.ones((1, BIG)))]),
}


# Kernels that check Limits.max_tensor_elements before sizing their output from data.
RUN_LIMITED = {"ConstantOfShape", "Expand", "Tile", "Range", "Pad", "OneHot"}


@pytest.fixture
def kernel_calls(monkeypatch):
    """The op types whose kernels ran (folding calls the very kernels that run later)."""
    calls: list[str] = []
    original = Op.__call__

    def spy(self, *inputs):
        calls.append(self.layer.op_type)
        return original(self, *inputs)

    monkeypatch.setattr(Op, "__call__", spy)
    return calls


@pytest.mark.parametrize("op_type", sorted(BOMBS))
def test_data_propagation_bomb_is_left_to_run_time_without_being_computed(op_type, kernel_calls):
    nodes, inits = BOMBS[op_type]
    proto = make_model(nodes, [], [tensor_info("y", None)], inits, extra_domains=())
    model = ai.load_model(proto)
    assert op_type not in kernel_calls  # predicted, never computed
    assert [l.name for l in model.layers] == ["bomb"] and "y" not in model.constants
    if op_type in RUN_LIMITED:  # the others would try to allocate their 40 GB at run time
        with ai.Worker(model) as worker, pytest.raises(ai.RequestTooLargeError, match="'bomb'"):
            worker.run_blocking()  # at run time, the kernel's run limits refuse it


def test_a_lying_declared_shape_does_not_hide_a_bomb(kernel_calls):
    nodes, inits = BOMBS["ConstantOfShape"]
    proto = make_model(nodes, [], [tensor_info("y", [2])], inits, extra_domains=())
    proto.graph.value_info.append(tensor_info("y", [2]))
    model = ai.load_model(proto)
    assert "ConstantOfShape" not in kernel_calls and "y" not in model.constants


def test_bomb_fed_by_folded_constants_is_predicted(kernel_calls):
    """The shape comes from a Concat folded first: the prediction reads the folded value."""
    nodes = [helper.make_node("Concat", ["a", "b"], ["shape"], axis=0),
             helper.make_node("ConstantOfShape", ["shape"], ["y"], name="bomb")]
    proto = make_model(nodes, [], [tensor_info("y", None)], [_i64("a", [BIG]), _i64("b", [BIG])], extra_domains=())
    model = ai.load_model(proto)
    assert kernel_calls == ["Concat"] and [l.name for l in model.layers] == ["bomb"]


@pytest.mark.parametrize("bound, folded", [(4095, False), (4096, True)])
def test_max_folded_bytes_is_the_model_limit(bound, folded):
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["w"]), helper.make_node("Add", ["x", "w"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [1024])], [tensor_info("y", [1024])], [_i64("shape", [1024])],
                       extra_domains=())
    model = ai.load_model(proto, limits=ai.Limits(max_folded_bytes=bound))
    assert ("w" in model.constants) is folded
    with ai.Worker(model) as worker:
        np.testing.assert_array_equal(worker.run_blocking(np.ones(1024, np.float32))["y"], np.ones(1024))


def test_prediction_bounds_the_real_size():
    """For ops with a rule, the prediction is never below what the kernel builds, nor so far above
    it that real weights would stop being folded."""
    for op_type, (nodes, inits) in BOMBS.items():
        small = [numpy_helper.to_array(t) for t in inits]
        small = [np.minimum(a, 7) if a.dtype.kind in "iu" and op_type != "Range" else a for a in small]
        if op_type in ("Tile", "Gather", "MatMul", "Add", "Pad", "OneHot"):
            small = [a[..., :7] if a.ndim and a.shape[-1] > 7 else a for a in small]
            small = [a[:7] if a.ndim and a.shape[0] > 7 else a for a in small]
        if op_type == "Range":
            small = [np.float32(0.0), np.float32(50.0), np.float32(3.0)]
        model = ai.load_model(make_model(nodes, [], [tensor_info("y", None)],
                                         [numpy_helper.from_array(np.asarray(a), t.name) for a, t in zip(small, inits)],
                                         extra_domains=()), optimize=False)
        layer = model.layers[0]
        args = [model.constants[n] for n in layer.inputs]
        predicted = optimizer.predicted_bytes(model, layer, args)
        real = ops.create(layer)(*args)[0]
        assert predicted is not None and real.nbytes <= predicted <= 16 * max(real.nbytes, 64), op_type


def test_a_failing_pass_is_a_load_error_naming_the_pass(monkeypatch):
    def broken(model):
        raise ValueError("something the pass did not foresee")

    monkeypatch.setattr(optimizer, "PASSES", [("broken_pass", broken)])
    proto = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [2])], [tensor_info("y", [2])],
                       extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="optimizer pass broken_pass failed.*ValueError: something"):
        ai.load_model(proto)


@pytest.mark.parametrize("weights", [
    {"w": np.float32(2.0)},  # a scalar Conv weight
    {"w": np.ones((2, 1, 1, 1), np.float32), "b": np.ones(3, np.float32)},  # bias of the wrong length
])
def test_malformed_conv_constants_do_not_break_affine_folding(weights):
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in weights.items()]
    nodes = [helper.make_node("Conv", ["x"] + list(weights), ["c"], name="conv"),
             helper.make_node("Mul", ["c", "s"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [1, 1, 2, 2])], [tensor_info("y", None)],
                       inits + [_f32("s", [2.0, 2.0])], extra_domains=())
    try:
        model = ai.load_model(proto)
    except ai.AsyncInferError:
        return
    assert [l.op_type for l in model.layers] == ["Conv", "Mul"]  # nothing folded into a broken host
    with pytest.raises(ai.AsyncInferError, match="'conv'"), ai.Worker(model) as worker:
        worker.run_blocking(np.ones((1, 1, 2, 2), np.float32))


def test_batch_norm_with_mismatched_parameters_is_not_folded():
    rng = np.random.default_rng(0)
    inits = [_f32("w", rng.standard_normal((4, 1, 1, 1))), _f32("scale", np.ones(4)), _f32("beta", np.ones(3)),
             _f32("mean", np.zeros(4)), _f32("var", np.ones(4))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["y"], name="bn")]
    proto = make_model(nodes, [tensor_info("x", [1, 1, 2, 2])], [tensor_info("y", None)], inits, extra_domains=())
    model = ai.load_model(proto)
    assert [l.op_type for l in model.layers] == ["Conv", "BatchNormalization"]


def test_identity_with_an_empty_output_does_not_rewire_omitted_inputs():
    nodes = [helper.make_node("Identity", ["x"], [""]),
             helper.make_node("Clip", ["x", "", "hi"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [3])], [tensor_info("y", [3])], [_f32("hi", 1.0)], extra_domains=())
    model = ai.load_model(proto)
    clip = next(l for l in model.layers if l.op_type == "Clip")
    assert clip.inputs == ["x", "", "hi"]
    with ai.Worker(model) as worker:
        np.testing.assert_array_equal(worker.run_blocking(np.array([-5, 0.5, 5], np.float32))["y"], [-5, 0.5, 1])


def test_folded_constants_never_total_more_than_the_model_file_may_hold():
    """Many small folds are one bomb too: once the folded values total Limits.max_model_bytes,
    further layers are left to run time."""
    nodes = [helper.make_node("ConstantOfShape", ["shape"], [f"w{i}"]) for i in range(3)]
    nodes += [helper.make_node("Sum", ["x", "w0", "w1", "w2"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [1024])], [tensor_info("y", [1024])], [_i64("shape", [1024])],
                       extra_domains=())
    model = ai.load_model(proto, limits=ai.Limits(max_model_bytes=10_000))  # room for two 4 KiB folds
    assert sorted(n for n in model.constants if n.startswith("w")) == ["w0", "w1"]
    with ai.Worker(model) as worker:
        np.testing.assert_array_equal(worker.run_blocking(np.ones(1024, np.float32))["y"], np.ones(1024))
