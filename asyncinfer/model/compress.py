"""Weight compression: a model's large float weights stored as float16 or uint8, as Sentis's
``ModelQuantizer`` does, written as a standard ONNX model any runtime can load.

``quantize_weights(model, "float16")`` stores each large float32 initializer as float16 followed by
a ``Cast`` back to float32; ``"uint8"`` stores it as uint8 with a ``DequantizeLinear`` (per output
channel, axis 0, for weights of rank 2 and more; per tensor for vectors and for models older
than opset 13, where DequantizeLinear has no axis). The file shrinks about 2x and 4x; the graph
reads exactly the same values as before at the points where the weights were used, only rounded.

asyncinfer's optimizer folds the ``Cast``/``DequantizeLinear`` of a constant at load, so the
model then runs at float32 speed (the weights are dequantized once, at load); ONNX Runtime runs
the file as it is. Weights of other types, small ones (under ``min_elements``), float16 values
out of float16's range, and weights inside subgraphs are kept as they are.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import ModelLoadError
from ..limits import DEFAULT_LIMITS, Limits
from .onnx_import import ModelSource, read_model_proto

KINDS = ("float16", "uint8")
#: Initializers with fewer elements stay float32 (biases, norms: little to gain, more to lose).
MIN_ELEMENTS = 1024
FLOAT16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class CompressedWeight:
    """One initializer that was compressed: its name, shape, and bytes before and after."""

    name: str
    shape: tuple[int, ...]
    bytes_before: int
    bytes_after: int


@dataclass(frozen=True)
class CompressedModel:
    """What `quantize_weights` made: the ONNX model, the weights it compressed, the sizes."""

    proto: onnx.ModelProto
    kind: str
    weights: list[CompressedWeight]
    size_before: int  # bytes of the serialised model
    size_after: int

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the compressed model as an ``.onnx`` file; returns its path."""
        path = Path(path)
        path.write_bytes(self.proto.SerializeToString())
        return path


def quantize_weights(source: ModelSource, kind: str = "float16", *, min_elements: int = MIN_ELEMENTS,
                     limits: Limits = DEFAULT_LIMITS) -> CompressedModel:
    """Store the large float32 weights of a model as ``kind`` (``"float16"`` or ``"uint8"``).

    Args:
        source: the model: a path, bytes or an ``onnx.ModelProto`` (read under ``limits``, as
            `load_model` reads it; weights in external data files are refused).
        kind: ``"float16"`` (about half the size) or ``"uint8"`` (about a quarter).
        min_elements: initializers with fewer elements stay float32.

    Returns:
        The compressed model (``.proto``, ``.save(path)``), the weights compressed and the sizes.
        Load it with `load_model` like any model; see the module docstring for what changes.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    model, _, label = read_model_proto(source, limits)
    if any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer):
        raise ModelLoadError(f"{label}: quantize_weights needs the weights inside the model file; this one keeps "
                             "them as external data (onnx.load it and save it without external data first)")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 0)
    per_channel = opset >= 13
    # Before IR 4 every initializer is also a graph input; since, an input of that name is a
    # default the caller may override: that one must stay as it is.
    listed_too = out.ir_version < 4
    declared_inputs = set() if listed_too else {i.name for i in graph.input}
    kept: list[TensorProto] = []
    decoders: list[onnx.NodeProto] = []
    done: list[CompressedWeight] = []
    for tensor in graph.initializer:
        value = numpy_helper.to_array(tensor) if tensor.data_type == TensorProto.FLOAT else None
        if (value is None or value.size < min_elements or tensor.name in declared_inputs
                or not np.isfinite(value).all() or (kind == "float16" and np.abs(value).max() > FLOAT16_MAX)):
            kept.append(tensor)
            continue
        stored = _float16(tensor.name, value, kept, decoders) if kind == "float16" else \
            _uint8(tensor.name, value, per_channel and value.ndim >= 2, kept, decoders)
        done.append(CompressedWeight(tensor.name, tuple(value.shape), value.nbytes, stored))
    del graph.initializer[:]
    graph.initializer.extend(kept)
    for node in reversed(decoders):  # first in the graph: every reader of a weight comes after
        graph.node.insert(0, node)
    if listed_too:  # the compressed weights are node outputs now, no longer inputs
        compressed = {w.name for w in done}
        entries = [i for i in graph.input if i.name not in compressed]
        del graph.input[:]
        graph.input.extend(entries)
    return CompressedModel(out, kind, done, model.ByteSize(), out.ByteSize())


def _float16(name: str, value: np.ndarray, kept: list[TensorProto], decoders: list[onnx.NodeProto]) -> int:
    half = numpy_helper.from_array(value.astype(np.float16), f"{name}__float16")
    kept.append(half)
    decoders.append(helper.make_node("Cast", [half.name], [name], to=TensorProto.FLOAT, name=f"{name}__decompress"))
    return value.size * 2


def _uint8(name: str, value: np.ndarray, per_channel: bool, kept: list[TensorProto],
           decoders: list[onnx.NodeProto]) -> int:
    """Asymmetric uint8 over each channel's [min, max] widened to hold 0 (so zero stays exact)."""
    rows = value.reshape(value.shape[0], -1) if per_channel else value.reshape(1, -1)
    lo = np.minimum(rows.min(axis=1), 0.0).astype(np.float64)
    hi = np.maximum(rows.max(axis=1), 0.0).astype(np.float64)
    scale = (hi - lo) / 255.0
    scale[scale == 0] = 1.0  # an all-zero channel: any scale, every value is the zero point
    zero_point = np.clip(np.round(-lo / scale), 0, 255)
    q = np.clip(np.round(rows / scale[:, None]) + zero_point[:, None], 0, 255).astype(np.uint8).reshape(value.shape)
    scale32 = scale.astype(np.float32)
    zp8 = zero_point.astype(np.uint8)
    if not per_channel:
        scale32, zp8 = scale32.reshape(()), zp8.reshape(())
    tensors = [numpy_helper.from_array(q, f"{name}__uint8"), numpy_helper.from_array(scale32, f"{name}__scale"),
               numpy_helper.from_array(zp8, f"{name}__zero_point")]
    kept.extend(tensors)
    attrs = {"axis": 0} if per_channel else {}
    decoders.append(helper.make_node("DequantizeLinear", [t.name for t in tensors], [name],
                                     name=f"{name}__decompress", **attrs))
    return q.nbytes + scale32.nbytes + zp8.nbytes
