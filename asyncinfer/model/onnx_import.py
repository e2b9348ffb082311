"""ONNX → IR import: parsing, validation, external data, symbolic shapes, op support check.

A model file is untrusted: every step here ends in the IR or in a `ModelLoadError` (or its
`ModelTooLargeError` subclass) naming the file and the part at fault. The bounds of
`Limits` are checked before the work they guard: the file's size before
it is read, the node count, nesting depth, ranks and declared tensor sizes of the whole graph
(subgraphs included, walked without recursion) before any tensor is decoded.
"""
from __future__ import annotations

import heapq
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import AttributeProto, TensorProto

from ..dtypes import onnx_to_numpy
from ..errors import ModelLoadError, ModelTooLargeError
from ..limits import DEFAULT_LIMITS, Limits
from .attributes import attribute_value, attributes_dict, sparse_to_dense, subgraphs
from .gradient_graph import FORWARD_OPSETS, is_gradient, with_forward_graph
from .gradient_graph import producers as gradient_producers
from .ir import Dim, Layer, Model, TensorInfo
from .mapped import map_or_read
from .tensors import PACKED_BITS, check_size, check_tensor_data, declared_bytes, inline_to_array, itemsize, native

ModelSource = Union[str, os.PathLike, bytes, bytearray, memoryview, onnx.ModelProto]

MIN_OPSET = 1
DEFAULT_MAX_TENSOR_BYTES = DEFAULT_LIMITS.max_tensor_bytes
# Shape inference runs on a copy without initializers of this size or more (see _weightless).
WEIGHTLESS_KEEP_BYTES = 4096
WEIGHTLESS_MIN_BYTES = 1 << 20


def read_model_proto(source: ModelSource, limits: Limits = DEFAULT_LIMITS) -> tuple[onnx.ModelProto, Path | None, str]:
    """Parse ``source`` into a ModelProto (external data not yet loaded), its folder and a label.

    The size bound ``limits.max_model_bytes`` is checked before a file is read or bytes parsed."""
    if isinstance(source, onnx.ModelProto):
        limits.check_model("max_model_bytes", source.ByteSize(), "<ModelProto>: model size in bytes")
        return source, None, "<ModelProto>"
    if isinstance(source, (bytes, bytearray, memoryview)):
        limits.check_model("max_model_bytes", memoryview(source).nbytes, "<bytes>: model size in bytes")
        return _parse(bytes(source), "<bytes>"), None, "<bytes>"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            size = path.stat().st_size if path.is_file() else None
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read: {exc}") from exc
        if size is None:
            raise ModelLoadError(f"{path}: a directory, not a model file" if path.is_dir() else
                                 f"{path}: no such model file")
        limits.check_model("max_model_bytes", size, f"{path}: model file size in bytes")
        try:
            with open(path, "rb") as f:  # one byte more than stat said: the file may grow meanwhile
                data = f.read(size + 1)  # (never read(limit): Python would allocate the whole limit)
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read: {exc}") from exc
        if len(data) != size:
            raise ModelLoadError(f"{path}: the file changed size while it was read ({size} bytes, then {len(data)})")
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


# -- structure limits --------------------------------------------------------------------------
def walk_graphs(graph: onnx.GraphProto) -> Iterator[tuple[onnx.GraphProto, int, str]]:
    """Every graph of ``graph``'s tree, the root included, with its nesting depth (the root is 0)
    and a path naming it; iterative, so no nesting can exhaust Python's stack."""
    stack = [(graph, 0, "")]
    while stack:
        g, depth, where = stack.pop()
        yield g, depth, where
        for index, node in enumerate(g.node):
            node_name = node.name or f"{node.op_type}_{index}"
            for attr in node.attribute:
                for sub in subgraphs(attr):
                    stack.append((sub, depth + 1, f"{where}{node_name}/{attr.name}/"))


def check_structure(graph: onnx.GraphProto, limits: Limits, label: str) -> int:
    """Check the whole graph tree against ``limits`` before any heavy work; returns the node count.

    Nodes (subgraphs included), nesting depth, the rank of every declared value, and the rank and
    declared size of every tensor (initializers, sparse initializers, attribute tensors). Names
    are checked to be text too: protobuf hands out a string field that is not UTF-8 as bytes."""
    nodes = 0
    for g, depth, where in walk_graphs(graph):
        limits.check_model("max_graph_depth", depth, f"{label}: subgraph {where.rstrip('/')!r} nesting depth")
        nodes += len(g.node)
        limits.check_model("max_nodes", nodes, f"{label}: node count (subgraphs included)")
        check_text(f"{label}: graph {where!r}", [g.name])
        for vi in _chain(g.input, g.output, g.value_info):
            check_text(f"{label}: a value of graph {where!r}", [vi.name])
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                dims = vi.type.tensor_type.shape.dim
                limits.check_model("max_tensor_rank", len(dims), f"{label}: value {where + vi.name!r} rank")
                check_text(f"{label}: value {where + vi.name!r}", [d.dim_param for d in dims])
        for t in g.initializer:
            check_text(f"{label}: an initializer of graph {where!r}", [t.name])
            _check_tensor_limits(t, limits, f"{label}: initializer {where + t.name!r}")
        for s in g.sparse_initializer:
            check_text(f"{label}: a sparse initializer of graph {where!r}", [s.values.name, s.indices.name])
            _check_sparse_limits(s, limits, f"{label}: sparse initializer {where + s.values.name!r}")
        for index, node in enumerate(g.node):
            check_text(f"{label}: node {index} of graph {where!r}",
                       _chain([node.name, node.op_type, node.domain], node.input, node.output,
                              (a.name for a in node.attribute)))
            if node.op_type in _INFERENCE_HAZARDS and node.domain in ("", "ai.onnx"):
                name = where + (node.name or f"{node.op_type}_{index}")
                _INFERENCE_HAZARDS[node.op_type](node, f"{label}: node {name!r} ({node.op_type})")
            for attr in node.attribute:
                what = f"{label}: node {where + (node.name or f'{node.op_type}_{index}')!r} attribute {attr.name!r}"
                if attr.type == AttributeProto.TENSOR:
                    _check_tensor_limits(attr.t, limits, what)
                elif attr.type == AttributeProto.TENSORS:
                    for t in attr.tensors:
                        _check_tensor_limits(t, limits, what)
                elif attr.type == AttributeProto.SPARSE_TENSOR:
                    _check_sparse_limits(attr.sparse_tensor, limits, what)
    return nodes


# Attribute values onnx's C++ shape inference loops forever or crashes the process on (found by
# tests/fuzz and a survey of every op's attributes): refused before it runs.
_EINSUM_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ,->. ")


def _check_einsum(node: onnx.NodeProto, what: str) -> None:
    """An equation byte outside ASCII letters and ``,->.`` sends shape inference into an endless loop."""
    for attr in node.attribute:
        if attr.name == "equation" and attr.type == AttributeProto.STRING:
            if not set(attr.s.decode("latin-1")) <= _EINSUM_CHARACTERS:
                raise ModelLoadError(f"{what}: equation {attr.s[:60]!r} holds characters other than "
                                     "ASCII letters and ',', '->', '...'")


def _check_gather_nd(node: onnx.NodeProto, what: str) -> None:
    """A negative ``batch_dims`` makes shape inference read out of bounds (a segmentation fault)."""
    for attr in node.attribute:
        if attr.name == "batch_dims" and attr.type == AttributeProto.INT and attr.i < 0:
            raise ModelLoadError(f"{what}: batch_dims {attr.i} is negative")


_INFERENCE_HAZARDS = {"Einsum": _check_einsum, "GatherND": _check_gather_nd}


def check_text(what: str, values: Iterable[Any]) -> None:
    """ModelLoadError if a name is bytes: protobuf's way of handing out a string that is not UTF-8."""
    for value in values:
        if not isinstance(value, str):
            raise ModelLoadError(f"{what} has a name that is not UTF-8 text: {value[:40]!r}")


def _chain(*parts: Iterable[Any]) -> Iterator[Any]:
    for part in parts:
        yield from part


def _check_tensor_limits(t: onnx.TensorProto, limits: Limits, what: str) -> None:
    limits.check_model("max_tensor_rank", len(t.dims), f"{what} rank")
    limits.check_model("max_tensor_bytes", declared_bytes(t), f"{what} size in bytes")


def _check_sparse_limits(s: onnx.SparseTensorProto, limits: Limits, what: str) -> None:
    limits.check_model("max_tensor_rank", len(s.dims), f"{what} rank")
    dense = math.prod(max(int(d), 0) for d in s.dims) * itemsize(s.values.data_type)
    limits.check_model("max_tensor_bytes", dense, f"{what} dense size in bytes")
    _check_tensor_limits(s.values, limits, f"{what} values")
    _check_tensor_limits(s.indices, limits, f"{what} indices")


# -- tensors ---------------------------------------------------------------------------------
def tensor_to_array(t: onnx.TensorProto, base_dir: Path | None, max_bytes: int, label: str) -> np.ndarray:
    """NumPy value of an initializer or Constant, reading external data only from inside ``base_dir``.

    The element type, dims and data are checked against each other and ``max_bytes`` first, so
    a malformed tensor is a ModelLoadError naming it; the array is in native byte order."""
    what = f"{label}: tensor {t.name!r}"
    check_size(t, max_bytes, what)
    if t.data_location == onnx.TensorProto.EXTERNAL:
        check_tensor_data(t, what)
        return native(_read_external(t, base_dir, max_bytes, label))
    return inline_to_array(t, max_bytes, what)


def _read_external(t: onnx.TensorProto, base_dir: Path | None, max_bytes: int, label: str) -> np.ndarray:
    """The bytes of an external tensor, read only from a regular file inside ``base_dir``: no
    absolute or escaping path, no symbolic link on the way, no file with other hard links (which
    could make a file from anywhere appear inside the folder), offsets and lengths in the file."""
    what = f"{label}: tensor {t.name!r}"
    check_text(f"{what}: external data", _chain((e.key for e in t.external_data), (e.value for e in t.external_data)))
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location")
    if not location:
        raise ModelLoadError(f"{what} is external but names no location")
    if base_dir is None:
        raise ModelLoadError(f"{what} has external data {location!r}, "
                             "but the model was not loaded from a file: load it by path")
    if "\x00" in location:
        raise ModelLoadError(f"{what} has external data {location!r}: a location cannot hold a NUL byte")
    lexical = Path(os.path.normpath(base_dir / location))
    try:
        target = lexical.resolve()
    except (OSError, RuntimeError) as exc:  # a symbolic link loop, a name too long
        raise ModelLoadError(f"{what} has external data {location!r} that cannot be resolved: {exc}") from None
    if os.path.isabs(location) or not target.is_relative_to(base_dir):
        raise ModelLoadError(f"{what} has external data {location!r} outside the model's folder")
    if target != lexical:
        raise ModelLoadError(f"{what} has external data {location!r} reached through a symbolic link")
    if t.data_type == TensorProto.STRING or t.data_type in PACKED_BITS:
        raise ModelLoadError(f"{what}: external data of element type "
                             f"{TensorProto.DataType.Name(t.data_type)} is not supported")
    dtype = check_tensor_data(t, what)
    dims = [int(d) for d in t.dims]
    offset = _external_int(info, "offset", 0, what)
    declared = declared_bytes(t)
    length = _external_int(info, "length", declared, what)
    if length > max_bytes:
        raise ModelTooLargeError("max_tensor_bytes", length, max_bytes, f"{what}: external data length in bytes")
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ModelLoadError(f"{what}: external data file {location!r} cannot be opened ({reason})") from None
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):  # checked on the descriptor before any read (a folder, a FIFO)
        os.close(fd)
        raise ModelLoadError(f"{what}: external data {location!r} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if status.st_nlink > 1:
            raise ModelLoadError(f"{what}: external data file {location!r} has {status.st_nlink} hard links "
                                 "(it may be a file from outside the model's folder): refused")
        if offset + length > status.st_size:
            raise ModelLoadError(f"{what}: external data {location!r} is truncated "
                                 f"(needs bytes {offset}..{offset + length}, file has {status.st_size})")
        if length != declared:  # checked before reading: no allocation for a wrong length
            raise ModelLoadError(f"{what}: external data holds {length} bytes, shape {dims} needs {declared}")
        raw = map_or_read(f, offset, length)
    if len(raw) != declared:
        raise ModelLoadError(f"{what}: external data holds {len(raw)} bytes, shape {dims} needs {declared}")
    # ONNX data is little-endian on every host: read it as such; on a little-endian host the
    # conversion to native order is a no-op that keeps the mapping (no copy).
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(tuple(dims)).astype(dtype, copy=False)


def _external_int(info: dict[str, str], key: str, default: int, what: str) -> int:
    """A non-negative integer field (offset, length) of an external-data entry."""
    text = info.get(key)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ModelLoadError(f"{what}: external data {key} {text[:40]!r} is not an integer") from None
    if value < 0:
        raise ModelLoadError(f"{what}: external data {key} {value} is negative")
    return value


# -- value infos -------------------------------------------------------------------------------
# Names exporters write for "any size" rather than for a size shared by several axes: Paddle2ONNX's
# "?" (on every unknown axis) and "-1", tf2onnx's "unk__<n>", Keras's "None". ONNX Runtime checks no
# dimension name, so reading these as names would refuse inputs it runs (two "?" axes made equal).
_PLACEHOLDER_DIM = re.compile(r"\?|-?\d+|unk__\d+|none|null|unknown|\s*", re.IGNORECASE)


def is_placeholder_dim(name: str) -> bool:
    """Whether the dimension name ``name`` stands for "any size" (see `_PLACEHOLDER_DIM`)."""
    return _PLACEHOLDER_DIM.fullmatch(name) is not None


def _any_size(d: onnx.TensorShapeProto.Dimension) -> bool:
    """A dimension read as "any size": none given, a negative size (ONNX Runtime's reading of
    Paddle2ONNX's -1), or a placeholder name. A size of 0 is a literal 0, as for ONNX Runtime."""
    if d.HasField("dim_value"):
        return d.dim_value < 0
    return not d.HasField("dim_param") or is_placeholder_dim(d.dim_param)


def value_info_to_tensor_info(vi: onnx.ValueInfoProto, limits: Limits = DEFAULT_LIMITS, where: str = "value") -> TensorInfo:
    """Name, dtype and (symbolic) shape of a declared value; an unknown element type or a rank over
    ``limits.max_tensor_rank`` is a ModelLoadError naming the value (``where`` says what it is:
    "<file>: graph input"...). A dimension is its size, its name, or None for "any size" (see
    `_any_size`): placeholder names never tie axes together."""
    field = vi.type.WhichOneof("value")
    if field in ("sequence_type", "optional_type", "map_type"):
        return TensorInfo(vi.name, None, None, kind=field.removesuffix("_type"))
    tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    if tt is None:
        return TensorInfo(vi.name, None, None)
    try:
        dtype = onnx_to_numpy(tt.elem_type) if tt.elem_type else None
    except ModelLoadError as exc:
        raise ModelLoadError(f"{where} {vi.name!r}: {exc}") from None
    if not tt.HasField("shape"):
        return TensorInfo(vi.name, dtype, None)
    limits.check_model("max_tensor_rank", len(tt.shape.dim), f"{where} {vi.name!r} rank")
    dims: list[Dim] = []
    for d in tt.shape.dim:
        if _any_size(d):
            dims.append(None)
        else:
            dims.append(int(d.dim_value) if d.HasField("dim_value") else d.dim_param)
    return TensorInfo(vi.name, dtype, tuple(dims))


def _inferred_infos(proto: onnx.ModelProto, limits: Limits) -> dict[str, TensorInfo]:
    """Static types/shapes from ONNX shape inference; best effort (a failure just means fewer facts).

    Without data propagation: onnx's data propagation builds one protobuf dimension per element of
    a 1-D tensor it propagates through, so a declared shape ``[2**40]`` feeding an Add keeps load
    busy for hours (found by a survey of every op under hostile inputs). The optimizer folds shape
    computations itself (``Shape`` of static tensors, then the layers reading it)."""
    try:
        light = _weightless(proto)
        inferred = onnx.shape_inference.infer_shapes(_any_size_cleared(light, owned=light is not proto),
                                                     strict_mode=False, data_prop=False)
    except Exception:
        return {}
    infos = {}
    for vi in _chain(inferred.graph.value_info, inferred.graph.output):
        try:
            infos[vi.name] = value_info_to_tensor_info(vi, limits)
        except ModelLoadError:
            continue
    return infos


def _any_size_cleared(proto: onnx.ModelProto, owned: bool = False) -> onnx.ModelProto:
    """``proto`` for shape inference with every any-size dimension (`_any_size`) left blank.

    onnx computes with a declared -1 as if it were a size (Flatten of (-1, -1, 4) infers a literal
    (1, 4), which the optimizer would fold as the Shape) and makes all the "?" of a graph one
    symbol. ``proto`` is changed in place if ``owned``, else copied when some dimension needs it."""
    def declared(graph: onnx.GraphProto) -> Iterator[onnx.TensorShapeProto.Dimension]:
        for vi in _chain(graph.input, graph.output, graph.value_info):
            if vi.type.HasField("tensor_type"):
                yield from vi.type.tensor_type.shape.dim

    def marked(model: onnx.ModelProto) -> list[onnx.TensorShapeProto.Dimension]:
        return [d for g, _, _ in walk_graphs(model.graph) for d in declared(g)
                if _any_size(d) and (d.HasField("dim_value") or d.HasField("dim_param"))]

    if not owned:
        if not marked(proto):
            return proto
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)  # small: large weights make _weightless build an owned copy
        proto = copy
    for d in marked(proto):
        d.Clear()
    return proto


def _weightless(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` for shape inference: large initializers become typed graph inputs, so onnx does
    not serialise and copy the weights (twice) to infer shapes. Small ones stay: inference reads
    their values (a Reshape's target shape, a Slice's starts)."""
    graph = proto.graph
    if sum(t.ByteSize() for t in graph.initializer) < WEIGHTLESS_MIN_BYTES:  # ByteSize: no copy
        return proto  # not worth a copy of the graph
    light = onnx.ModelProto(ir_version=proto.ir_version)
    light.opset_import.extend(proto.opset_import)
    light.functions.extend(proto.functions)
    g = light.graph
    g.name = graph.name
    g.node.extend(graph.node)
    g.output.extend(graph.output)
    g.value_info.extend(graph.value_info)
    g.input.extend(graph.input)
    declared = {i.name for i in graph.input}
    for t in graph.initializer:
        if t.data_location != TensorProto.EXTERNAL and t.ByteSize() < WEIGHTLESS_KEEP_BYTES:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return light


# -- graph -------------------------------------------------------------------------------------
def import_model(source: ModelSource, *, limits: Limits = DEFAULT_LIMITS) -> Model:
    """Parse and validate an ONNX model into the IR (no optimisation, no op support check)."""
    proto, base_dir, label = read_model_proto(source, limits)
    check_text(f"{label}: the model", _chain([proto.producer_name], (o.domain for o in proto.opset_import)))
    opsets: dict[str, int] = {}
    for o in proto.opset_import:
        opsets[o.domain if o.domain != "ai.onnx" else ""] = int(o.version)
    if "" not in opsets:
        opsets[""] = MIN_OPSET if not proto.opset_import else max(MIN_OPSET, min(opsets.values(), default=MIN_OPSET))
    newest = onnx.defs.onnx_opset_version()
    if opsets[""] < MIN_OPSET:
        raise ModelLoadError(f"{label}: opset {opsets['']} is older than the oldest supported ({MIN_OPSET}); "
                             "convert it with onnx.version_converter")
    if opsets[""] > newest:
        raise ModelLoadError(f"{label}: opset {opsets['']} is newer than the installed onnx knows ({newest})")
    graph = proto.graph
    check_structure(graph, limits, label)
    inputs, outputs, layers, constants = import_graph(graph, opsets, base_dir=base_dir, label=label, limits=limits)
    defaults = _overridable_initializers(graph, proto.ir_version, inputs, constants, limits, label)
    initializer_names = {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    if not outputs:
        raise ModelLoadError(f"{label}: the graph declares no outputs")
    value_info = _inferred_infos(proto, limits) if layers else {}
    for vi in graph.value_info:
        value_info.setdefault(vi.name, value_info_to_tensor_info(vi, limits, f"{label}: value_info"))
    # Outputs without a declared type take the inferred one, so users see dtype/shape where known.
    outputs = [value_info.get(o.name, o) if o.dtype is None else o for o in outputs]
    return Model(inputs=inputs, outputs=outputs, layers=layers, constants=constants, opsets=opsets,
                 value_info=value_info, name=graph.name or Path(label).stem, producer=proto.producer_name,
                 source=label, limits=limits, input_defaults=defaults,
                 constant_initializers=frozenset(initializer_names - set(defaults)))


#: The first IR version whose initializers may be left out of the graph inputs: from it on, an
#: initializer listed as an input is a default the caller may override (before it, every
#: initializer had to be listed, and a listed one is a constant).
OVERRIDABLE_IR_VERSION = 4


def _overridable_initializers(graph: onnx.GraphProto, ir_version: int, inputs: list[TensorInfo],
                              constants: dict[str, np.ndarray], limits: Limits, label: str) -> dict[str, np.ndarray]:
    """Move the initializers that are also graph inputs (IR >= 4) from ``constants`` to the end of
    ``inputs`` (in graph-input order) and return their default values, read-only.

    The declared element type must be the initializer's (a ModelLoadError otherwise); a declared
    shape the default does not have gives way to the default's shape, which overrides must match."""
    if ir_version < OVERRIDABLE_IR_VERSION:
        return {}
    defaults: dict[str, np.ndarray] = {}
    for vi in graph.input:
        if vi.name not in constants or vi.name in defaults:
            continue
        value = constants.pop(vi.name)
        info = value_info_to_tensor_info(vi, limits, f"{label}: graph input")
        if info.kind != "tensor":
            raise ModelLoadError(f"{label}: graph input {vi.name!r} is declared a {info.kind} but has a tensor "
                                 "initializer")
        if info.dtype is not None and info.dtype != value.dtype:
            raise ModelLoadError(f"{label}: graph input {vi.name!r} is declared {info.dtype.name} but its "
                                 f"initializer is {value.dtype.name}")
        fits = info.shape is not None and len(info.shape) == value.ndim and all(
            not isinstance(d, int) or d == s for d, s in zip(info.shape, value.shape))
        inputs.append(TensorInfo(vi.name, value.dtype, info.shape if fits else tuple(value.shape)))
        default = value.view()
        default.flags.writeable = False  # shared by every run that does not override it
        defaults[vi.name] = default
    return defaults


def import_graph(graph: onnx.GraphProto, opsets: dict[str, int], *, base_dir: Path | None = None,
                 label: str = "<graph>", max_tensor_bytes: int | None = None, limits: Limits = DEFAULT_LIMITS,
                 outer_scope: frozenset[str] = frozenset()
                 ) -> tuple[list[TensorInfo], list[TensorInfo], list[Layer], dict[str, np.ndarray]]:
    """Inputs, outputs, topologically ordered layers and constants of a graph or subgraph.

    ``outer_scope`` names the values a subgraph may read from its enclosing graphs. A layer with
    subgraph attributes (If, Loop, Scan…) gets the outer values its subgraphs read appended to its
    inputs, listed in ``Layer.outer_inputs``, so the scheduler waits for them like any input.
    ``max_tensor_bytes`` overrides ``limits.max_tensor_bytes``. Linear in the graph's size.
    """
    max_bytes = limits.max_tensor_bytes if max_tensor_bytes is None else max_tensor_bytes
    constants: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        constants[init.name] = tensor_to_array(init, base_dir, max_bytes, label)
    for sparse in graph.sparse_initializer:
        try:
            constants[sparse.values.name] = sparse_to_dense(sparse, max_bytes)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{label}: sparse initializer {sparse.values.name!r}: {exc}") from exc

    inputs = [value_info_to_tensor_info(vi, limits, f"{label}: graph input") for vi in graph.input if vi.name not in constants]
    outputs = [value_info_to_tensor_info(vi, limits, f"{label}: graph output") for vi in graph.output]
    seen_inputs: set[str] = set()
    for info in inputs:
        if not info.name or info.name in seen_inputs:
            raise ModelLoadError(f"{label}: graph input {info.name!r} is declared twice or has no name")
        seen_inputs.add(info.name)
    # Computed once: a union per node would make import quadratic in the node count.
    scope = frozenset(seen_inputs | set(constants) | {o for n in graph.node for o in n.output}) | outer_scope

    layers: list[Layer] = []
    names_seen: set[str] = set()
    producer: dict[str, int] | None = None  # of this graph's values, for Gradient nodes
    copied = 0  # nodes copied into Gradient forward graphs: bounded like the graph's own
    for index, node in enumerate(graph.node):
        name = node.name or f"{node.op_type}_{index}"
        if name in names_seen:
            name = f"{name}_{index}"
        names_seen.add(name)
        domain = node.domain if node.domain != "ai.onnx" else ""
        version = opsets.get(domain, 1)
        where = f"{label}: node {name!r} ({node.op_type})"
        check_attributes(node, domain, version, where)
        if node.op_type == "Constant" and domain == "":
            if len(node.output) != 1 or not node.output[0]:
                raise ModelLoadError(f"{where}: a Constant has exactly one output, not {list(node.output)}")
            if node.output[0] in constants or node.output[0] in seen_inputs:
                raise ModelLoadError(f"{where}: value {node.output[0]!r} is produced twice")
            constants[node.output[0]] = _constant_node_value(node, where, base_dir, max_bytes)
            continue
        gradient = is_gradient(node.op_type, domain)
        if gradient:  # it differentiates nodes of this graph: they become its subgraph
            producer = gradient_producers(graph) if producer is None else producer
            node, count = with_forward_graph(node, graph, producer, where)
            copied += count
            limits.check_model("max_nodes", len(graph.node) + copied,
                               f"{label}: node count, the forward graphs of Gradient nodes included")
        try:
            attrs = attributes_dict(node.attribute, max_bytes)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{where}: {exc}") from exc
        if gradient:
            attrs[FORWARD_OPSETS] = dict(opsets)
        has_subgraph = any(subgraphs(a) for a in node.attribute)
        outer = _outer_references(node, scope, where) if has_subgraph else []
        layers.append(Layer(name=name, op_type=node.op_type, inputs=list(node.input) + outer,
                            outputs=list(node.output), attrs=attrs, domain=domain, version=version,
                            outer_inputs=outer))

    layers = topological_order(layers, seen_inputs | set(constants) | set(outer_scope), label)
    produced = {o for l in layers for o in l.outputs if o} | seen_inputs | set(constants) | outer_scope
    for out in outputs:
        if out.name not in produced:
            raise ModelLoadError(f"{label}: graph output {out.name!r} is produced by no node")
    return inputs, outputs, layers, constants


@lru_cache(maxsize=4096)
def _schema_attributes(op_type: str, version: int, domain: str) -> dict[str, tuple[int, bool]] | None:
    """``{attribute: (AttributeProto type, required)}`` of the op's ONNX schema, None if onnx has none."""
    try:
        schema = onnx.defs.get_schema(op_type, version, domain)
    except Exception:  # onnx.defs.SchemaError: a custom or unknown op, checked by its kernel
        return None
    return {name: (int(a.type), bool(a.required)) for name, a in schema.attributes.items()}


def check_attributes(node: onnx.NodeProto, domain: str, version: int, where: str) -> None:
    """Refuse attributes whose type is not the one the op's schema declares (an INTS where an INT
    belongs) and missing required attributes, naming both: kernels then see the types they expect."""
    expected = _schema_attributes(node.op_type, version, domain)
    if expected is None:
        return
    present = set()
    for attr in node.attribute:
        present.add(attr.name)
        want = expected.get(attr.name)
        if want is not None and attr.type != want[0]:
            have = AttributeProto.AttributeType.Name(attr.type) if attr.type in AttributeProto.AttributeType.values() \
                else str(attr.type)
            raise ModelLoadError(f"{where}: attribute {attr.name!r} is {have}, the schema of "
                                 f"{node.op_type} (opset {version}) wants {AttributeProto.AttributeType.Name(want[0])}")
    for attr_name, (_, required) in expected.items():
        if required and attr_name not in present:
            raise ModelLoadError(f"{where}: required attribute {attr_name!r} is missing")


def _outer_references(node: onnx.NodeProto, available: frozenset[str], where: str) -> list[str]:
    """Names the node's subgraphs (at any depth) read from outside themselves, in first-use order.

    Iterative: the nesting was bounded by ``Limits.max_graph_depth``, but no depth may exhaust
    Python's stack here."""
    found: dict[str, None] = {}
    # (a subgraph, the names its enclosing subgraphs define)
    stack: list[tuple[onnx.GraphProto, frozenset[str]]] = []
    for attr in reversed(node.attribute):
        for sub in reversed(subgraphs(attr)):
            stack.append((sub, frozenset()))
    while stack:
        graph, enclosing = stack.pop()
        defined = enclosing | {i.name for i in graph.input} | {t.name for t in graph.initializer} \
            | {t.values.name for t in graph.sparse_initializer} | {o for n in graph.node for o in n.output}
        nested = []
        for inner in graph.node:
            for name in inner.input:
                if name and name not in defined:
                    found.setdefault(name, None)
            for attr in inner.attribute:
                nested += [(sub, defined) for sub in subgraphs(attr)]
        for out in graph.output:
            if out.name not in defined:
                found.setdefault(out.name, None)
        stack.extend(reversed(nested))
    missing = [n for n in found if n not in available]
    if missing:
        raise ModelLoadError(f"{where}: a subgraph reads {missing[:8]}, defined nowhere")
    return list(found)


def _constant_node_value(node: onnx.NodeProto, where: str, base_dir: Path | None, max_bytes: int) -> np.ndarray:
    if len(node.attribute) != 1:
        raise ModelLoadError(f"{where}: a Constant node must have exactly one value attribute, "
                             f"not {[a.name for a in node.attribute]}")
    attr = node.attribute[0]
    if attr.type == AttributeProto.TENSOR:  # the same checks as an initializer (external data too)
        return tensor_to_array(attr.t, base_dir, max_bytes, where)
    try:
        value: Any = attribute_value(attr, max_bytes)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc
    if attr.name in ("value_float", "value_floats"):
        return np.asarray(value, dtype=np.float32)
    if attr.name in ("value_int", "value_ints"):
        return np.asarray(value, dtype=np.int64)
    if attr.name in ("value_string", "value_strings"):
        return np.asarray(value, dtype=object)
    if isinstance(value, np.ndarray):
        return value
    raise ModelLoadError(f"{where}: a Constant's value cannot be attribute {attr.name!r}")


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
