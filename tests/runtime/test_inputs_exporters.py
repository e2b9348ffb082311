"""Inputs checked against declared shapes as real exporters write them, side by side with ONNX
Runtime: every input it accepts, asyncinfer accepts (with the same outputs); inputs it refuses for
their type, rank or a fixed size are an InputError naming the input and the axis.

The models are built here the way each exporter declares its shapes: torch's ``dynamic_axes``
(names such as ``batch_size`` shared by several inputs), tf2onnx (``unk__<n>`` names and -1
sizes) and Paddle2ONNX (a -1 batch and ``?`` on every other unknown axis).
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
from asyncinfer.runtime.inputs import InputShapeWarning
from conftest import make_model, tensor_info

ort = pytest.importorskip("onnxruntime", reason="ONNX Runtime (a dev dependency) is the second opinion on every input")

RNG = np.random.default_rng(17)


def _const(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def torch_style() -> onnx.ModelProto:
    """An embedding bag as torch.onnx.export writes it with dynamic_axes={"input_ids": {0: "batch_size",
    1: "sequence"}, "attention_mask": {...}, "pooled": {0: "batch_size"}}."""
    nodes = [
        helper.make_node("Gather", ["embedding.weight", "input_ids"], ["/embedding/Gather_output_0"]),
        helper.make_node("Cast", ["attention_mask"], ["/Cast_output_0"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["/Cast_output_0", "axes"], ["/Unsqueeze_output_0"]),
        helper.make_node("Mul", ["/embedding/Gather_output_0", "/Unsqueeze_output_0"], ["/Mul_output_0"]),
        helper.make_node("ReduceSum", ["/Mul_output_0", "reduce_axes"], ["pooled"], keepdims=0),
    ]
    inputs = [tensor_info("input_ids", ["batch_size", "sequence"], TensorProto.INT64),
              tensor_info("attention_mask", ["batch_size", "sequence"], TensorProto.INT64)]
    inits = [_const("embedding.weight", RNG.standard_normal((10, 4)).astype(np.float32)),
             _const("axes", np.array([2], np.int64)), _const("reduce_axes", np.array([1], np.int64))]
    return make_model(nodes, inputs, [tensor_info("pooled", ["batch_size", 4])], inits, opset=17, extra_domains=())


def tf2onnx_style() -> onnx.ModelProto:
    """A dense layer scaled per row, as tf2onnx declares it: ``unk__<n>`` names and -1 sizes."""
    nodes = [
        helper.make_node("MatMul", ["x:0", "dense/kernel:0"], ["dense/MatMul:0"]),
        helper.make_node("Add", ["dense/MatMul:0", "dense/bias:0"], ["dense/BiasAdd:0"]),
        helper.make_node("Relu", ["dense/BiasAdd:0"], ["dense/Relu:0"]),
        helper.make_node("Mul", ["dense/Relu:0", "scale:0"], ["Identity:0"]),
    ]
    inputs = [tensor_info("x:0", ["unk__12", 8]), tensor_info("scale:0", [-1, 1])]
    inits = [_const("dense/kernel:0", RNG.standard_normal((8, 5)).astype(np.float32)),
             _const("dense/bias:0", RNG.standard_normal(5).astype(np.float32))]
    return make_model(nodes, inputs, [tensor_info("Identity:0", ["unk__13", 5])], inits, opset=13, extra_domains=())


def paddle_style() -> onnx.ModelProto:
    """A conv classifier head as Paddle2ONNX declares it: (-1, 3, ?, ?) in, (-1, 4, ?, ?) and (-1, 4) out."""
    nodes = [
        helper.make_node("Conv", ["x", "conv.w"], ["conv.out"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["conv.out"], ["features"]),
        helper.make_node("GlobalAveragePool", ["features"], ["pool.out"]),
        helper.make_node("Flatten", ["pool.out"], ["logits"], axis=1),
    ]
    inputs = [tensor_info("x", [-1, 3, "?", "?"])]
    outputs = [tensor_info("logits", [-1, 4]), tensor_info("features", [-1, 4, "?", "?"])]
    inits = [_const("conv.w", RNG.standard_normal((4, 3, 3, 3)).astype(np.float32))]
    return make_model(nodes, inputs, outputs, inits, opset=11, extra_domains=())


def _ints(*shape: int) -> np.ndarray:
    return RNG.integers(0, 10, shape).astype(np.int64)


def _floats(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


EXPORTS = {"torch": torch_style, "tf2onnx": tf2onnx_style, "paddle": paddle_style}

# Inputs ONNX Runtime accepts for each model's declared shapes.
ACCEPTED = {
    "torch": [dict(input_ids=_ints(1, 1), attention_mask=_ints(1, 1) % 2),
              dict(input_ids=_ints(2, 5), attention_mask=_ints(2, 5) % 2),
              dict(input_ids=_ints(3, 7), attention_mask=_ints(3, 7) % 2)],
    "tf2onnx": [{"x:0": _floats(1, 8), "scale:0": _floats(1, 1)},
                {"x:0": _floats(6, 8), "scale:0": _floats(6, 1)},
                {"x:0": _floats(6, 8), "scale:0": _floats(1, 1)}],  # unk__12 and -1 are unrelated
    "paddle": [dict(x=_floats(1, 3, 8, 8)), dict(x=_floats(2, 3, 5, 9)),  # the two "?" differ
               dict(x=_floats(3, 3, 16, 4)), dict(x=_floats(1, 3, 1, 1))],
}

# Inputs both refuse, and what asyncinfer's InputError says (the input and the axis at fault).
REFUSED = {
    "torch": [(dict(input_ids=_ints(2, 5).astype(np.int32), attention_mask=_ints(2, 5)), "'input_ids' must be int64"),
              (dict(input_ids=_ints(2, 5, 1), attention_mask=_ints(2, 5)), "'input_ids' must have rank 2")],
    "tf2onnx": [({"x:0": _floats(6, 7), "scale:0": _floats(6, 1)}, r"'x:0' must have shape \(\?, 8\).*axis 1 is 7"),
                ({"x:0": _floats(6, 8), "scale:0": _floats(6, 2)}, r"'scale:0' must have shape \(\?, 1\).*axis 1 is 2"),
                ({"x:0": _floats(6, 8), "scale:0": _floats(6)}, "'scale:0' must have rank 2")],
    "paddle": [(dict(x=_floats(1, 4, 8, 8)), r"'x' must have shape \(\?, 3, \?, \?\).*axis 1 is 4, expected 3"),
               (dict(x=_floats(3, 8, 8)), "'x' must have rank 4"),
               (dict(x=_floats(1, 3, 8, 8).astype(np.float64)), "'x' must be float32, got float64")],
}


def _ort_run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # declared outputs it cannot match are warnings
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.fixture(scope="module", params=sorted(EXPORTS))
def export(request):
    proto = EXPORTS[request.param]()
    model = ai.load_model(proto)
    with ai.Worker(model, "cpu") as worker:
        yield request.param, proto, model, worker


def test_every_input_onnxruntime_accepts_is_accepted_with_its_outputs(export):
    name, proto, model, worker = export
    for feeds in ACCEPTED[name]:
        expected = _ort_run(proto, feeds)
        with warnings.catch_warnings():
            warnings.simplefilter("error", InputShapeWarning)  # consistent names: nothing to warn about
            got = worker.run_blocking(feeds)
        for info, want in zip(model.outputs, expected):
            np.testing.assert_allclose(got[info.name], want, rtol=1e-5, atol=1e-5, err_msg=f"{name} {info.name}")


def test_wrong_inputs_are_an_input_error_naming_the_input_and_axis(export):
    name, proto, _, worker = export
    for feeds, message in REFUSED[name]:
        with pytest.raises(Exception):  # ONNX Runtime refuses them as well: the checks are the same
            _ort_run(proto, feeds)
        with pytest.raises(ai.InputError, match=message):
            worker.run_blocking(feeds)


def test_model_inputs_keep_names_and_show_placeholders_as_unknown():
    assert [i.shape for i in ai.load_model(torch_style()).inputs] == [("batch_size", "sequence")] * 2
    assert [i.shape for i in ai.load_model(tf2onnx_style()).inputs] == [(None, 8), (None, 1)]
    paddle = ai.load_model(paddle_style())
    assert paddle.inputs[0].shape == (None, 3, None, None)
    assert repr(paddle.inputs[0]) == "TensorInfo('x', float32, (?, 3, ?, ?))"
    assert [o.shape for o in paddle.outputs] == [(None, 4), (None, 4, None, None)]


def test_a_name_given_two_sizes_runs_with_a_warning_where_onnxruntime_runs():
    """``batch_size`` is 3 on input_ids and 1 on attention_mask: the Mul broadcasts, ONNX Runtime runs it."""
    proto = torch_style()
    feeds = dict(input_ids=_ints(3, 5), attention_mask=np.ones((1, 5), np.int64))
    expected = _ort_run(proto, feeds)
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        with pytest.warns(InputShapeWarning, match="'attention_mask' axis 0 and input 'input_ids' axis 0 share the "
                                                   "dimension name 'batch_size'"):
            got = worker.run_blocking(feeds)
    np.testing.assert_allclose(got["pooled"], expected[0], rtol=1e-5, atol=1e-5)


def test_a_name_given_two_sizes_the_graph_cannot_take_fails_in_the_layer_that_combines_them():
    proto = torch_style()
    feeds = dict(input_ids=_ints(3, 5), attention_mask=np.ones((2, 5), np.int64))
    with pytest.raises(Exception):
        _ort_run(proto, feeds)
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        with pytest.warns(InputShapeWarning), pytest.raises(ai.ExecutionError, match="Mul"):
            worker.run_blocking(feeds)
        worker.run_blocking(ACCEPTED["torch"][1])  # still usable


def test_the_warning_text_holds_no_sizes():
    """Python shows a warning once per distinct text: sizes in it would let requests grow the registry."""
    proto = make_model([helper.make_node("Concat", ["a", "b"], ["y"], axis=0)],
                       [tensor_info("a", ["n", 2]), tensor_info("b", ["n", 2])], [tensor_info("y", None)],
                       extra_domains=())
    texts = set()
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        for rows in ((1, 2), (3, 5), (7, 4)):
            feeds = dict(a=_floats(rows[0], 2), b=_floats(rows[1], 2))
            with pytest.warns(InputShapeWarning) as record:
                out = worker.run_blocking(feeds)["y"]
            np.testing.assert_array_equal(out, _ort_run(proto, feeds)[0])
            texts |= {str(w.message) for w in record}
    assert len(texts) == 1


def test_a_declared_zero_is_a_literal_zero_as_for_onnxruntime():
    proto = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [0, 3])], [tensor_info("y", None)],
                       extra_domains=())
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        empty = np.zeros((0, 3), np.float32)
        assert worker.run_blocking(empty)["y"].shape == _ort_run(proto, {"x": empty})[0].shape == (0, 3)
        with pytest.raises(Exception):
            _ort_run(proto, {"x": _floats(5, 3)})
        with pytest.raises(ai.InputError, match=r"axis 0 is 5, expected 0"):
            worker.run_blocking(_floats(5, 3))


def test_a_name_repeated_on_one_input_takes_any_sizes():
    proto = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", ["n", "n"])], [tensor_info("y", None)],
                       extra_domains=())
    x = _floats(2, 3)
    with ai.Worker(ai.load_model(proto), "cpu") as worker, pytest.warns(InputShapeWarning):
        np.testing.assert_array_equal(worker.run_blocking(x)["y"], _ort_run(proto, {"x": x})[0])


def test_declared_output_shapes_the_graph_does_not_produce_are_accepted():
    proto = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [2, 3])], [tensor_info("y", [7, 7])],
                       extra_domains=())
    x = _floats(2, 3)
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        np.testing.assert_array_equal(worker.run_blocking(x)["y"], _ort_run(proto, {"x": x})[0])


def test_an_input_with_no_declared_shape_takes_any_rank():
    proto = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", None)], [tensor_info("y", None)],
                       extra_domains=())
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        for shape in ((), (4,), (2, 3, 4)):
            x = _floats(*shape)
            np.testing.assert_array_equal(worker.run_blocking(x)["y"], _ort_run(proto, {"x": x})[0])
