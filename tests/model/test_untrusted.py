"""Untrusted model files: the load limits, malformed tensors and attributes, byte order.

Every malformed model must end in an asyncinfer error naming the tensor, node or file at fault,
never in a raw NumPy/onnx exception, a RecursionError or a huge allocation.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
from asyncinfer.model.tensors import native
from asyncinfer.ops.base import Op
from asyncinfer.ops.registry import register
from conftest import make_model, tensor_info

UNTRUSTED_DOMAIN = "test.asyncinfer.untrusted"


def _add_model(weight: TensorProto, shape=(4,)) -> onnx.ModelProto:
    return make_model([helper.make_node("Add", ["x", weight.name], ["y"], name="adder")],
                      [tensor_info("x", list(shape))], [tensor_info("y", list(shape))], [weight], extra_domains=())


def _relu_model() -> onnx.ModelProto:
    return make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [2])], [tensor_info("y", [2])],
                      extra_domains=())


def _nested_if(depth: int) -> onnx.ModelProto:
    """``depth`` If layers, each in the then-branch of the one before, around one Relu."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y0"])], "leaf", [], [tensor_info("y0", [2])])
    for level in range(1, depth + 1):
        other = helper.make_graph([helper.make_node("Identity", ["x"], [f"e{level}"])], f"else{level}", [],
                                  [tensor_info(f"e{level}", [2])])
        node = helper.make_node("If", ["cond"], [f"y{level}"], then_branch=graph, else_branch=other, name=f"if{level}")
        graph = helper.make_graph([node], f"level{level}", [], [tensor_info(f"y{level}", [2])])
    return make_model(list(graph.node), [tensor_info("x", [2]), tensor_info("cond", [], TensorProto.BOOL)],
                      [tensor_info(f"y{depth}", [2])], extra_domains=())


# -- load limits ---------------------------------------------------------------------------------
def test_model_bytes_limit_is_checked_before_reading(tmp_path):
    proto = _relu_model()
    data = proto.SerializeToString()
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    small = ai.Limits(max_model_bytes=len(data) - 1)
    for source, label in [(data, "<bytes>"), (path, str(path)), (proto, "<ModelProto>")]:
        with pytest.raises(ai.ModelTooLargeError, match=f"{label}.*exceeds Limits.max_model_bytes") as info:
            ai.load_model(source, limits=small)
        assert info.value.limit == "max_model_bytes" and info.value.value == len(data)
    ai.load_model(path, limits=ai.Limits(max_model_bytes=len(data)))


def test_node_limit_counts_subgraph_nodes():
    proto = _nested_if(3)  # 3 If + 3 Identity + 1 Relu
    ai.load_model(proto, limits=ai.Limits(max_nodes=7))
    with pytest.raises(ai.ModelTooLargeError, match="node count \\(subgraphs included\\): 7 exceeds Limits.max_nodes = 6"):
        ai.load_model(proto, limits=ai.Limits(max_nodes=6))


def test_graph_depth_limit_names_the_subgraph():
    proto = _nested_if(4)
    ai.load_model(proto, limits=ai.Limits(max_graph_depth=4))
    with pytest.raises(ai.ModelTooLargeError, match="if4/then_branch/if3/then_branch/if2/then_branch.*depth: 4 exceeds"):
        ai.load_model(proto, limits=ai.Limits(max_graph_depth=3))


def test_deep_nesting_loads_and_runs_without_recursion_error():
    """As deep as protobuf lets a model be nested (30 Ifs): every walk is iterative or bounded."""
    model = ai.load_model(_nested_if(30))
    with ai.Worker(model) as worker:
        out = worker.run_blocking({"x": np.array([-1, 2], np.float32), "cond": np.array(True)})
    np.testing.assert_array_equal(out["y30"], [0, 2])


def test_rank_limit_on_declared_values_and_initializers():
    deep = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [1] * 5)], [tensor_info("y", None)],
                      extra_domains=())
    with pytest.raises(ai.ModelTooLargeError, match="value 'x' rank: 5 exceeds Limits.max_tensor_rank = 4"):
        ai.load_model(deep, limits=ai.Limits(max_tensor_rank=4))
    weight = numpy_helper.from_array(np.zeros([1] * 5, np.float32), "w")
    with pytest.raises(ai.ModelTooLargeError, match="initializer 'w' rank: 5 exceeds"):
        ai.load_model(_add_model(weight, [1]), limits=ai.Limits(max_tensor_rank=4))


def test_tensor_size_limit_applies_to_attribute_tensors_in_subgraphs():
    big = helper.make_tensor("v", TensorProto.FLOAT, [64], [0.0] * 64)
    then = helper.make_graph([helper.make_node("Constant", [], ["t"], value=big)], "then", [], [tensor_info("t", [64])])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=then, name="branch")
    proto = make_model([node], [tensor_info("cond", [], TensorProto.BOOL)], [tensor_info("y", [64])], extra_domains=())
    with pytest.raises(ai.ModelTooLargeError, match="'branch/then_branch/Constant_0' attribute 'value' size in bytes"):
        ai.load_model(proto, limits=ai.Limits(max_tensor_bytes=100))


# -- malformed tensors -----------------------------------------------------------------------------
def _float_weight(**changes) -> TensorProto:
    tensor = numpy_helper.from_array(np.arange(4, dtype=np.float32), "w")
    for key, value in changes.items():
        if key == "dims":
            del tensor.dims[:]
            tensor.dims.extend(value)
        else:
            setattr(tensor, key, value)
    return tensor


def _typed_weight(field: str, values, data_type=TensorProto.FLOAT, dims=(4,)) -> TensorProto:
    tensor = TensorProto(name="w", data_type=data_type, dims=list(dims))
    getattr(tensor, field).extend(values)
    return tensor


@pytest.mark.parametrize("tensor, message", [
    (_float_weight(raw_data=b"\0" * 15), "tensor 'w' has 15 bytes of raw_data, dims \\[4\\] of FLOAT need 16"),
    (_float_weight(raw_data=b"\0" * 17), "has 17 bytes of raw_data"),
    (_float_weight(dims=[2, 3]), "dims \\[2, 3\\] of FLOAT need 24"),
    (_float_weight(dims=[-4]), "tensor 'w' has negative dims \\[-4\\]"),
    (_float_weight(data_type=999), "tensor 'w': unsupported tensor element type 999"),
    (_float_weight(data_type=TensorProto.UNDEFINED), "tensor 'w' has no element type"),
    (_float_weight(data_type=TensorProto.STRING), "string tensor cannot hold raw_data"),
    (_typed_weight("float_data", [1.0, 2.0, 3.0]), "has 3 float_data entries, dims \\[4\\] of FLOAT need 4"),
    (_typed_weight("string_data", [b"a", b"b", b"c", b"d"]), "the wrong field for FLOAT"),
    (_typed_weight("int64_data", [1, 2, 3, 4], TensorProto.INT32), "0 int32_data entries.*wrong field for INT32"),
], ids=["short-raw", "long-raw", "dims-disagree", "negative-dims", "unknown-type", "undefined-type",
        "string-raw", "float-count", "strings-for-floats", "int64-for-int32"])
def test_malformed_initializer_is_named(tensor, message):
    with pytest.raises(ai.ModelLoadError, match=message):
        ai.load_model(_add_model(tensor))


def test_malformed_attribute_tensor_is_named():
    value = helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])
    value.dims[0] = 3
    node = helper.make_node("ConstantOfShape", ["s"], ["y"], value=value, name="fill")
    proto = make_model([node], [tensor_info("s", [1], TensorProto.INT64)], [tensor_info("y", None)], extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="node 'fill' \\(ConstantOfShape\\): attribute 'value' has 1 float_data"):
        ai.load_model(proto)


def test_value_info_with_absurd_dims_is_refused():
    # A negative size is "any size", as ONNX Runtime reads it (tests/model/test_symbolic_dims.py)
    proto = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [2, -7])], [tensor_info("y", [2])],
                       extra_domains=())
    assert ai.load_model(proto).inputs[0].shape == (2, None)
    proto = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [2], 999)], [tensor_info("y", [2])],
                       extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="graph input 'x': unsupported tensor element type 999"):
        ai.load_model(proto)


@pytest.mark.parametrize("indices, dims, message", [
    ([0, 9], [4], "indices fall outside its dims \\[4\\]"),
    ([0, -1], [4], "indices fall outside"),
    ([[0, 0], [1, 5]], [2, 2], "indices fall outside its dims \\[2, 2\\]"),
    ([0, 1, 2], [4], "indices of shape \\[3\\] do not fit 2 values"),
    ([0, 1], [-4], "negative dims"),
])
def test_sparse_initializer_with_bad_indices(indices, dims, message):
    values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "w")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array(indices, np.int64), "i"), dims)
    proto = _add_model(TensorProto(name="unused", data_type=TensorProto.FLOAT, dims=[0]))
    proto.graph.sparse_initializer.append(sparse)
    with pytest.raises(ai.ModelLoadError, match=f"sparse initializer 'w'.*{message}"):
        ai.load_model(proto)


def test_sparse_initializer_is_densified():
    values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "w")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([1, 3], np.int64), "i"), [4])
    proto = make_model([helper.make_node("Add", ["x", "w"], ["y"])], [tensor_info("x", [4])], [tensor_info("y", [4])],
                       extra_domains=())
    proto.graph.sparse_initializer.append(sparse)
    np.testing.assert_array_equal(ai.load_model(proto).constants["w"], [0, 1, 0, 2])


# -- attributes ----------------------------------------------------------------------------------
def test_attribute_of_the_wrong_type_is_named():
    node = helper.make_node("Concat", ["x", "x"], ["y"], axis=[0, 1], name="joiner")
    proto = make_model([node], [tensor_info("x", [2])], [tensor_info("y", [4])], extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="node 'joiner' \\(Concat\\): attribute 'axis' is INTS, .* wants INT"):
        ai.load_model(proto)


def test_missing_required_attribute_is_named():
    node = helper.make_node("Cast", ["x"], ["y"], name="caster")
    proto = make_model([node], [tensor_info("x", [2])], [tensor_info("y", [2])], extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="node 'caster' \\(Cast\\): required attribute 'to' is missing"):
        ai.load_model(proto)


def test_constant_without_output_or_value_is_named():
    node = helper.make_node("Constant", [], [], value_float=1.0, name="lost")
    proto = make_model([node, helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [2])],
                       [tensor_info("y", [2])], extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="'lost' \\(Constant\\): a Constant has exactly one output"):
        ai.load_model(proto)
    node = helper.make_node("Constant", [], ["c"], name="empty")
    proto = make_model([node, helper.make_node("Add", ["x", "c"], ["y"])], [tensor_info("x", [2])],
                       [tensor_info("y", [2])], extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="'empty' \\(Constant\\): a Constant node must have exactly one value"):
        ai.load_model(proto)


def test_duplicate_graph_inputs_are_refused():
    proto = make_model([helper.make_node("Add", ["x", "x"], ["y"])], [tensor_info("x", [2]), tensor_info("x", [2])],
                       [tensor_info("y", [2])], extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="graph input 'x' is declared twice"):
        ai.load_model(proto)


@register("Brittle", versions=(1,), domain=UNTRUSTED_DOMAIN)
class Brittle(Op):
    """An op whose attribute check trips over a value it did not foresee, as a buggy kernel might."""

    def check(self) -> None:
        int(self.attr("factor"))  # TypeError on a list

    def run(self, x):
        return x


def test_raw_exception_of_an_op_check_becomes_a_load_error_naming_the_layer():
    node = helper.make_node("Brittle", ["x"], ["y"], domain=UNTRUSTED_DOMAIN, name="fragile", factor=[1, 2])
    proto = make_model([node], [tensor_info("x", [2])], [tensor_info("y", [2])], extra_domains=(UNTRUSTED_DOMAIN,))
    with pytest.raises(ai.ModelLoadError, match="layer 'fragile' \\(Brittle\\) has malformed attributes.*TypeError"):
        ai.load_model(proto)


# -- byte order ----------------------------------------------------------------------------------
def test_big_endian_data_is_stored_little_endian_and_loaded_native():
    """ONNX raw_data is little-endian: a big-endian array serialised the proper way (converted to
    little-endian bytes) loads as the same values, in the host's byte order, whatever the host."""
    values = np.array([1.5, -2.25, 3e5, np.pi], dtype=">f4")
    ints = np.array([1, -2, 1 << 40], dtype=">i8")
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4], values.astype("<f4").tobytes(), raw=True)
    shift = helper.make_tensor("k", TensorProto.INT64, [3], ints.astype("<i8").tobytes(), raw=True)
    assert weight.raw_data != values.tobytes()  # the big-endian bytes themselves would be wrong
    nodes = [helper.make_node("Add", ["x", "w"], ["y"]), helper.make_node("Identity", ["k"], ["z"])]
    proto = make_model(nodes, [tensor_info("x", [4])], [tensor_info("y", [4]), tensor_info("z", [3], TensorProto.INT64)],
                       [weight, shift], extra_domains=())
    model = ai.load_model(proto, optimize=False)
    for name, expected in (("w", values), ("k", ints)):
        loaded = model.constants[name]
        assert loaded.dtype.isnative and loaded.dtype == expected.dtype.newbyteorder("=")
        np.testing.assert_array_equal(loaded, expected)
    with ai.Worker(model) as worker:
        out = worker.run_blocking(np.zeros(4, np.float32))
    np.testing.assert_array_equal(out["y"], values.astype(np.float32))
    np.testing.assert_array_equal(out["z"], ints.astype(np.int64))


def test_external_data_is_read_little_endian(tmp_path):
    values = np.array([1.5, -2.25, 3e5, 7.0], dtype=">f4")
    (tmp_path / "w.bin").write_bytes(values.astype("<f4").tobytes())
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4])
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "w.bin"
    path = tmp_path / "m.onnx"
    path.write_bytes(_add_model(tensor).SerializeToString())
    loaded = ai.load_model(path).constants["w"]
    assert loaded.dtype.isnative
    np.testing.assert_array_equal(loaded, values)


def test_native_converts_foreign_byte_order():
    foreign = np.array([1.0, 2.0], dtype=np.dtype(np.float32).newbyteorder("S"))
    assert not foreign.dtype.isnative
    converted = native(foreign)
    assert converted.dtype.isnative and converted.dtype == np.float32
    np.testing.assert_array_equal(converted, [1.0, 2.0])


def test_external_data_location_that_is_a_folder_is_refused(tmp_path):
    (tmp_path / "sub").mkdir()
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4])
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "sub"
    path = tmp_path / "m.onnx"
    path.write_bytes(_add_model(tensor).SerializeToString())
    with pytest.raises(ai.ModelLoadError, match="external data 'sub' is not a regular file"):
        ai.load_model(path)


def test_einsum_equation_outside_ascii_is_refused_before_shape_inference():
    """onnx's shape inference loops forever on a non-ASCII Einsum equation (found by tests/fuzz):
    the importer refuses it first, in subgraphs too."""
    einsum = helper.make_node("Einsum", ["x"], ["t"], equation="é", name="sum")
    body = helper.make_graph([einsum], "then", [], [tensor_info("t", None)])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=body, name="branch")
    proto = make_model([node], [tensor_info("x", [2]), tensor_info("cond", [], TensorProto.BOOL)],
                       [tensor_info("y", None)], extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="'branch/then_branch/sum' \\(Einsum\\): equation .* other than ASCII"):
        ai.load_model(proto)
    ok = make_model([helper.make_node("Einsum", ["x", "x"], ["y"], equation="i, i -> ")], [tensor_info("x", [2])],
                    [tensor_info("y", [])], extra_domains=())
    with ai.Worker(ai.load_model(ok)) as worker:
        assert worker.run_blocking(np.array([1, 2], np.float32))["y"] == 5


def test_gather_nd_with_negative_batch_dims_is_refused_before_shape_inference():
    """onnx's shape inference reads out of bounds (a segmentation fault) on a negative batch_dims."""
    node = helper.make_node("GatherND", ["data", "indices"], ["y"], batch_dims=-5, name="gather")
    proto = make_model([node], [tensor_info("data", [2, 2, 2]), tensor_info("indices", [2, 2, 2], TensorProto.INT64)],
                       [tensor_info("y", None)], extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="'gather' \\(GatherND\\): batch_dims -5 is negative"):
        ai.load_model(proto)


def test_a_huge_declared_dimension_does_not_stall_shape_inference():
    """onnx's data propagation makes one protobuf dimension per element of a 1-D tensor: with a
    declared input of 2**40 elements feeding an Add it would run for hours. Load never uses it."""
    node = helper.make_node("Add", ["x", "c"], ["y"])
    proto = make_model([node], [tensor_info("x", [1 << 40])], [tensor_info("y", None)],
                       [numpy_helper.from_array(np.array([-5], np.int64), "c")], extra_domains=())
    model = ai.load_model(proto)  # returns at once (the Add of float and int64 fails at run time)
    assert model.inputs[0].shape == (1 << 40,)
