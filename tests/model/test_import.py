"""Model import: sources, constants, symbolic shapes, external data, and every ModelLoadError."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
from conftest import make_model, tensor_info


def _mul_model(opset: int = 17) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(4, dtype=np.float32), "w")
    return make_model([helper.make_node("Mul", ["x", "w"], ["y"], name="mul")],
                      [tensor_info("x", ["batch", 4])], [tensor_info("y", ["batch", 4])], [w],
                      opset=opset, extra_domains=())


@pytest.mark.parametrize("kind", ["path", "str", "bytes", "proto"])
def test_load_from_every_source(tmp_path, kind):
    proto = _mul_model()
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    source = {"path": path, "str": str(path), "bytes": proto.SerializeToString(), "proto": proto}[kind]
    model = ai.load_model(source)
    assert [(i.name, i.dtype, i.shape) for i in model.inputs] == [("x", np.dtype(np.float32), ("batch", 4))]
    assert model.outputs[0].name == "y"
    with ai.Worker(model) as w:
        np.testing.assert_array_equal(w.run_blocking(np.ones((2, 4), np.float32))["y"], [[0, 1, 2, 3]] * 2)


@pytest.mark.parametrize("opset", [7, 9, 11, 13, 17, onnx.defs.onnx_opset_version()])
def test_opsets_from_7_to_newest(opset):
    model = ai.load_model(_mul_model(opset))
    assert model.opsets[""] == opset


def test_opset_newer_than_onnx_knows_is_refused():
    with pytest.raises(ai.ModelLoadError, match=f"opset {onnx.defs.onnx_opset_version() + 1} is newer"):
        ai.load_model(_mul_model(onnx.defs.onnx_opset_version() + 1))


def test_subgraph_outer_scope_values_become_layer_inputs():
    then_graph = helper.make_graph([helper.make_node("Add", ["x", "bias"], ["t"])], "then", [],
                                   [tensor_info("t", [2])])
    else_graph = helper.make_graph([helper.make_node("Sub", ["x", "bias"], ["e"])], "else", [],
                                   [tensor_info("e", [2])])
    nodes = [helper.make_node("Relu", ["x0"], ["x"]), helper.make_node("Relu", ["b0"], ["bias"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph, name="branch")]
    proto = make_model(nodes, [tensor_info("x0", [2]), tensor_info("b0", [2]), tensor_info("cond", [], TensorProto.BOOL)],
                       [tensor_info("y", [2])], extra_domains=())
    from asyncinfer.model.onnx_import import import_model

    layer = next(l for l in import_model(proto).layers if l.op_type == "If")
    assert layer.outer_inputs == ["x", "bias"] and layer.inputs == ["cond", "x", "bias"]


def test_subgraph_reading_an_undefined_value_is_refused():
    body = helper.make_graph([helper.make_node("Add", ["x", "nowhere"], ["t"])], "then", [], [tensor_info("t", [2])])
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=body, name="branch")]
    proto = make_model(nodes, [tensor_info("x", [2]), tensor_info("cond", [], TensorProto.BOOL)],
                       [tensor_info("y", [2])], extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="reads \\['nowhere'\\]"):
        ai.load_model(proto)


def test_constant_nodes_become_constants():
    nodes = [helper.make_node("Constant", [], ["c"], value_floats=[1.0, 2.0]),
             helper.make_node("Add", ["x", "c"], ["y"])]
    model = ai.load_model(make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])]), optimize=False)
    assert "c" in model.constants and [l.op_type for l in model.layers] == ["Add"]


def test_garbage_bytes():
    with pytest.raises(ai.ModelLoadError, match="not a valid ONNX model|not an ONNX model"):
        ai.load_model(b"\x00\xffthis is not a protobuf at all\x13\x37" * 10)


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ai.ModelLoadError, match="empty"):
        ai.load_model(empty)
    with pytest.raises(ai.ModelLoadError, match="no such model file"):
        ai.load_model(tmp_path / "missing.onnx")
    with pytest.raises(ai.ModelLoadError, match="a directory, not a model file"):
        ai.load_model(tmp_path)


def test_truncated_file(tmp_path):
    from asyncinfer import assets

    data = assets.default_model_path().read_bytes()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ai.ModelLoadError, match="truncated"):
        ai.load_model(path)


def test_cycle_is_named():
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="first"),
             helper.make_node("Relu", ["a"], ["b"], name="second"),
             helper.make_node("Relu", ["a"], ["y"], name="out")]
    with pytest.raises(ai.ModelLoadError, match="cycle.*first.*second"):
        ai.load_model(make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])]))


def test_undefined_input_is_named():
    nodes = [helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")]
    with pytest.raises(ai.ModelLoadError, match="'adder'.*'ghost'.*defined nowhere"):
        ai.load_model(make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])]))


def test_output_produced_by_nobody():
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    with pytest.raises(ai.ModelLoadError, match="'z' is produced by no node"):
        ai.load_model(make_model(nodes, [tensor_info("x", [2])], [tensor_info("z", [2])]))


def _external_model(tmp_path: Path, location: str) -> Path:
    w = np.arange(6, dtype=np.float32)
    (tmp_path / "weights.bin").write_bytes(w.tobytes())
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[6])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in {"location": location, "offset": "0", "length": str(w.nbytes)}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    proto = make_model([helper.make_node("Add", ["x", "w"], ["y"])], [tensor_info("x", [6])],
                       [tensor_info("y", [6])], [tensor], extra_domains=())
    path = tmp_path / "model.onnx"
    path.write_bytes(proto.SerializeToString())
    return path


def test_external_data_inside_the_folder(tmp_path):
    model = ai.load_model(_external_model(tmp_path, "weights.bin"))
    np.testing.assert_array_equal(model.constants["w"], np.arange(6, dtype=np.float32))


def _mapped_by(array: np.ndarray) -> object:
    """The object at the bottom of ``array``'s chain of bases (an mmap when nothing was copied)."""
    base = array
    while getattr(base, "base", None) is not None or isinstance(base, memoryview):
        base = base.obj if isinstance(base, memoryview) else base.base
    return base


def test_large_external_data_is_memory_mapped_not_copied(tmp_path):
    import mmap
    rng = np.random.default_rng(0)
    big = rng.standard_normal((640, 512)).astype(np.float32)  # 1.25 MiB: mapped
    small = np.arange(512, dtype=np.float32)                   # 2 KiB: read
    (tmp_path / "weights.bin").write_bytes(small.tobytes() + big.tobytes())  # big at an unaligned offset
    tensors = []
    for name, array, offset in (("small", small, 0), ("big", big, small.nbytes)):
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(array.shape))
        tensor.data_location = TensorProto.EXTERNAL
        _external_entry(tensor, location="weights.bin", offset=str(offset), length=str(array.nbytes))
        tensors.append(tensor)
    proto = make_model([helper.make_node("MatMul", ["x", "big"], ["m"]), helper.make_node("Add", ["m", "small"], ["y"])],
                       [tensor_info("x", [6, 640])], [tensor_info("y", [6, 512])], tensors, extra_domains=())
    onnx.save(proto, tmp_path / "model.onnx")
    model = ai.load_model(tmp_path / "model.onnx")
    np.testing.assert_array_equal(model.constants["big"], big)
    assert isinstance(_mapped_by(model.constants["big"]), mmap.mmap)
    assert not model.constants["big"].flags.writeable  # kernels derive new arrays, never write weights
    assert not isinstance(_mapped_by(model.constants["small"]), mmap.mmap)
    x = rng.standard_normal((6, 640)).astype(np.float32)
    with ai.Worker(model) as w:
        np.testing.assert_allclose(w.run_blocking(x)["y"], x @ big + small, rtol=1e-4, atol=1e-4)


def test_shape_inference_sees_types_of_large_initializers_without_their_data():
    # The weights (over the inference copy's threshold) become typed inputs of the copy that onnx
    # infers shapes on; the shapes of values computed from them are still known after load.
    w = numpy_helper.from_array(np.ones((512, 1024), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    model = ai.load_model(make_model(nodes, [tensor_info("x", ["n", 512])], [tensor_info("y", ["n", 1024])], [w],
                                     extra_domains=()))
    assert model.value_info["h"].shape == ("n", 1024)
    assert model.value_info["h"].dtype == np.float32


@pytest.mark.parametrize("location", ["../weights.bin", "/etc/passwd", "sub/../../weights.bin"])
def test_external_data_escaping_the_folder_is_refused(tmp_path, location):
    inner = tmp_path / "inner"
    inner.mkdir()
    (tmp_path / "weights.bin").write_bytes(np.zeros(6, np.float32).tobytes())
    path = _external_model(inner, location)
    with pytest.raises(ai.ModelLoadError, match="outside the model's folder"):
        ai.load_model(path)


def test_external_data_truncated(tmp_path):
    path = _external_model(tmp_path, "weights.bin")
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 8)
    with pytest.raises(ai.ModelLoadError, match="truncated"):
        ai.load_model(path)


def test_external_data_from_bytes_needs_a_path(tmp_path):
    path = _external_model(tmp_path, "weights.bin")
    with pytest.raises(ai.ModelLoadError, match="load it by path"):
        ai.load_model(path.read_bytes())


def test_tensor_over_the_size_limit(tmp_path):
    with pytest.raises(ai.ModelTooLargeError, match="initializer 'w' size in bytes: 16 exceeds Limits.max_tensor_bytes = 8"):
        ai.load_model(_mul_model(), limits=ai.Limits(max_tensor_bytes=8))


def test_max_tensor_bytes_keyword_is_deprecated_but_still_applies():
    with pytest.warns(DeprecationWarning, match="limits=ai.Limits"), pytest.raises(ai.ModelLoadError):
        ai.load_model(_mul_model(), max_tensor_bytes=8)


def test_every_unsupported_op_is_listed_at_load():
    nodes = [helper.make_node("FancyOp", ["x"], ["a"], domain="com.example", name="f1"),
             helper.make_node("OtherOp", ["a"], ["b"], domain="com.example", name="f2"),
             helper.make_node("Relu", ["b"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])], extra_domains=("com.example",))
    with pytest.raises(ai.UnsupportedOperatorError) as info:
        ai.load_model(proto)
    text = str(info.value)
    assert "com.example::FancyOp" in text and "com.example::OtherOp" in text and "2 unsupported" in text


def test_unsupported_attribute_names_op_version_and_attribute():
    # running statistics are outputs of training mode only
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], name="bn")
    inits = [numpy_helper.from_array(np.ones(2, np.float32), n) for n in "sbmv"]
    proto = make_model([node], [tensor_info("x", [1, 2, 3])], [tensor_info("y", [1, 2, 3]), tensor_info("rm", [2]),
                                                               tensor_info("rv", [2])], inits, extra_domains=())
    with pytest.raises(ai.UnsupportedOperatorError, match="BatchNormalization version 15.*training_mode"):
        ai.load_model(proto)


def _external_entry(tensor: TensorProto, **fields: str) -> None:
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in fields.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def test_external_data_through_a_hard_link_is_refused(tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(np.arange(6, dtype=np.float32).tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    path = _external_model(folder, "weights.bin")
    (folder / "weights.bin").unlink()
    os.link(outside, folder / "weights.bin")  # inside the folder by path, outside by content
    with pytest.raises(ai.ModelLoadError, match="hard links"):
        ai.load_model(path)


def test_external_data_through_a_symbolic_link_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    path = _external_model(folder, "link.bin")
    (folder / "link.bin").symlink_to(folder / "weights.bin")  # even one pointing inside the folder
    with pytest.raises(ai.ModelLoadError, match="symbolic link"):
        ai.load_model(path)


@pytest.mark.parametrize("fields, message", [
    (dict(offset="-4"), "offset -4 is negative"),
    (dict(offset="four"), "offset 'four' is not an integer"),
    (dict(length="-1"), "length -1 is negative"),
    (dict(offset=str(2**62)), "truncated"),
])
def test_external_data_offsets_and_lengths_are_checked(tmp_path, fields, message):
    (tmp_path / "weights.bin").write_bytes(np.arange(6, dtype=np.float32).tobytes())
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[6])
    _external_entry(tensor, location="weights.bin", **fields)
    proto = make_model([helper.make_node("Add", ["x", "w"], ["y"])], [tensor_info("x", [6])],
                       [tensor_info("y", [6])], [tensor], extra_domains=())
    path = tmp_path / "model.onnx"
    path.write_bytes(proto.SerializeToString())
    with pytest.raises(ai.ModelLoadError, match=message):
        ai.load_model(path)


def _constant_node_model(folder: Path, location: str) -> Path:
    value = TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[6])
    _external_entry(value, location=location, offset="0", length="24")
    nodes = [helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Add", ["x", "c"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [6])], [tensor_info("y", [6])], extra_domains=())
    path = folder / "model.onnx"
    path.write_bytes(proto.SerializeToString())
    return path


def test_constant_node_external_data_is_read_with_the_same_checks(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(np.arange(6, dtype=np.float32).tobytes())
    (tmp_path / "secret.bin").write_bytes(np.zeros(6, np.float32).tobytes())
    model = ai.load_model(_constant_node_model(folder, "weights.bin"))
    np.testing.assert_array_equal(model.constants["c"], np.arange(6, dtype=np.float32))
    with pytest.raises(ai.ModelLoadError, match="outside the model's folder"):
        ai.load_model(_constant_node_model(folder, "../secret.bin"))
    with pytest.raises(ai.ModelLoadError, match="load it by path"):
        ai.load_model(_constant_node_model(folder, "weights.bin").read_bytes())


def test_attribute_tensors_with_external_data_are_refused(tmp_path):
    value = TensorProto(name="v", data_type=TensorProto.FLOAT, dims=[1])
    _external_entry(value, location="weights.bin", offset="0", length="4")
    (tmp_path / "weights.bin").write_bytes(np.ones(1, np.float32).tobytes())
    nodes = [helper.make_node("ConstantOfShape", ["x"], ["y"], value=value)]
    proto = make_model(nodes, [tensor_info("x", [1], TensorProto.INT64)], [tensor_info("y", [None])],
                       extra_domains=())
    with pytest.raises(ai.ModelLoadError, match="external data"):
        ai.load_model(proto)
