"""Property-based fuzzing of untrusted model files (issue 14).

The property: loading *any* byte string ends in a model or in an ``ai.AsyncInferError``, in
bounded time and memory, never reading a file outside the model's folder; and running a loaded
model on inputs that match its declared signature ends in outputs or an ``ai.AsyncInferError``.

Mutants start from small valid seed models (a Conv/Relu/MaxPool/Gemm net, MatMul+Softmax, a
Reshape/Shape/Gather/Concat shape graph with ConstantOfShape/Expand/Range, an If and a Loop model,
a model with external data, and the packaged digits CNN) and are mutated with hypothesis: protobuf
field mutations (dims, data types, raw_data, attribute values and types, node inputs/outputs,
dropped/duplicated nodes, op types, opsets, declared shapes, external-data entries, in subgraphs
too) and byte flips/truncations/insertions of the serialized model. A second generator builds
single-op models of every registered op with hostile attribute values, input counts, shapes and
element types. Each mutant is loaded, then run
on the CPU with small random inputs built from its declared signature, on a thread with a hang
timeout. While the fuzz runs, the process's data segment is capped (``RLIMIT_DATA``) so that an
allocation bomb is a ``MemoryError`` (a failure at load, an ``ExecutionError`` in a kernel) instead
of the machine's memory.

How to run:

    .venv/bin/pytest -q tests/fuzz                      # quick profile: 280 mutants, derandomized
    .venv/bin/pytest -q -m fuzz tests/fuzz -s           # long profile: 3000 mutated seeds + 2000
                                                        # single-op models (FUZZ_EXAMPLES=n, FUZZ_OP_EXAMPLES=n)
    .venv/bin/pytest -q -m fuzz tests/fuzz --hypothesis-show-statistics   # outcome spread

A failure prints the hypothesis seed and the shrunk mutation list; ``FUZZ_SEED=n`` reruns the long
profile from seed ``n``.
"""
from __future__ import annotations

import asyncio
import os
import resource
import shutil
import sys
import threading
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from onnx import AttributeProto, TensorProto, helper, numpy_helper

import asyncinfer as ai
from asyncinfer import assets
from asyncinfer.ops.registry import registered

# Small run limits: the fuzz explores values, not memory. The data-segment cap is the backstop.
FUZZ_LIMITS = ai.Limits(max_tensor_elements=1 << 22, max_folded_bytes=1 << 24, max_tensor_bytes=1 << 26)
DATA_HEADROOM = 4 << 30  # bytes the process may grow by while fuzzing
HANG_TIMEOUT_S = 60.0  # per mutant, load + worker + run: generous, only a hang reaches it
# A run still going after this is cancelled: allowed only for ops that may legitimately run that
# long (a Loop whose trip count a mutation made 2**40); anything else still running is a hang.
RUN_TIMEOUT_S = 10.0
LONG_RUNNING_OPS = {"Loop", "Scan"}
MAX_RUN_ELEMENTS = 1 << 14  # inputs larger than this are not built: the mutant is loaded only
SECRET = bytes(range(0xA0, 0xB0)) * 4  # content of a file outside the model's folder
NEWEST_OPSET = onnx.defs.onnx_opset_version()


# -- seed models --------------------------------------------------------------------------------
def _vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs, initializers=(), opset=17, name="seed") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="fuzz")
    model.ir_version = 8
    return model


def _f32(name, array):
    return numpy_helper.from_array(np.asarray(array, np.float32), name)


def _i64(name, array):
    return numpy_helper.from_array(np.asarray(array, np.int64), name)


def seed_cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc", "fcb"], ["y"], transB=1, name="fc")]
    inits = [_f32("w", rng.standard_normal((4, 1, 3, 3))), _f32("b", rng.standard_normal(4)),
             _f32("fc", rng.standard_normal((3, 16))), _f32("fcb", np.zeros(3))]
    return _model(nodes, [_vi("x", [1, 1, 4, 4])], [_vi("y", [1, 3])], inits)


def seed_matmul_softmax() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Softmax", ["a"], ["y"], axis=-1)]
    return _model(nodes, [_vi("x", ["batch", 4])], [_vi("y", ["batch", 3])],
                  [_f32("w", rng.standard_normal((4, 3))), _f32("b", [0.1, 0.2, 0.3])])


def seed_shapes() -> onnx.ModelProto:
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Concat", ["n", "three_two"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"]),
             helper.make_node("ConstantOfShape", ["three_two"], ["ones"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
             helper.make_node("Range", ["start", "limit", "delta"], ["ramp"]),
             helper.make_node("Expand", ["ramp", "three_two"], ["ramps"]),
             helper.make_node("Tile", ["ones", "reps"], ["tiled"]),
             helper.make_node("Slice", ["tiled", "zero", "three"], ["sliced"]),
             helper.make_node("Add", ["ramps", "sliced"], ["bias"]),
             helper.make_node("Add", ["r", "bias"], ["y"])]
    inits = [_i64("zero", [0]), _i64("three", [3]), _i64("three_two", [3, 2]), _i64("reps", [2, 1]),
             _f32("start", 0.0), _f32("limit", 2.0), _f32("delta", 1.0)]
    return _model(nodes, [_vi("x", ["n", 6])], [_vi("y", ["n", 3, 2])], inits)


def seed_if() -> onnx.ModelProto:
    then_graph = helper.make_graph([helper.make_node("Add", ["x", "c1"], ["t"])], "then", [], [_vi("t", [2])])
    else_graph = helper.make_graph([helper.make_node("Mul", ["x", "c2"], ["e"])], "else", [], [_vi("e", [2])],
                                   initializer=[_f32("c2", [2.0, 3.0])])
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph, name="branch")]
    return _model(nodes, [_vi("x", [2]), _vi("cond", [], TensorProto.BOOL)], [_vi("y", [2])], [_f32("c1", [1.0, 1.0])])


def seed_loop() -> onnx.ModelProto:
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "x"], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["acc_out", "i_f"], ["scan"])],
        "body", [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("acc_in", [2])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("acc_out", [2]), _vi("scan", [2])])
    nodes = [helper.make_node("Loop", ["trips", "keep_going", "acc0"], ["acc", "scans"], body=body, name="loop")]
    inits = [_i64("trips", 3), numpy_helper.from_array(np.array(True), "keep_going"), _f32("acc0", [0.0, 0.0])]
    return _model(nodes, [_vi("x", [2])], [_vi("acc", [2]), _vi("scans", [3, 2])], inits, opset=16)


def seed_external() -> onnx.ModelProto:
    """A model whose weight lives in ``weights.bin`` next to it (written by :func:`_external_folder`)."""
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in {"location": "weights.bin", "offset": "0", "length": "16"}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"])]
    return _model(nodes, [_vi("x", [4])], [_vi("y", [4])], [tensor])


def seed_digits() -> onnx.ModelProto:
    return onnx.load(assets.default_model_path())


SEEDS = {"cnn": seed_cnn, "matmul_softmax": seed_matmul_softmax, "shapes": seed_shapes, "if": seed_if,
         "loop": seed_loop, "external": seed_external, "digits": seed_digits}
_SEED_BYTES: dict[str, bytes] = {}


def seed_bytes(name: str) -> bytes:
    if name not in _SEED_BYTES:
        _SEED_BYTES[name] = SEEDS[name]().SerializeToString()
    return _SEED_BYTES[name]


# -- the mutations ------------------------------------------------------------------------------
INTERESTING_INTS = [-(1 << 63), -(1 << 31), -2, -1, 0, 1, 2, 3, 7, 255, 1 << 16, (1 << 31) - 1, 1 << 31,
                    1 << 40, (1 << 63) - 1]
OP_TYPES = ["Relu", "Add", "Identity", "Reshape", "Expand", "Tile", "ConstantOfShape", "Range", "Gather",
            "Concat", "Conv", "MaxPool", "Gemm", "MatMul", "Softmax", "Loop", "If", "Scan", "Cast", "Pad",
            "Resize", "OneHot", "Slice", "Transpose", "Split", "Squeeze", "Unsqueeze", "TopK", "NoSuchOp",
            "Constant", "Shape", "Size", "Dropout", "BatchNormalization", "Einsum", "ReduceSum", "Where"]
NAMES = ["x", "y", "w", "", "s", "nowhere", "acc", "cond", "c1", "ones", "target", "weights.bin", "x" * 300]
EXTERNAL_LOCATIONS = ["weights.bin", "../outside.bin", "/etc/passwd", "sub/../../outside.bin", "./weights.bin",
                      "missing.bin", "weights.bin\x00.txt", "", ".", "..", "link.bin", "sub"]


def graphs_of(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    """Every graph of the model, subgraphs included (mutations reach them too)."""
    found, stack = [], [model.graph]
    while stack:
        graph = stack.pop()
        found.append(graph)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == AttributeProto.GRAPH:
                    stack.append(attr.g)
                elif attr.type == AttributeProto.GRAPHS:
                    stack.extend(attr.graphs)
    return found


def tensors_of(model: onnx.ModelProto) -> list[TensorProto]:
    found = []
    for graph in graphs_of(model):
        found += list(graph.initializer)
        for sparse in graph.sparse_initializer:
            found += [sparse.values, sparse.indices]
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == AttributeProto.TENSOR:
                    found.append(attr.t)
                found += list(attr.tensors)
    return found


def value_infos_of(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    return [vi for g in graphs_of(model) for vi in list(g.input) + list(g.output) + list(g.value_info)]


def nodes_of(model: onnx.ModelProto) -> list[tuple[onnx.GraphProto, int]]:
    return [(g, i) for g in graphs_of(model) for i in range(len(g.node))]


def _pick(data, items, label):
    return items[data.draw(st.integers(0, len(items) - 1), label=label)] if items else None


def _ints(data):
    return data.draw(st.one_of(st.sampled_from(INTERESTING_INTS), st.integers(-10, 10)))


def mutate_tensor(data, model) -> str:
    t = _pick(data, tensors_of(model), "tensor")
    if t is None:
        return "no tensor"
    kind = data.draw(st.sampled_from(["dim", "rank", "dtype", "truncate", "extend", "flip", "field", "values",
                                      "strings", "external"]), label="tensor mutation")
    if kind == "dim" and t.dims:
        t.dims[data.draw(st.integers(0, len(t.dims) - 1))] = _ints(data)
    elif kind == "rank":
        if t.dims and data.draw(st.booleans()):
            del t.dims[-1]
        else:
            t.dims.append(data.draw(st.sampled_from([0, 1, 2, 1 << 20, -1])))
    elif kind == "dtype":
        t.data_type = data.draw(st.one_of(st.integers(0, 30), st.sampled_from([999, -1, 1 << 30])))
    elif kind == "truncate" and t.raw_data:
        t.raw_data = t.raw_data[:data.draw(st.integers(0, len(t.raw_data)))]
    elif kind == "extend":
        t.raw_data = t.raw_data + data.draw(st.binary(min_size=1, max_size=16))
    elif kind == "flip" and t.raw_data:
        raw = bytearray(t.raw_data)
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        t.raw_data = bytes(raw)
    elif kind == "field":  # the data moved to a typed field, maybe the wrong one
        count = len(t.raw_data) // 4 or 1
        t.ClearField("raw_data")
        field = data.draw(st.sampled_from(["float_data", "int32_data", "int64_data", "double_data"]))
        getattr(t, field).extend([1] * data.draw(st.sampled_from([count, count - 1, count + 1, 0])))
    elif kind == "values":  # plausible but hostile numbers: shapes, counts, indices
        arr = np.array([_ints(data) for _ in range(max(1, int(np.prod(t.dims)) if 0 < len(t.dims) < 3
                                                             and 0 < np.prod(t.dims) < 8 else 1))])
        if t.data_type in (TensorProto.INT64, TensorProto.INT32, TensorProto.FLOAT):
            dtype = {TensorProto.INT64: np.int64, TensorProto.INT32: np.int32, TensorProto.FLOAT: np.float32}[t.data_type]
            with np.errstate(all="ignore"):
                values = arr.astype(np.float64).astype(dtype) if dtype is not np.float32 else arr.astype(np.float32)
            t.ClearField("raw_data")
            t.raw_data = values.reshape(-1)[:max(1, len(values))].astype(np.dtype(dtype).newbyteorder("<")).tobytes()
            del t.dims[:]
            t.dims.append(len(values))
    elif kind == "strings":
        t.string_data.extend([b"x", b"\xff\xfe"])
    elif kind == "external":
        t.data_location = TensorProto.EXTERNAL
        del t.external_data[:]
        for key, value in external_entries(data).items():
            entry = t.external_data.add()
            entry.key, entry.value = key, value
    return f"tensor {kind}"


def external_entries(data) -> dict[str, str]:
    entries = {"location": data.draw(st.sampled_from(EXTERNAL_LOCATIONS))}
    for key in ("offset", "length"):
        if data.draw(st.booleans()):
            entries[key] = data.draw(st.one_of(st.sampled_from(["0", "4", "16", "-1", "1e3", "x", str(1 << 62),
                                                                 str(-(1 << 63)), " 8", "0x10"]),
                                               st.integers(-4, 64).map(str)))
    if data.draw(st.booleans()):
        entries["checksum"] = "0"
    return entries


def mutate_attribute(data, model) -> str:
    nodes = [(g, i) for g, i in nodes_of(model)]
    picked = _pick(data, nodes, "node")
    if picked is None:
        return "no node"
    graph, index = picked
    node = graph.node[index]
    kind = data.draw(st.sampled_from(["value", "type", "delete", "add", "graph"]), label="attribute mutation")
    if kind == "add" or not node.attribute:
        name = data.draw(st.sampled_from(["axis", "perm", "kernel_shape", "pads", "to", "value", "body", "zzz",
                                          "then_branch", "strides", "dilations", "group", "mode", "axes"]))
        attr = node.attribute.add()
        attr.name = name
        _set_attribute(data, attr, data.draw(st.sampled_from([AttributeProto.INT, AttributeProto.INTS,
                                                              AttributeProto.FLOAT, AttributeProto.STRING,
                                                              AttributeProto.TENSOR, AttributeProto.GRAPH])))
        return "attribute add"
    attr = _pick(data, list(node.attribute), "attribute")
    if kind == "delete":
        node.attribute.remove(attr)
    elif kind == "type":
        new_type = data.draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13]))
        _set_attribute(data, attr, new_type)
    elif kind == "graph" and attr.type == AttributeProto.GRAPH:
        attr.g.ClearField("output") if data.draw(st.booleans()) else attr.g.input.append(_vi("extra", [1]))
    else:
        _set_attribute(data, attr, attr.type)
    return f"attribute {kind}"


def _set_attribute(data, attr: AttributeProto, kind: int) -> None:
    """Give ``attr`` type ``kind`` and a hostile value of that type."""
    for field in ("i", "f", "s", "t", "g", "ints", "floats", "strings", "tensors", "graphs"):
        attr.ClearField(field)
    attr.type = kind
    if kind == AttributeProto.INT:
        attr.i = _ints(data)
    elif kind == AttributeProto.FLOAT:
        attr.f = data.draw(st.sampled_from([float("nan"), float("inf"), -1.0, 0.0, 1e30, 0.5]))
    elif kind == AttributeProto.STRING:
        attr.s = data.draw(st.sampled_from([b"", b"NOTSET", b"SAME_UPPER", b"\xff\xfe", b"linear", b"x" * 100]))
    elif kind == AttributeProto.INTS:
        attr.ints.extend(data.draw(st.lists(st.sampled_from(INTERESTING_INTS + [0, 1, 2]), max_size=6)))
    elif kind == AttributeProto.FLOATS:
        attr.floats.extend([float("nan"), 1.0])
    elif kind == AttributeProto.STRINGS:
        attr.strings.extend([b"a", b"\xff"])
    elif kind == AttributeProto.TENSOR:
        attr.t.CopyFrom(numpy_helper.from_array(np.array(data.draw(st.sampled_from([[1.0], [0], [2, 3]]))), "v"))
    elif kind == AttributeProto.GRAPH:
        attr.g.CopyFrom(helper.make_graph([helper.make_node("Identity", ["x"], ["g_out"])], "g", [],
                                          [_vi("g_out", [2])]))
    elif kind == AttributeProto.TENSORS:
        attr.tensors.append(_f32("tt", [1.0]))


def mutate_node(data, model) -> str:
    picked = _pick(data, nodes_of(model), "node")
    if picked is None:
        return "no node"
    graph, index = picked
    node = graph.node[index]
    kind = data.draw(st.sampled_from(["rename_in", "rename_out", "drop", "duplicate", "op_type", "domain",
                                      "add_input", "drop_input", "move"]), label="node mutation")
    if kind == "rename_in" and node.input:
        node.input[data.draw(st.integers(0, len(node.input) - 1))] = data.draw(st.sampled_from(NAMES + list(node.output)))
    elif kind == "rename_out" and node.output:
        node.output[data.draw(st.integers(0, len(node.output) - 1))] = data.draw(st.sampled_from(NAMES + list(node.input)))
    elif kind == "drop":
        del graph.node[index]
    elif kind == "duplicate":
        graph.node.add().CopyFrom(node)
    elif kind == "op_type":
        node.op_type = data.draw(st.sampled_from(OP_TYPES))
    elif kind == "domain":
        node.domain = data.draw(st.sampled_from(["ai.onnx", "ai.onnx.ml", "com.microsoft", "nowhere", "ai.onnx.preview.training"]))
    elif kind == "add_input":
        node.input.append(data.draw(st.sampled_from(NAMES)))
    elif kind == "drop_input" and node.input:
        del node.input[-1]
    elif kind == "move" and len(graph.node) > 1:
        moved = onnx.NodeProto()
        moved.CopyFrom(node)
        del graph.node[index]
        graph.node.insert(data.draw(st.integers(0, len(graph.node))), moved)
    return f"node {kind}"


def mutate_value_info(data, model) -> str:
    vi = _pick(data, value_infos_of(model), "value info")
    if vi is None:
        return "no value info"
    kind = data.draw(st.sampled_from(["dim", "rank", "elem_type", "name", "no_shape", "sequence"]), label="vi mutation")
    tt = vi.type.tensor_type
    if kind == "dim" and tt.shape.dim:
        d = tt.shape.dim[data.draw(st.integers(0, len(tt.shape.dim) - 1))]
        if data.draw(st.booleans()):
            d.dim_value = _ints(data)
        else:
            d.dim_param = data.draw(st.sampled_from(["n", "batch", "", "x" * 50]))
    elif kind == "rank":
        for _ in range(data.draw(st.sampled_from([1, 2, 40]))):
            tt.shape.dim.add().dim_value = 1
    elif kind == "elem_type":
        tt.elem_type = data.draw(st.one_of(st.integers(0, 30), st.just(999)))
    elif kind == "name":
        vi.name = data.draw(st.sampled_from(NAMES))
    elif kind == "no_shape":
        tt.ClearField("shape")
    elif kind == "sequence":
        vi.type.sequence_type.elem_type.tensor_type.elem_type = TensorProto.FLOAT
    return f"value info {kind}"


def mutate_model(data, model) -> str:
    kind = data.draw(st.sampled_from(["opset", "domain_opset", "ir_version", "drop_input", "drop_output",
                                      "add_output", "clear_opsets"]), label="model mutation")
    if kind == "opset" and model.opset_import:
        model.opset_import[0].version = data.draw(st.sampled_from([-1, 0, 1, 6, 7, 9, 11, 13, 17, NEWEST_OPSET,
                                                                   NEWEST_OPSET + 1, 1 << 40]))
    elif kind == "domain_opset":
        model.opset_import.append(helper.make_opsetid(data.draw(st.sampled_from(["ai.onnx.ml", "", "ai.onnx", "x"])),
                                                      data.draw(st.sampled_from([1, 3, 99]))))
    elif kind == "ir_version":
        model.ir_version = data.draw(st.sampled_from([0, 3, 99]))
    elif kind == "drop_input" and model.graph.input:
        del model.graph.input[data.draw(st.integers(0, len(model.graph.input) - 1))]
    elif kind == "drop_output" and model.graph.output:
        del model.graph.output[data.draw(st.integers(0, len(model.graph.output) - 1))]
    elif kind == "add_output":
        model.graph.output.append(_vi(data.draw(st.sampled_from(NAMES)), [2]))
    elif kind == "clear_opsets":
        del model.opset_import[:]
    return f"model {kind}"


PROTO_MUTATIONS = [mutate_tensor, mutate_attribute, mutate_node, mutate_value_info, mutate_model]


def mutate_bytes(data, raw: bytes) -> tuple[bytes, str]:
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "splice"]), label="byte mutation")
    buf = bytearray(raw)
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            buf[data.draw(st.integers(0, len(buf) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        buf = buf[:data.draw(st.integers(0, len(buf)))]
    elif kind == "insert":
        at = data.draw(st.integers(0, len(buf)))
        buf[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    else:  # a copy of one part of the file elsewhere: nested messages, repeated fields
        a = data.draw(st.integers(0, len(buf) - 1))
        b = data.draw(st.integers(a, min(len(buf), a + 64)))
        at = data.draw(st.integers(0, len(buf)))
        buf[at:at] = buf[a:b]
    return bytes(buf), f"bytes {kind}"


# -- single-op models with hostile attributes -----------------------------------------------------
# Every registered op with an ONNX schema (control flow has its own seeds): attributes of the types
# the schema declares (a wrong type is refused at import) but hostile values, odd input counts,
# shapes and element types. They reach each op's attribute check and kernel directly.
_SCHEMAS = {(s.domain, s.name): s for s in onnx.defs.get_all_schemas()}
_NEWEST = {}
for _schema in onnx.defs.get_all_schemas_with_history():
    _NEWEST[_schema.domain] = max(_NEWEST.get(_schema.domain, 1), _schema.since_version)
SINGLE_OPS = sorted(key for key in registered(builtin_only=True)
                    if key in _SCHEMAS and key[1] not in ("If", "Loop", "Scan", "SequenceMap"))
HOSTILE_FLOATS = [float("nan"), float("inf"), -1.0, 0.0, 0.5, 1e30]


def hostile_attribute(data, name: str, attr_type) -> AttributeProto | None:
    kinds = onnx.defs.OpSchema.AttrType
    if attr_type == kinds.INT:
        value = _ints(data)
    elif attr_type == kinds.FLOAT:
        value = data.draw(st.sampled_from(HOSTILE_FLOATS))
    elif attr_type == kinds.STRING:
        value = data.draw(st.sampled_from(["", "NOTSET", "SAME_LOWER", "bogus", "é", "ij,jk->ik", "x" * 200]))
    elif attr_type == kinds.INTS:
        value = data.draw(st.lists(st.one_of(st.sampled_from(INTERESTING_INTS), st.integers(-3, 3)), max_size=6))
    elif attr_type == kinds.FLOATS:
        value = data.draw(st.lists(st.sampled_from(HOSTILE_FLOATS), max_size=4))
    elif attr_type == kinds.STRINGS:
        value = data.draw(st.lists(st.sampled_from(["", "a", "bogus"]), max_size=3))
    elif attr_type == kinds.TENSOR:
        value = numpy_helper.from_array(np.asarray(data.draw(st.sampled_from([[1.0], [], [[1, 2]], 3, [-1]])),
                                                   dtype=data.draw(st.sampled_from([np.float32, np.int64]))), "t")
    else:
        return None
    return helper.make_attribute(name, value, attr_type=int(attr_type.value))


def single_op_model(data) -> tuple[bytes, str]:
    domain, op_type = data.draw(st.sampled_from(SINGLE_OPS), label="op")
    schema = _SCHEMAS[(domain, op_type)]
    node = helper.make_node(op_type, [], [], domain=domain, name="victim")
    for name, attr in sorted(schema.attributes.items()):
        if attr.required or data.draw(st.booleans()):
            made = hostile_attribute(data, name, attr.type)
            if made is not None:
                node.attribute.append(made)
    n_in = data.draw(st.integers(schema.min_input, max(schema.min_input, min(schema.max_input, schema.min_input + 2))))
    n_out = max(1, min(schema.max_output, schema.min_output))
    node.input.extend(f"i{k}" for k in range(n_in))
    node.output.extend(f"o{k}" for k in range(n_out))
    shape = data.draw(st.lists(st.one_of(st.integers(0, 3), st.just(1 << 40)), max_size=4), label="shape")
    dtype = data.draw(st.sampled_from([TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL, TensorProto.INT32,
                                       TensorProto.FLOAT16, TensorProto.UINT8, TensorProto.STRING]), label="dtype")
    # Inputs after the first may be int64 constants with hostile values (shapes, axes, counts).
    constants = [numpy_helper.from_array(np.array(data.draw(st.lists(st.sampled_from(INTERESTING_INTS), max_size=4)),
                                                  dtype=np.int64), f"i{k}")
                 for k in range(1, n_in) if data.draw(st.booleans())]
    constant_names = {c.name for c in constants}
    graph = helper.make_graph([node], "single", [_vi(f"i{k}", shape, dtype) for k in range(n_in)
                                                 if f"i{k}" not in constant_names],
                              [_vi(f"o{k}", None, 0) for k in range(n_out)], initializer=constants)
    opsets = [helper.make_opsetid("", NEWEST_OPSET)] + ([helper.make_opsetid(domain, _NEWEST[domain])] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets, producer_name="fuzz")
    model.ir_version = 10
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    consts = {c.name: numpy_helper.to_array(c).tolist() for c in constants}
    return model.SerializeToString(), (f"{domain or 'ai.onnx'}::{op_type} {attrs} inputs {n_in}x{shape} "
                                       f"type {dtype} constants {consts}")


# -- running one mutant -------------------------------------------------------------------------
def signature_inputs(model, rng: np.random.Generator) -> dict[str, np.ndarray] | None:
    """Small random inputs matching the model's declared signature, or None when it is unknown or
    too large to build (symbolic dims are 2, unknown ones 1)."""
    inputs = {}
    for info in model.inputs:
        if info.kind != "tensor" or info.shape is None:
            return None
        shape = tuple(d if isinstance(d, int) else (1 if d is None else 2) for d in info.shape)
        if any(d < 0 or d > MAX_RUN_ELEMENTS for d in shape) or int(np.prod(shape, dtype=np.float64)) > MAX_RUN_ELEMENTS:
            return None
        dtype = np.dtype(np.float32) if info.dtype is None else np.dtype(info.dtype)
        if dtype.kind == "b":
            value = rng.random(shape) < 0.5
        elif dtype.kind in "iu":
            value = rng.integers(0, 3, shape).astype(dtype)
        elif dtype.kind in "fc":
            value = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "OUS":
            value = np.full(shape, "a", dtype=object)
        else:
            return None
        inputs[info.name] = value
    return inputs


OUTCOMES: Counter = Counter()
# Messages of the raw exceptions load_model's support check turned into ModelLoadErrors.
SAFETY_NET = "has malformed attributes or subgraphs"
NET_CAUGHT: dict[str, int] = {}


def check_mutant(source, label: str) -> str:
    """Load ``source`` and run it on the CPU: every outcome but an AsyncInferError fails the test."""
    result: dict[str, object] = {}

    def body() -> None:
        try:
            result["outcome"] = _load_and_run(source)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            result["error"] = exc
            result["trace"] = traceback.format_exc()

    thread = threading.Thread(target=body, daemon=True, name="fuzz-mutant")
    thread.start()
    thread.join(HANG_TIMEOUT_S)
    if thread.is_alive():
        pytest.fail(f"mutant ({label}) hangs: no result after {HANG_TIMEOUT_S} s")
    if "error" in result:
        pytest.fail(f"mutant ({label}) raised a non-asyncinfer exception:\n{result['trace']}")
    outcome = str(result["outcome"])
    OUTCOMES[outcome] += 1
    if currently_in_test_context():
        event(outcome)
    return outcome


def _load_and_run(source) -> str:
    try:
        model = ai.load_model(source, limits=FUZZ_LIMITS)
    except ai.AsyncInferError as exc:
        assert "optimizer pass" not in str(exc), f"an optimizer pass failed on a malformed model: {exc}"
        if SAFETY_NET in str(exc):  # an op's check() raised a raw exception: worth fixing in ops/
            NET_CAUGHT.setdefault(str(exc).split(": ", 1)[-1][:200], 0)
            return f"load: {type(exc).__name__} (support-check safety net)"
        return f"load: {type(exc).__name__}"
    for value in model.constants.values():  # nothing from outside the model's folder
        if isinstance(value, np.ndarray) and value.dtype != object and SECRET[:8] in value.tobytes():
            raise AssertionError("a constant holds bytes of a file outside the model's folder")
    inputs = signature_inputs(model, np.random.default_rng(0))
    try:
        with ai.Worker(model, "cpu") as worker:
            if inputs is None:
                return "loaded, run skipped"
            asyncio.run(asyncio.wait_for(worker.run(inputs), RUN_TIMEOUT_S))
    except ai.AsyncInferError as exc:
        return f"run: {type(exc).__name__}"
    except asyncio.TimeoutError:
        long_running = [l.op_type for l in model.layers if l.op_type in LONG_RUNNING_OPS]
        assert long_running, f"the run hangs: no result after {RUN_TIMEOUT_S} s and no Loop to blame"
        return "run: cancelled after the run timeout (a long Loop)"
    return "ran"


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    """A folder holding the external-data seed's weights and, one level up, a secret the mutants
    must never read; and a cap on the process's data segment while the fuzz runs."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "outside.bin").write_bytes(SECRET)
    folder = root / "models"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(np.arange(4, dtype="<f4").tobytes())
    (folder / "sub").mkdir()
    try:
        os.symlink(root / "outside.bin", folder / "link.bin")
    except OSError:
        pass
    limit = _cap_data_segment()
    yield folder
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_DATA, limit)
    shutil.rmtree(root, ignore_errors=True)


def _cap_data_segment():
    """Cap RLIMIT_DATA at the current data size plus DATA_HEADROOM; returns the limit to restore."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        status = Path("/proc/self/status").read_text()
        vm_data = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmData:"))
        old = resource.getrlimit(resource.RLIMIT_DATA)
        cap = vm_data + DATA_HEADROOM
        if old[1] != resource.RLIM_INFINITY:
            cap = min(cap, old[1])
        resource.setrlimit(resource.RLIMIT_DATA, (cap, old[1]))
        return old
    except (OSError, ValueError, StopIteration):
        return None


def fuzz_one(data, folder: Path) -> None:
    """Draw a seed and 1–3 mutations, apply them, and check the mutant."""
    name = data.draw(st.sampled_from(sorted(SEEDS)), label="seed")
    raw = seed_bytes(name)
    labels = [name]
    if data.draw(st.integers(0, 4), label="byte-level?") == 0:
        raw, what = mutate_bytes(data, raw)
        labels.append(what)
    else:
        model = onnx.ModelProto()
        model.ParseFromString(raw)
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            labels.append(data.draw(st.sampled_from(PROTO_MUTATIONS), label="mutation")(data, model))
        try:
            raw = model.SerializeToString()
        except Exception as exc:  # noqa: BLE001 - a mutation protobuf itself refuses to encode
            labels.append(f"unserializable: {type(exc).__name__}")
            return
    label = ", ".join(labels)
    if name == "external" or data.draw(st.integers(0, 9), label="from a file?") == 0:
        path = folder / "model.onnx"
        path.write_bytes(raw)
        check_mutant(path, label)
    else:
        check_mutant(raw, label)


COMMON = dict(deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


def test_seeds_load_and_run(fuzz_env):
    """Every seed is a valid model that loads and runs (else the fuzz would only test refusals)."""
    for name in SEEDS:
        source = fuzz_env / "model.onnx" if name == "external" else seed_bytes(name)
        if name == "external":
            source.write_bytes(seed_bytes(name))
        assert check_mutant(source, name) == "ran", name


@settings(max_examples=200, derandomize=True, **COMMON)
@given(data=st.data())
def test_mutated_models_load_or_fail_cleanly(fuzz_env, data):
    fuzz_one(data, fuzz_env)


@pytest.mark.fuzz
@seed(int(os.environ.get("FUZZ_SEED", "14")))
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "3000")), **COMMON)
@given(data=st.data())
def test_mutated_models_long(fuzz_env, data):
    fuzz_one(data, fuzz_env)


@settings(max_examples=80, derandomize=True, **COMMON)
@given(data=st.data())
def test_single_op_models_with_hostile_attributes(fuzz_env, data):
    raw, label = single_op_model(data)
    check_mutant(raw, label)


@pytest.mark.fuzz
@seed(int(os.environ.get("FUZZ_SEED", "14")))
@settings(max_examples=int(os.environ.get("FUZZ_OP_EXAMPLES", "2000")), **COMMON)
@given(data=st.data())
def test_single_op_models_long(fuzz_env, data):
    raw, label = single_op_model(data)
    check_mutant(raw, label)


@pytest.mark.fuzz
def test_long_profile_summary():
    """Prints how the long profile's mutants ended (run with -s)."""
    total = sum(OUTCOMES.values())
    print(f"\nfuzz: {total} mutants checked")
    for outcome, count in OUTCOMES.most_common():
        print(f"  {count:6d}  {outcome}")
    for message in NET_CAUGHT:
        print(f"  safety net: {message}")
