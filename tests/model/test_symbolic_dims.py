"""Declared dimensions as exporters write them: what ``model.inputs`` shows for each, and shape
inference that never computes with a placeholder (the input checks are tests/runtime/test_inputs_exporters.py)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer.model.onnx_import import is_placeholder_dim, value_info_to_tensor_info
from conftest import make_model, tensor_info


def _declared(dim: int | str | None) -> onnx.ValueInfoProto:
    """A float input ``x`` of shape (dim, 3); ``None`` leaves the first dimension blank."""
    vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["placeholder", 3])
    first = vi.type.tensor_type.shape.dim[0]
    first.Clear()
    if isinstance(dim, int):
        first.dim_value = dim
    elif isinstance(dim, str):
        first.dim_param = dim
    return vi


@pytest.mark.parametrize("declared, shown", [
    (-1, None),            # Paddle2ONNX's batch
    (-7, None),            # ONNX Runtime reads every negative size as "any"
    (0, 0),                # a literal 0 for ONNX Runtime too
    (5, 5),
    (None, None),          # neither a size nor a name
    ("?", None),           # Paddle2ONNX's every other unknown
    ("unk__12", None),     # tf2onnx
    ("None", None),        # Keras
    ("-1", None),
    ("", None),
    ("batch_size", "batch_size"),  # torch's dynamic_axes names stay names
    ("N", "N"),
    ("unk__x", "unk__x"),  # only unk__<digits> is tf2onnx's placeholder
])
def test_model_inputs_show_placeholders_as_none(declared, shown):
    assert value_info_to_tensor_info(_declared(declared)).shape == (shown, 3)


def test_missing_shape_is_unknown_rank():
    vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    info = value_info_to_tensor_info(vi)
    assert info.shape is None and info.dtype == np.float32


@pytest.mark.parametrize("name", ["?", "unk__0", "unk__123", "None", "none", "null", "unknown", "-1", "3", "", " "])
def test_placeholder_names(name):
    assert is_placeholder_dim(name)


@pytest.mark.parametrize("name", ["N", "batch", "batch_size", "sequence", "s0", "unk", "unk__", "p2o.DynamicDimension.0",
                                  "?batch", "height?"])
def test_real_names_are_not_placeholders(name):
    assert not is_placeholder_dim(name)


def test_shape_inference_never_computes_with_a_negative_size():
    """onnx infers Flatten(axis=2) of (-1, -1, 4) as a literal (1, 4): the optimizer would fold
    the Shape after it to [1, 4]. Cleared before inference, the size stays unknown."""
    nodes = [helper.make_node("Flatten", ["x"], ["f"], axis=2), helper.make_node("Shape", ["f"], ["s"])]
    proto = make_model(nodes, [tensor_info("x", [-1, -1, 4])], [tensor_info("s", None, TensorProto.INT64)],
                       extra_domains=())
    model = ai.load_model(proto, optimize=False)
    assert model.value_info["f"].shape == (None, 4)
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        np.testing.assert_array_equal(worker.run_blocking(np.zeros((2, 3, 4), np.float32))["s"], [6, 4])
    # the caller's proto is not changed by the clearing
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value == -1


def test_inferred_shapes_carry_no_placeholder_names():
    """Every "?" of a Paddle2ONNX graph is its own unknown, in inferred shapes too."""
    proto = make_model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Transpose", ["r"], ["y"])],
                       [tensor_info("x", ["?", "?", 4])], [tensor_info("y", None)], extra_domains=())
    model = ai.load_model(proto, optimize=False)
    assert model.inputs[0].shape == (None, None, 4)
    assert model.value_info["r"].shape == (None, None, 4)
    assert model.value_info["y"].shape == (4, None, None)


def test_declared_output_shapes_the_graph_does_not_produce_are_kept_as_declared():
    """ONNX Runtime runs such a model (it warns); the declaration is what model.outputs shows and
    the computed shape is what a run returns (tests/runtime/test_inputs_exporters.py runs it)."""
    proto = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [2, 3])], [tensor_info("y", [7, 7])],
                       extra_domains=())
    assert ai.load_model(proto).outputs[0].shape == (7, 7)
