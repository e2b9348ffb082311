"""ONNX → IR import: parsing, validation, external data, symbolic shapes, op support check."""
from __future__ import annotations

import heapq
import os
import stat
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from ..dtypes import onnx_to_numpy
from ..errors import ModelLoadError
from ..limits import DEFAULT_LIMITS, Limits
from .attributes import attribute_value, attributes_dict, sparse_to_dense
from .ir import Dim, Layer, Model, TensorInfo

ModelSource = Union[str, os.PathLike, bytes, bytearray, memoryview, onnx.ModelProto]

MIN_OPSET = 1
DEFAULT_MAX_TENSOR_BYTES = DEFAULT_LIMITS.max_tensor_bytes


def read_model_proto(source: ModelSource) -> tuple[onnx.ModelProto, Path | None, str]:
    """Parse ``source`` into a ModelProto (external data not yet loaded), its folder and a label."""
    if isinstance(source, onnx.ModelProto):
        return source, None, "<ModelProto>"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _parse(bytes(source), "<bytes>"), None, "<bytes>"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such model file")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read: {exc}") from exc
        return _parse(data, str(path)), path.resolve().parent, str(path)
    raise ModelLoadError(f"cannot load a model from {type(source).__name__}: give a path, bytes or onnx.ModelProto")


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    if not data:
        raise ModelLoadError(f"{label}: empty file, not an ONNX model")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise ModelLoadError(f"{label}: not a valid ONNX model (protobuf parse failed: truncated or not ONNX): {exc}") from exc
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise ModelLoadError(f"{label}: not an ONNX model (no graph found in {len(data)} bytes)")
    return proto


# -- tensors ---------------------------------------------------------------------------------
def tensor_to_array(t: onnx.TensorProto, base_dir: Path | None, max_bytes: int, label: str) -> np.ndarray:
    """NumPy value of an initializer, reading external data only from inside ``base_dir``."""
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return _read_external(t, base_dir, max_bytes, label)
    declared = _declared_bytes(t)
    if declared > max_bytes:
        raise ModelLoadError(f"{label}: tensor {t.name!r} declares {declared} bytes, over the {max_bytes}-byte limit")
    try:
        return numpy_helper.to_array(t)
    except Exception as exc:
        raise ModelLoadError(f"{label}: tensor {t.name!r} is malformed: {exc}") from exc


def _declared_bytes(t: onnx.TensorProto) -> int:
    count = int(np.prod(t.dims, dtype=np.float64)) if t.dims else 1
    try:
        itemsize = onnx_to_numpy(t.data_type).itemsize
    except ModelLoadError:
        itemsize = 1
    return count * itemsize


def _read_external(t: onnx.TensorProto, base_dir: Path | None, max_bytes: int, label: str) -> np.ndarray:
    """The bytes of an external tensor, read only from a regular file inside ``base_dir``: no
    absolute or escaping path, no symbolic link on the way, no file with other hard links (which
    could make a file from anywhere appear inside the folder), offsets and lengths in the file."""
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location")
    what = f"{label}: tensor {t.name!r}"
    if not location:
        raise ModelLoadError(f"{what} is external but names no location")
    if base_dir is None:
        raise ModelLoadError(f"{what} has external data {location!r}, "
                             "but the model was not loaded from a file: load it by path")
    lexical = Path(os.path.normpath(base_dir / location))
    target = lexical.resolve()
    if os.path.isabs(location) or not target.is_relative_to(base_dir):
        raise ModelLoadError(f"{what} has external data {location!r} outside the model's folder")
    if target != lexical:
        raise ModelLoadError(f"{what} has external data {location!r} reached through a symbolic link")
    offset = _external_int(info, "offset", 0, what)
    declared = _declared_bytes(t)
    length = _external_int(info, "length", declared, what)
    if length > max_bytes or declared > max_bytes:
        raise ModelLoadError(f"{what} has {max(length, declared)} bytes, over the {max_bytes}-byte limit")
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ModelLoadError(f"{what}: external data file {location!r} cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        status = os.fstat(f.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise ModelLoadError(f"{what}: external data {location!r} is not a regular file")
        if status.st_nlink > 1:
            raise ModelLoadError(f"{what}: external data file {location!r} has {status.st_nlink} hard links "
                                 "(it may be a file from outside the model's folder): refused")
        if offset + length > status.st_size:
            raise ModelLoadError(f"{what}: external data {location!r} is truncated "
                                 f"(needs bytes {offset}..{offset + length}, file has {status.st_size})")
        f.seek(offset)
        raw = f.read(length)
    dtype = onnx_to_numpy(t.data_type)
    if len(raw) != declared:
        raise ModelLoadError(f"{what}: external data holds {len(raw)} bytes, shape needs {declared}")
    return np.frombuffer(raw, dtype=dtype).reshape(tuple(t.dims)).copy()


def _external_int(info: dict[str, str], key: str, default: int, what: str) -> int:
    """A non-negative integer field (offset, length) of an external-data entry."""
    text = info.get(key)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ModelLoadError(f"{what}: external data {key} {text!r} is not an integer") from None
    if value < 0:
        raise ModelLoadError(f"{what}: external data {key} {value} is negative")
    return value


# -- value infos -------------------------------------------------------------------------------
def value_info_to_tensor_info(vi: onnx.ValueInfoProto) -> TensorInfo:
    field = vi.type.WhichOneof("value")
    if field in ("sequence_type", "optional_type", "map_type"):
        return TensorInfo(vi.name, None, None, kind=field.removesuffix("_type"))
    tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    if tt is None:
        return TensorInfo(vi.name, None, None)
    dtype = onnx_to_numpy(tt.elem_type) if tt.elem_type else None
    if not tt.HasField("shape"):
        return TensorInfo(vi.name, dtype, None)
    dims: list[Dim] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return TensorInfo(vi.name, dtype, tuple(dims))


def _inferred_infos(proto: onnx.ModelProto) -> dict[str, TensorInfo]:
    """Static types/shapes from ONNX shape inference; best effort (a failure just means fewer facts)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception:
        return {}
    infos = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        try:
            infos[vi.name] = value_info_to_tensor_info(vi)
        except ModelLoadError:
            continue
    return infos


# -- graph -------------------------------------------------------------------------------------
def import_model(source: ModelSource, *, limits: Limits = DEFAULT_LIMITS) -> Model:
    """Parse and validate an ONNX model into the IR (no optimisation, no op support check)."""
    proto, base_dir, label = read_model_proto(source)
    opsets = {(o.domain if o.domain != "ai.onnx" else ""): int(o.version) for o in proto.opset_import}
    if "" not in opsets:
        opsets[""] = MIN_OPSET if not proto.opset_import else max(MIN_OPSET, min(opsets.values(), default=MIN_OPSET))
    newest = onnx.defs.onnx_opset_version()
    if opsets[""] < MIN_OPSET:
        raise ModelLoadError(f"{label}: opset {opsets['']} is older than the oldest supported ({MIN_OPSET}); "
                             "convert it with onnx.version_converter")
    if opsets[""] > newest:
        raise ModelLoadError(f"{label}: opset {opsets['']} is newer than the installed onnx knows ({newest})")
    graph = proto.graph
    inputs, outputs, layers, constants = import_graph(graph, opsets, base_dir=base_dir, label=label,
                                                      max_tensor_bytes=limits.max_tensor_bytes)
    if not outputs:
        raise ModelLoadError(f"{label}: the graph declares no outputs")
    value_info = _inferred_infos(proto) if layers else {}
    for vi in graph.value_info:
        value_info.setdefault(vi.name, value_info_to_tensor_info(vi))
    # Outputs without a declared type take the inferred one, so users see dtype/shape where known.
    outputs = [value_info.get(o.name, o) if o.dtype is None else o for o in outputs]
    return Model(inputs=inputs, outputs=outputs, layers=layers, constants=constants, opsets=opsets,
                 value_info=value_info, name=graph.name or Path(label).stem, producer=proto.producer_name,
                 source=label, limits=limits)


def import_graph(graph: onnx.GraphProto, opsets: dict[str, int], *, base_dir: Path | None = None,
                 label: str = "<graph>", max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
                 outer_scope: frozenset[str] = frozenset()
                 ) -> tuple[list[TensorInfo], list[TensorInfo], list[Layer], dict[str, np.ndarray]]:
    """Inputs, outputs, topologically ordered layers and constants of a graph or subgraph.

    ``outer_scope`` names the values a subgraph may read from its enclosing graphs. A layer with
    subgraph attributes (If, Loop, Scan…) gets the outer values its subgraphs read appended to its
    inputs, listed in ``Layer.outer_inputs``, so the scheduler waits for them like any input.
    """
    constants: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        constants[init.name] = tensor_to_array(init, base_dir, max_tensor_bytes, label)
    for sparse in graph.sparse_initializer:
        constants[sparse.values.name] = sparse_to_dense(sparse)

    inputs = [value_info_to_tensor_info(vi) for vi in graph.input if vi.name not in constants]
    outputs = [value_info_to_tensor_info(vi) for vi in graph.output]
    visible = frozenset({i.name for i in inputs} | set(constants) | {o for n in graph.node for o in n.output})

    layers: list[Layer] = []
    names_seen: set[str] = set()
    for index, node in enumerate(graph.node):
        name = node.name or f"{node.op_type}_{index}"
        if name in names_seen:
            name = f"{name}_{index}"
        names_seen.add(name)
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            constants[node.output[0]] = _constant_node_value(node, label, base_dir, max_tensor_bytes)
            continue
        try:
            attrs = attributes_dict(node.attribute)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{label}: node {name!r} ({node.op_type}): {exc}") from exc
        domain = node.domain if node.domain != "ai.onnx" else ""
        outer = _outer_references(node, visible | outer_scope)
        layers.append(Layer(name=name, op_type=node.op_type, inputs=list(node.input) + outer,
                            outputs=list(node.output), attrs=attrs, domain=domain, version=opsets.get(domain, 1),
                            outer_inputs=outer))

    layers = topological_order(layers, {i.name for i in inputs} | set(constants) | set(outer_scope), label)
    produced = {o for l in layers for o in l.outputs if o} | {i.name for i in inputs} | set(constants) | outer_scope
    for out in outputs:
        if out.name not in produced:
            raise ModelLoadError(f"{label}: graph output {out.name!r} is produced by no node")
    return inputs, outputs, layers, constants


def _outer_references(node: onnx.NodeProto, available: frozenset[str]) -> list[str]:
    """Names the node's subgraphs (at any depth) read from outside themselves, in first-use order."""
    found: dict[str, None] = {}

    def visit(graph: onnx.GraphProto, enclosing_defined: set[str]) -> None:
        defined = set(enclosing_defined) | {i.name for i in graph.input} | {t.name for t in graph.initializer} \
            | {t.values.name for t in graph.sparse_initializer} | {o for n in graph.node for o in n.output}
        for inner in graph.node:
            for name in inner.input:
                if name and name not in defined:
                    found.setdefault(name, None)
            for attr in inner.attribute:
                for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    visit(sub, defined)
        for out in graph.output:
            if out.name not in defined:
                found.setdefault(out.name, None)

    for attr in node.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            visit(sub, set())
    missing = [n for n in found if n not in available]
    if missing:
        raise ModelLoadError(f"subgraph of node {node.name or node.op_type!r} reads {missing}, defined nowhere")
    return list(found)


def _constant_node_value(node: onnx.NodeProto, label: str, base_dir: Path | None, max_bytes: int) -> np.ndarray:
    if len(node.attribute) != 1:
        raise ModelLoadError(f"{label}: Constant node {node.name!r} must have exactly one value attribute")
    attr = node.attribute[0]
    if attr.type == onnx.AttributeProto.TENSOR:  # the same checks as an initializer (external data too)
        return tensor_to_array(attr.t, base_dir, max_bytes, label)
    value: Any = attribute_value(attr)
    if attr.name in ("value_float", "value_floats"):
        return np.asarray(value, dtype=np.float32)
    if attr.name in ("value_int", "value_ints"):
        return np.asarray(value, dtype=np.int64)
    if attr.name in ("value_string", "value_strings"):
        return np.asarray(value, dtype=object)
    return np.asarray(value)


def topological_order(layers: list[Layer], available: set[str], label: str) -> list[Layer]:
    """Layers sorted so every input is produced first; cycles and undefined inputs are ModelLoadErrors."""
    producer: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for out in layer.outputs:
            if not out:
                continue
            if out in producer or out in available:
                raise ModelLoadError(f"{label}: value {out!r} is produced twice (by {layer.describe()})")
            producer[out] = i
    deps: list[set[int]] = []
    for layer in layers:
        mine = set()
        for name in layer.inputs:
            if not name or name in available:
                continue
            if name not in producer:
                raise ModelLoadError(f"{label}: {layer.describe()} uses input {name!r}, which is defined nowhere "
                                     "(not a graph input, initializer or node output)")
            mine.add(producer[name])
        deps.append(mine)
    # Kahn's algorithm, keeping the file's order among ready layers (it is usually already sorted).
    dependents: list[list[int]] = [[] for _ in layers]
    missing = [len(d) for d in deps]
    for i, d in enumerate(deps):
        for j in d:
            dependents[j].append(i)
    ready = [i for i, m in enumerate(missing) if m == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for k in dependents[i]:
            missing[k] -= 1
            if missing[k] == 0:
                heapq.heappush(ready, k)
    if len(order) != len(layers):
        stuck = [layers[i].name for i in range(len(layers)) if missing[i] > 0]
        raise ModelLoadError(f"{label}: the graph has a cycle through {len(stuck)} node(s): {', '.join(stuck[:8])}")
    return [layers[i] for i in order]
