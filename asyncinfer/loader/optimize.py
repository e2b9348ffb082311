"""Graph passes run at load time. Each pass is a function ``Model -> int`` (how many rewrites).

They never change results beyond float rounding: folding runs the very kernels that would run
later; Conv+BatchNormalization folding is exact algebra done in float64.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import ml_dtypes
import numpy as np

from .. import ops
from ..errors import AsyncInferError, ModelLoadError
from ..limits import Limits
from ..model.ir import Layer, Model, TensorInfo
from ..ops.elementwise import compute_dtype
from .patterns import (PATTERN_PASSES, fuse_add_layer_norm, fuse_channel_shuffles, fuse_conv_max_pools,
                       fuse_expand_depthwise, fuse_gemm_reshapes, fuse_joined_conv_max_pools, fuse_joined_convs, fuse_matmul_bias,
                       fuse_reshape_transposes, fuse_residual_adds, fuse_sibling_convs, fuse_sibling_products,
                       fuse_split_heads, fuse_squeeze_excite)

# Ops whose output depends only on the *shape* of their input: CPU-bound propagation stops there.
SHAPE_ONLY_OPS = {"Shape", "Size"}
# Ops that may carry a fused activation: the activation then runs on the same thread, in place.
FUSION_HOSTS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sum", "BatchNormalization", "Concat"}
CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}


def _graph_outputs(model: Model) -> set[str]:
    return {o.name for o in model.outputs}


def _rename_inputs(model: Model, renames: dict[str, str]) -> None:
    """Make every layer read ``renames[name]`` instead of ``name``: one pass over the layers,
    however many names change (a pass per name would make a pass quadratic)."""
    if not renames:
        return
    for layer in model.layers:
        if any(n in renames for n in layer.inputs):
            layer.inputs = [renames.get(n, n) for n in layer.inputs]


def eliminate_identities(model: Model) -> int:
    """Drop Identity and inference-mode Dropout layers, wiring consumers to their input.

    A Dropout's mask output that nothing reads does not keep it (SqueezeNet's exporter named one:
    a mask of ones made every run, 38 µs). One pass in topological order: a layer's inputs are
    renamed before it is looked at, so a chain of Identities collapses onto its first input in
    linear time."""
    outputs = _graph_outputs(model)
    # subgraphs read outer values by name: those names must survive
    pinned = outputs | {n for layer in model.layers for n in layer.outer_inputs}
    read = pinned | {n for layer in model.layers for n in layer.inputs}
    renames: dict[str, str] = {}
    kept, removed = [], 0
    for layer in model.layers:
        if renames and any(n in renames for n in layer.inputs):
            layer.inputs = [renames.get(n, n) for n in layer.inputs]
        mask_unread = len(layer.outputs) < 2 or not layer.outputs[1] or layer.outputs[1] not in read
        passthrough = layer.op_type == "Identity" or (
            layer.op_type == "Dropout" and mask_unread
            and not layer.attrs.get("training_mode") and (len(layer.inputs) < 3 or not layer.inputs[2]))
        if (passthrough and layer.domain == "" and layer.outputs and layer.outputs[0]
                and layer.outputs[0] not in pinned and layer.inputs and layer.inputs[0]):
            renames[layer.outputs[0]] = layer.inputs[0]
            removed += 1
        else:
            kept.append(layer)
    model.layers = kept
    return removed


def fold_constants(model: Model) -> int:
    """Evaluate layers whose inputs are all constant; also ``Shape``/``Size`` of statically shaped values.

    A layer whose output would exceed ``Limits.max_folded_bytes`` is left to run time: its size is
    predicted before it is computed, and the kernels that size a tensor from data refuse to
    allocate more than that many elements while folding. So are folds once the values folded so
    far total ``Limits.max_model_bytes``: a model's folded constants never take more memory than
    its file could have held, however many small folds it has."""
    folded, kept = 0, []
    limits = model.limits
    fold_limits = limits.replace(max_tensor_elements=min(limits.max_tensor_elements, limits.max_folded_bytes))
    budget = limits.max_model_bytes
    for layer in model.layers:
        value = _try_fold(model, layer, fold_limits, min(limits.max_folded_bytes, budget))
        if value is None:
            kept.append(layer)
            continue
        for name, array in zip(layer.outputs, value):
            if name:
                model.constants[name] = array
        budget -= sum(_nbytes(v) for v in value)
        folded += 1
    model.layers = kept
    return folded


def _try_fold(model: Model, layer: Layer, limits: Limits, bound: int) -> tuple | None:
    """The layer's outputs computed now, or None to leave it to run time (outputs over ``bound``
    bytes, not constant, random, unsupported, or failing)."""
    if layer.op_type in CONTROL_FLOW or layer.fused:
        return None
    if layer.op_type in SHAPE_ONLY_OPS and layer.domain == "" and layer.inputs and layer.inputs[0] not in model.constants:
        return _fold_shape(model, layer)
    if not all(name in model.constants for name in layer.inputs if name):
        return None
    try:
        op = ops.create(layer, limits)
    except Exception:
        return None  # reported by the support check with every other unsupported op or bad attribute
    if not op.deterministic:
        return None
    args = [model.constants[n] if n else None for n in layer.inputs]
    predicted = predicted_bytes(model, layer, args)
    if (predicted is None and layer.op_type in NEEDS_PREDICTION) or (predicted is not None and predicted > bound):
        return None  # a data-propagation bomb, or a size nobody can tell: left to run time
    try:
        with np.errstate(all="ignore"):
            outs = op(*args)
    except Exception:
        return None  # leave it to run time, where a failure is an ExecutionError naming the layer
    if sum(_nbytes(o) for o in outs) > bound:
        return None
    # Constants are shared by every run: make them immutable so no kernel can corrupt them.
    return tuple(_frozen(o) for o in outs)


def _frozen(value):
    if isinstance(value, np.ndarray):
        value = np.ascontiguousarray(value) if not value.flags.c_contiguous else value
        if value.flags.writeable and value.base is not None:
            value = value.copy()
        value.flags.writeable = False
    return value


def _nbytes(value) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (list, tuple)):  # a sequence
        return sum(_nbytes(v) for v in value)
    return 0


# -- output size prediction ----------------------------------------------------------------------
# Ops whose output size depends on input values in ways `_predicted_elements` does not model:
# folded only when shape inference knows their output shape.
NEEDS_PREDICTION = {"Einsum", "AffineGrid", "Col2Im", "DFT", "STFT", "ConvTranspose", "MelWeightMatrix",
                    "CenterCropPad", "MaxUnpool", "Upsample", "Resize"}
# Element-wise ops that broadcast their inputs: the output has the broadcast shape.
BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Where", "Equal",
                "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "BitShift",
                "BitwiseAnd", "BitwiseOr", "BitwiseXor", "PRelu", "Clip"}
_UNBOUNDED = math.inf  # a size the op's values make absurd (non-finite, too many dims): never folded


def predicted_bytes(model: Model, layer: Layer, args: list) -> float | None:
    """An upper bound of the bytes ``layer`` would build from the constants ``args``, known before
    computing them: from shape inference (``model.value_info``) and from the op's own rule
    (ConstantOfShape, Expand, Tile, Range, Pad, OneHot, Gather, MatMul, broadcasting…), the larger
    of the two; None when neither can tell. A declared shape may lie, the op's rule cannot."""
    guesses: list[float] = []
    infos = [model.value_info.get(o) for o in layer.outputs if o]
    if infos and all(i is not None and i.shape is not None and all(isinstance(d, int) for d in i.shape)
                     for i in infos):
        guesses.append(sum(math.prod(i.shape) * (np.dtype(i.dtype).itemsize if i.dtype is not None else 8)
                           for i in infos))
    try:
        elements = _predicted_elements(layer, args, model.limits.max_tensor_rank)
    except (TypeError, ValueError, IndexError, OverflowError):
        elements = None  # values the kernel will refuse: it fails at run time, naming the layer
    if elements is not None:
        guesses.append(elements * _output_itemsize(layer, args))
    return max(guesses) if guesses else None


# The input whose element type the output takes, for ops whose other inputs are shapes or counts.
_DATA_INPUT = {"Expand": 0, "Tile": 0, "Pad": 0, "Gather": 0, "GatherElements": 0, "GatherND": 0,
               "Resize": 0, "Upsample": 0, "Range": 0, "OneHot": 2, "CenterCropPad": 0, "MaxUnpool": 0}


def _output_itemsize(layer: Layer, args: list) -> int:
    """Bytes per element of the layer's output (the widest input's when the op has no data input)."""
    if layer.op_type == "ConstantOfShape":
        value = layer.attrs.get("value")
        return value.dtype.itemsize if isinstance(value, np.ndarray) else 4
    index = _DATA_INPUT.get(layer.op_type)
    if index is not None and index < len(args) and isinstance(args[index], np.ndarray):
        return max(args[index].dtype.itemsize, 1)
    return max([a.dtype.itemsize for a in args if isinstance(a, np.ndarray)] + [1])


def _ints(value) -> list[int] | None:
    """The entries of a shape-like constant as Python ints (None for a missing input)."""
    if value is None:
        return None
    flat = np.asarray(value).reshape(-1)
    if flat.dtype.kind == "f" and not np.all(np.isfinite(flat)):
        raise OverflowError("non-finite")
    if flat.dtype.kind not in "iufb":
        raise TypeError(f"not numbers: {flat.dtype}")
    return [int(v) for v in flat]


def _scalar(value) -> float:
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1 or flat.dtype.kind not in "iufb":
        raise ValueError("not a numeric scalar")
    return float(flat[0])


def _broadcast(shapes: list[tuple[int, ...]]) -> int:
    rank = max((len(s) for s in shapes), default=0)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    return math.prod(max(max(int(d), 0) for d in axis) for axis in zip(*padded)) if rank else 1


def _predicted_elements(layer: Layer, args: list, max_rank: int) -> float | None:
    """Output elements of the ops that can grow far beyond their inputs, from their constant inputs."""
    op, a = layer.op_type, args + [None] * 5
    arrays = [x for x in args if isinstance(x, np.ndarray)]
    if op == "ConstantOfShape":
        dims = _ints(a[0]) or []
        return _UNBOUNDED if len(dims) > max_rank else math.prod(max(d, 0) for d in dims)
    if op == "Expand":
        dims = _ints(a[1]) or []
        return _UNBOUNDED if len(dims) > max_rank else _broadcast([np.shape(a[0]), tuple(dims)])
    if op == "Tile":
        repeats = _ints(a[1]) or []
        return math.prod(max(d, 0) * max(r, 1) for d, r in zip(np.shape(a[0]), repeats)) if repeats else None
    if op == "Range":
        start, limit, delta = (_scalar(v) for v in a[:3])
        if delta == 0 or not all(math.isfinite(v) for v in (start, limit, delta)):
            return _UNBOUNDED
        return max(math.ceil((limit - start) / delta), 0)
    if op == "Pad":
        pads = _ints(a[1]) if len(layer.inputs) > 1 else layer.attrs.get("pads", [])
        grow = sum(max(p, 0) for p in (pads or []))
        return math.prod(d + grow for d in np.shape(a[0]))
    if op == "OneHot":
        return int(np.size(a[0])) * abs(int(_scalar(a[1])))
    if op in ("HannWindow", "HammingWindow", "BlackmanWindow"):
        return abs(int(_scalar(a[0])))
    if op in ("Resize", "Upsample"):
        sizes = _ints(a[3]) if op == "Resize" and len(layer.inputs) > 3 and layer.inputs[3] else None
        if sizes:
            return math.prod(max(d, 0) for d in sizes)
        scales = a[2] if op == "Resize" and layer.version >= 11 else a[1]
        scales = layer.attrs.get("scales") if scales is None else scales
        if scales is None:
            return None
        factors = [float(v) for v in np.asarray(scales, dtype=np.float64).reshape(-1)]
        if not all(math.isfinite(f) for f in factors):
            return _UNBOUNDED
        return math.prod(math.ceil(d * max(f, 0.0)) for d, f in zip(np.shape(a[0]), factors))
    if op == "Gather":
        data, indices = np.shape(a[0]), np.shape(a[1])
        axis = int(layer.attrs.get("axis", 0)) % max(len(data), 1)
        rows = math.prod(data[:axis] + data[axis + 1:]) if data else 1
        return rows * math.prod(indices)
    if op == "GatherElements":
        return math.prod(np.shape(a[1]))
    if op == "GatherND":  # never more than a whole data tensor per index tuple
        return math.prod(np.shape(a[1])[:-1]) * math.prod(np.shape(a[0]))
    if op in ("MatMul", "MatMulInteger", "Gemm", "QLinearMatMul"):
        x, w = (np.shape(a[0]), np.shape(a[3])) if op == "QLinearMatMul" else (np.shape(a[0]), np.shape(a[1]))
        if op == "Gemm":
            rows = x[1] if layer.attrs.get("transA") else x[0] if x else 1
            cols = w[0] if layer.attrs.get("transB") else w[-1] if w else 1
            return rows * cols
        return math.prod(x[:-1]) * math.prod(w[:-2]) * (w[-1] if len(w) > 1 else 1)
    if op in BROADCASTING and arrays:
        return _broadcast([x.shape for x in arrays])
    if op == "Concat":
        return sum(x.size for x in arrays)
    return None


def _fold_shape(model: Model, layer: Layer) -> tuple | None:
    if not layer.inputs or not layer.inputs[0]:
        return None
    info = model.value_info.get(layer.inputs[0])
    if info is None or info.shape is None or not all(isinstance(d, int) for d in info.shape):
        return None
    shape = np.array(info.shape, dtype=np.int64)
    if layer.op_type == "Size":
        return (_frozen(np.array(np.prod(shape), dtype=np.int64)),)
    rank = len(shape)
    start = layer.attrs.get("start", 0)
    end = layer.attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return (_frozen(shape[start:end].copy()),)


def remove_dead_layers(model: Model) -> int:
    """Drop layers none of whose outputs reach a graph output."""
    needed = _graph_outputs(model)
    live: list[Layer] = []
    for layer in reversed(model.layers):
        if any(o in needed for o in layer.outputs if o):
            live.append(layer)
            needed.update(n for n in layer.inputs if n)
    removed = len(model.layers) - len(live)
    model.layers = live[::-1]
    drop_unread_constants(model)  # (the dead layers' weights: the passes after need not see them)
    return removed


def _read_by(layer: Layer) -> Iterator[str]:
    """The names ``layer`` reads: its inputs, its fused parts' and those of the layers it replaced
    (a fused layer's ``expansion``, which a backend without its kernel runs instead)."""
    yield from layer.inputs
    for part in layer.fused + layer.expansion:
        yield from _read_by(part)


def drop_unread_constants(model: Model) -> int:
    """Drop the constants nothing reads any more: the weights a pass replaced by its own (a
    BatchNormalization folded into the conv before it: ResNet-18's 43 MB of unfolded conv
    weights stayed beside their folded twins). Graph outputs and anything a layer, a fused
    part or an expansion reads stay."""
    read = _graph_outputs(model)
    for layer in model.layers:
        read.update(_read_by(layer))
    unread = [name for name in model.constants if name not in read]
    for name in unread:
        del model.constants[name]
    return len(unread)


def _channel_vector(value: np.ndarray, channels: int, rank: int) -> np.ndarray | None:
    """``value`` as a length-``channels`` float64 vector if it broadcasts per channel over an
    ``(N, C, spatial...)`` tensor of rank ``rank`` (a scalar, or shape ``(C, 1, …)``), else None."""
    if value.dtype.kind != "f" or value.ndim > rank - 1:
        return None
    shape = (1,) * (rank - 1 - value.ndim) + value.shape  # as if broadcast against (C, spatial...)
    if any(d != 1 for d in shape[1:]) or shape[0] not in (1, channels):
        return None
    return np.broadcast_to(value.reshape(-1).astype(np.float64), (channels,)).copy()


def _rank(model: Model, name: str) -> int | None:
    info = model.value_info.get(name) or next((i for i in model.inputs if i.name == name), None)
    return None if info is None or info.shape is None else len(info.shape)


class _Affine:
    """A host layer (Conv, or inference BatchNormalization) whose output is ``a·z + b`` per channel
    for some z, with its ``a`` and ``b`` held in constants that can absorb further affine maps."""

    def __init__(self, model: Model, layer: Layer):
        self.model, self.layer = model, layer
        self.absorbed = 0
        c = model.constants
        if layer.op_type == "Conv":
            w = c[layer.inputs[1]]
            self.channels = w.shape[0]
            self.rank = w.ndim
            self.dtype = w.dtype
            # its float64 copy is made at write_back, one conv at a time (a model's convs all in
            # float64 at once were twice its weights: ResNet-18's load peaked 69 MB higher)
            self.conv_weight, self.scales = w, []
            bias = layer.inputs[2] if len(layer.inputs) > 2 else ""
            self.bias = c[bias].astype(np.float64) if bias else np.zeros(self.channels)
        else:  # BatchNormalization: y = (x - mean) * scale / sqrt(var + eps) + beta
            scale, beta, mean, var = (c[n] for n in layer.inputs[1:5])
            self.channels, self.rank, self.dtype = scale.shape[0], 0, scale.dtype
            std = np.sqrt(var.astype(np.float64) + layer.attrs.get("epsilon", 1e-5))
            self.weight = scale.astype(np.float64) / std  # per-channel slope
            self.bias = beta.astype(np.float64) - mean.astype(np.float64) * self.weight

    @staticmethod
    def accepts(model: Model, layer: Layer) -> bool:
        """Whether ``layer`` is a host whose constants have the shapes the algebra needs (a
        malformed model is left as it is, for the kernel to report at run time)."""
        c = model.constants
        if layer.domain or layer.fused or len(layer.outputs) != 1 or not layer.outputs[0]:
            return False
        floats = (np.float16, np.float32, np.float64)
        if layer.op_type == "Conv":
            if len(layer.inputs) < 2 or not isinstance(c.get(layer.inputs[1]), np.ndarray):
                return False
            w = c[layer.inputs[1]]
            bias = layer.inputs[2] if len(layer.inputs) > 2 else ""
            if bias and not (isinstance(c.get(bias), np.ndarray) and c[bias].shape == w.shape[:1]):
                return False
            return w.ndim >= 3 and w.dtype in floats and (not bias or c[bias].dtype == w.dtype)
        if layer.op_type == "BatchNormalization":
            if layer.attrs.get("training_mode", 0) or len(layer.inputs) < 5:
                return False
            params = [c.get(n) for n in layer.inputs[1:5]]
            if not all(isinstance(p, np.ndarray) and p.ndim == 1 for p in params):
                return False
            return len({p.shape for p in params}) == 1 and params[0].dtype in floats
        return False

    def scale_by(self, s: np.ndarray) -> None:
        if self.layer.op_type == "Conv":
            self.scales.append(s)  # (applied at write_back in this order: the same products)
        else:
            self.weight = self.weight * s
        self.bias = self.bias * s

    def folded_conv_weight(self) -> np.ndarray:
        """The conv's weight times every scale absorbed, in float64."""
        weight = self.conv_weight.astype(np.float64)
        for s in self.scales:
            weight *= s.reshape((-1,) + (1,) * (weight.ndim - 1))
        return weight

    def shift_by(self, b: np.ndarray) -> None:
        self.bias = self.bias + b

    def absorb(self, follower: Layer) -> bool:
        """Fold ``follower`` (BatchNormalization or Mul/Add/Sub/Div by a per-channel constant) in."""
        c = self.model.constants
        data = self.layer.outputs[0]
        if follower.op_type == "BatchNormalization" and self.layer.op_type == "Conv":
            if not _Affine.accepts(self.model, follower) or follower.inputs[0] != data:
                return False
            bn = _Affine(self.model, follower)
            if bn.channels != self.channels:
                return False
            self.scale_by(bn.weight)
            self.shift_by(bn.bias)
            return True
        if follower.op_type not in ("Mul", "Add", "Sub", "Div") or follower.domain or len(follower.inputs) != 2:
            return False
        other_index = 1 if follower.inputs[0] == data else 0
        if follower.inputs[1 - other_index] != data or follower.inputs[other_index] not in c:
            return False
        rank = self.rank or _rank(self.model, self.layer.inputs[0])
        if rank is None:
            return False
        v = _channel_vector(c[follower.inputs[other_index]], self.channels, rank)
        if v is None or (follower.op_type in ("Sub", "Div") and other_index == 0):
            return False  # const - x and const / x are not affine in a foldable way
        if follower.op_type == "Mul":
            self.scale_by(v)
        elif follower.op_type == "Div":
            if np.any(v == 0):
                return False
            self.scale_by(1.0 / v)
        else:
            self.shift_by(v if follower.op_type == "Add" else -v)
        return True

    def write_back(self) -> None:
        layer, c, name = self.layer, self.model.constants, self.layer.name
        if layer.op_type == "Conv":
            c[f"{name}::folded_weight"] = _frozen(self.folded_conv_weight().astype(self.dtype))
            c[f"{name}::folded_bias"] = _frozen(self.bias.astype(self.dtype))
            layer.inputs = [layer.inputs[0], f"{name}::folded_weight", f"{name}::folded_bias"]
        else:  # a BatchNormalization with mean 0, var 1 - eps: scale and bias carry the whole map
            eps = layer.attrs.get("epsilon", 1e-5)
            for suffix, value in (("scale", self.weight), ("bias", self.bias),
                                  ("mean", np.zeros(self.channels)), ("var", np.full(self.channels, 1.0 - eps))):
                c[f"{name}::folded_{suffix}"] = _frozen(value.astype(self.dtype))
            layer.inputs = [layer.inputs[0]] + [f"{name}::folded_{s}" for s in ("scale", "bias", "mean", "var")]


def fold_affine(model: Model) -> int:
    """Fold per-channel affine layers into the Conv or BatchNormalization before them.

    Conv → BatchNormalization, and Conv/BatchNormalization → Mul/Add/Sub/Div by a per-channel
    constant (how Caffe2-exported models spell BatchNormalization), become one layer: the
    arithmetic is done once, in float64, on the constants.
    """
    consumers = model.consumers()
    outputs = _graph_outputs(model)
    producers = model.producers()
    hosts: dict[int, _Affine] = {}
    removed: set[int] = set()
    for follower in model.layers:
        if not follower.inputs or not follower.inputs[0]:
            continue
        data_inputs = [n for n in follower.inputs if n and n not in model.constants]
        if len(data_inputs) != 1:
            continue
        host = producers.get(data_inputs[0])
        if host is None or id(host) in removed or host.outputs[0] in outputs:
            continue
        if len(consumers.get(host.outputs[0], [])) != 1:
            continue
        affine = hosts.get(id(host))
        if affine is None:
            if not _Affine.accepts(model, host):
                continue
            affine = hosts[id(host)] = _Affine(model, host)
        if not affine.absorb(follower):
            continue
        affine.absorbed += 1
        host.outputs = [follower.outputs[0]]
        producers[follower.outputs[0]] = host
        removed.add(id(follower))
    for affine in hosts.values():
        if affine.absorbed:
            affine.write_back()
    model.layers = [l for l in model.layers if id(l) not in removed]
    return len(removed)


def simplify_reshapes(model: Model) -> int:
    """Fewer Reshape layers between GEMMs (an exported GPT-2 block runs 12 a step):

    - an element-wise activation read through a Reshape moves before it (``Reshape(x) → Gelu``
      becomes ``Gelu(x) → Reshape``): an element-wise op does not care about shapes, and
      ``fuse_activations`` then runs it inside the GEMM that made ``x``;
    - ``Reshape(Reshape(x, s1), s2)`` becomes ``Reshape(x, s2)`` when ``s2`` is a constant without
      zeros (a zero would copy a dimension of the inner result): the elements, in order, are the
      same. The inner Reshape goes, or stays for ``Shape`` layers that read it (exporters compute
      later targets so), which runs of known input shapes do not run (``Plan.with_precomputed``).
    """
    count = 0
    consumers, producers, outputs = model.consumers(), model.producers(), _graph_outputs(model)

    def private(name: str) -> bool:
        return name not in outputs and len(consumers.get(name, [])) == 1

    for act in model.layers:
        reshape = producers.get(act.inputs[0]) if act.inputs else None
        if (reshape is None or reshape.op_type != "Reshape" or reshape.domain or reshape.fused or act.domain
                or act.fused or len(act.inputs) != 1 or len(act.outputs) != 1 or not private(reshape.outputs[0])):
            continue
        try:
            if not ops.lookup(act.op_type, act.version, act.domain).elementwise_unary:
                continue
        except AsyncInferError:
            continue
        source, moved = reshape.inputs[0], f"{act.outputs[0]}:before_reshape"
        if source in model.value_info and act.outputs[0] in model.value_info:  # x's shape, the op's type
            model.value_info[moved] = TensorInfo(moved, model.value_info[act.outputs[0]].dtype,
                                                 model.value_info[source].shape)
        # swap in place (the order stays topological): the activation reads x, the Reshape its result
        act.inputs, reshape.inputs = [source], [moved] + reshape.inputs[1:]
        act.outputs, reshape.outputs = [moved], [act.outputs[0]]
        first, second = model.layers.index(reshape), model.layers.index(act)
        model.layers[first], model.layers[second] = act, reshape
        producers[moved], producers[reshape.outputs[0]] = act, reshape
        consumers[moved], consumers[source] = [reshape], [act if c is reshape else c for c in consumers[source]]
        count += 1

    removed: set[int] = set()
    for outer in model.layers:
        if outer.op_type != "Reshape" or outer.domain or outer.fused or len(outer.inputs) < 2:
            continue
        inner = producers.get(outer.inputs[0])
        target = model.constants.get(outer.inputs[1])
        if (inner is None or inner.op_type != "Reshape" or inner.domain or inner.fused or id(inner) in removed
                or target is None or not isinstance(target, np.ndarray)
                or (not outer.attrs.get("allowzero", 0) and bool(np.any(np.asarray(target) == 0)))):
            continue
        others = [c for c in consumers.get(inner.outputs[0], []) if c is not outer]
        if inner.outputs[0] in outputs or any(c.op_type not in SHAPE_ONLY_OPS for c in others):
            continue
        outer.inputs = [inner.inputs[0]] + outer.inputs[1:]
        consumers.setdefault(inner.inputs[0], []).append(outer)
        consumers[inner.outputs[0]] = others
        if not others:
            removed.add(id(inner))
        # (else the inner Reshape stays for the Shape reading it, which runs of known input
        # shapes take as a constant: they skip the Reshape too, see Plan.with_precomputed)
        count += 1
    model.layers = [l for l in model.layers if id(l) not in removed]
    return count


def fuse_activations(model: Model) -> int:
    """Attach a single-consumer element-wise activation to the layer producing its input.

    It pays: one task instead of two, and the activation runs in place on a freshly written,
    cache-hot buffer instead of allocating a second one.
    """
    consumers = model.consumers()
    producers = model.producers()
    outputs = _graph_outputs(model)
    removed: set[int] = set()
    count = 0
    for act in model.layers:
        if act.domain or not act.inputs or len(act.outputs) != 1:
            continue
        try:
            cls = ops.lookup(act.op_type, act.version, act.domain)
        except AsyncInferError:
            continue
        # Clip with constant bounds (ReLU6 and friends) fuses too: its bounds travel as constants.
        constant_extras = all(not n or n in model.constants for n in act.inputs[1:])
        if not (cls.elementwise_unary and len(act.inputs) == 1) and not (act.op_type == "Clip" and constant_extras):
            continue
        host = producers.get(act.inputs[0])
        if host is None or host.op_type not in FUSION_HOSTS or host.domain or id(host) in removed:
            continue
        if len(host.outputs) != 1 or host.outputs[0] in outputs or len(consumers.get(host.outputs[0], [])) != 1:
            continue
        host.fused.append(act)
        host.outputs = [act.outputs[0]]
        producers[act.outputs[0]] = host
        removed.add(id(act))
        count += 1
    model.layers = [l for l in model.layers if id(l) not in removed]
    return count


# Float types a model may declare that asyncinfer computes in float32 (ONNX TensorProto codes).
PROMOTED_FLOATS = {np.dtype(np.float16): 10, np.dtype(ml_dtypes.bfloat16): 16}
FLOAT32_CODE = 1
# Attributes naming an element type (Cast's ``to``, the random ops' and EyeLike's ``dtype``...).
TYPE_ATTRIBUTES = ("to", "dtype", "output_dtype")


def promote_narrow_floats(model: Model) -> int:
    """Compute a float16/bfloat16 model in float32, rounding once at its outputs.

    NumPy has no fast float16 arithmetic and BLAS none at all, so a float16 model runs as its
    float32 twin: its narrow constants, value types and type attributes (Cast's ``to``…) become
    float32, each narrow input is widened by a Cast layer and each narrow output rounded by one.
    The signature the caller sees is unchanged. Results differ from per-layer float16 rounding
    only by that rounding (ORT also accumulates float16 in float32). Only models with a GEMM-like
    layer (Conv, MatMul, Gemm…) on narrow floats are promoted, where it pays; models with
    subgraphs or ops of other domains are left as they are. Returns 1 if the model was promoted.
    """
    types = {name: info.dtype for name, info in model.value_info.items()}
    types.update({info.name: info.dtype for info in list(model.inputs) + list(model.outputs)})
    types.update({name: getattr(value, "dtype", None) for name, value in model.constants.items()})

    def narrow(name: str) -> bool:
        return bool(name) and types.get(name) is not None and np.dtype(types[name]) in PROMOTED_FLOATS

    if not any(layer.op_type in GEMM_WEIGHTS and any(narrow(n) for n in layer.inputs) for layer in model.layers):
        return 0
    if any(layer.domain or layer.op_type in CONTROL_FLOW or layer.outer_inputs for layer in model.layers):
        return 0
    producers = model.producers()
    if any(narrow(info.name) and info.name not in producers for info in model.outputs):
        return 0  # an output that is a constant or an input: nothing to round, keep the model as it is
    for name, value in list(model.constants.items()):
        if isinstance(value, np.ndarray) and value.dtype in PROMOTED_FLOATS:
            model.constants[name] = _frozen(value.astype(np.float32))
    for name, info in list(model.value_info.items()):
        if info.dtype is not None and np.dtype(info.dtype) in PROMOTED_FLOATS:
            model.value_info[name] = replace(info, dtype=np.dtype(np.float32))
    for layer in model.layers:
        for part in [layer] + layer.fused:
            for key, value in list(part.attrs.items()):
                if key in TYPE_ATTRIBUTES and value in PROMOTED_FLOATS.values():
                    part.attrs[key] = FLOAT32_CODE
                elif isinstance(value, np.ndarray) and value.dtype in PROMOTED_FLOATS:
                    part.attrs[key] = value.astype(np.float32)
    version = model.opsets.get("", 13)
    # Readers of a narrow input or output read its float32 twin instead: renamed in one pass.
    renames = {info.name: f"{info.name}::float32" for info in list(model.inputs) + list(model.outputs)
               if narrow(info.name)}
    _rename_inputs(model, renames)
    widen, rounds = [], []
    for info in model.inputs:
        if narrow(info.name):
            wide = renames[info.name]
            widen.append(Layer(name=f"{info.name}::widen", op_type="Cast", inputs=[info.name], outputs=[wide],
                               attrs={"to": FLOAT32_CODE}, version=version))
            model.value_info[wide] = replace(info, name=wide, dtype=np.dtype(np.float32))
    for info in {info.name: info for info in model.outputs}.values():
        if narrow(info.name):
            wide = renames[info.name]
            layer = producers[info.name]
            layer.outputs = [wide if o == info.name else o for o in layer.outputs]
            rounds.append(Layer(name=f"{info.name}::round", op_type="Cast", inputs=[wide], outputs=[info.name],
                                attrs={"to": PROMOTED_FLOATS[np.dtype(info.dtype)]}, version=version))
            model.value_info[wide] = replace(info, name=wide, dtype=np.dtype(np.float32))
    model.layers = widen + model.layers + rounds
    return 1


# The weight inputs of GEMM-like ops, which compute narrow floats in float32 (ops.linalg.gemm_dtypes).
GEMM_WEIGHTS = {"Conv": (1, 2), "ConvTranspose": (1, 2), "MatMul": (0, 1), "Gemm": (0, 1, 2)}


def widen_narrow_weights(model: Model) -> int:
    """Store float16/bfloat16 constant weights of Conv, ConvTranspose, MatMul and Gemm in float32.

    Those kernels multiply narrow floats in float32 anyway; widening their constant operands once
    here spares a conversion of every weight on every run (a float16 ResNet would otherwise
    convert 25 M weights per image). Results are unchanged: float16 → float32 is exact.
    """
    readers: dict[str, list[tuple[Layer, int]]] = {}
    for layer in model.layers:
        for i, name in enumerate(layer.inputs):
            if name:
                readers.setdefault(name, []).append((layer, i))
        for name in layer.outer_inputs:  # read inside a subgraph: left as it is
            readers.setdefault(name, []).append((layer, -1))
    outputs = _graph_outputs(model)
    widened = 0
    for name, value in list(model.constants.items()):
        if not isinstance(value, np.ndarray) or compute_dtype(value.dtype) == value.dtype or name in outputs:
            continue
        uses = readers.get(name, [])
        if uses and all(not layer.domain and i in GEMM_WEIGHTS.get(layer.op_type, ()) for layer, i in uses):
            model.constants[name] = value.astype(np.float32)
            widened += 1
    return widened


def untranspose_gemm_weights(model: Model) -> int:
    """Store the constant weight of a ``Gemm`` with ``transB=1`` transposed, ``(K, N)`` in C
    order, and clear ``transB``: what ``nn.Linear`` exports for 2-D inputs (classifier heads).

    ``A @ B`` is the same product either way (the same BLAS call with the other transpose flag
    for many rows), but a product of a few rows runs the compiled few-row kernel only on a
    C-ordered ``(K, N)`` weight, split across the cores; with ``Bᵀ`` it was one thread of BLAS's
    GEMV (MobileNetV3's 576 → 1024 head: 268 µs a run). Taken when the weight is a float matrix
    no other layer reads and no graph output; the copy replaces it (one copy of the weights).
    """
    readers: dict[str, int] = {}
    for layer in model.layers:
        for name in list(layer.inputs) + list(layer.outer_inputs):
            if name:
                readers[name] = readers.get(name, 0) + 1
    outputs = _graph_outputs(model)
    done = 0
    for layer in model.layers:
        if layer.op_type != "Gemm" or layer.domain or int(layer.attrs.get("transB", 0)) != 1 or len(layer.inputs) < 2:
            continue
        name = layer.inputs[1]
        value = model.constants.get(name)
        if (not isinstance(value, np.ndarray) or value.ndim != 2 or value.dtype.kind != "f" or readers.get(name) != 1
                or name in outputs):
            continue
        weight = np.ascontiguousarray(value.T)
        weight.flags.writeable = False  # shared by every run, as every constant
        model.constants[name] = weight
        layer.attrs = {**layer.attrs, "transB": 0}
        done += 1
    return done


def mark_cpu_bound(model: Model) -> int:
    """Mark values whose contents decide later shapes, and their producers, as CPU-bound (as Sentis does)."""
    producers = model.producers()
    pending: list[str] = []
    for layer in model.layers:
        try:
            cls = ops.lookup(layer.op_type, layer.version, layer.domain)
        except AsyncInferError:
            continue
        pending += [layer.inputs[i] for i in cls.value_inputs if i < len(layer.inputs) and layer.inputs[i]]
    marked: set[str] = set()
    while pending:
        name = pending.pop()
        if name in marked or name in model.constants:
            continue
        marked.add(name)
        producer = producers.get(name)
        if producer is None:
            continue
        producer.cpu_bound = True
        if producer.op_type not in SHAPE_ONLY_OPS:
            pending += [n for n in producer.inputs if n]
    model.cpu_bound_values = marked
    return len(marked)


def mark_cache_appends(model: Model) -> int:
    """Mark each Concat that extends a graph input into a graph output, the KV cache of a decoder
    with past (``present.N = Concat(past_key_values.N, new)``): its CPU kernel may then append
    in place when fed its own last output (``ops/cache_append.py``)."""
    inputs = {i.name for i in model.inputs}
    outputs = _graph_outputs(model)
    marked = 0
    for layer in model.layers:
        if (layer.op_type == "Concat" and layer.domain in ("", "ai.onnx") and len(layer.inputs) > 1
                and layer.inputs[0] in inputs and layer.outputs and layer.outputs[0] in outputs):
            layer.appends_cache = True
            marked += 1
    return marked


def mark_concat_chains(model: Model) -> int:
    """Mark chains of Concats in which each extends the one before along the same axis (its first
    input is the previous one's output, which no other Concat reads): DenseNet's dense blocks,
    where each layer's features are concatenated to all the block's before. Each link gets
    ``grow_room``, the entries the links after it add (from shape inference: a chain whose sizes
    are not all known is left alone), so its CPU kernel appends in place after the link before
    and leaves room for the rest (``ops/cache_append.py``). Returns the links marked."""
    outputs = _graph_outputs(model)
    readers: dict[str, list[Layer]] = {}
    for layer in model.layers:
        for name in layer.inputs:
            readers.setdefault(name, []).append(layer)

    def concat(layer: Layer) -> bool:
        return (layer.op_type == "Concat" and layer.domain in ("", "ai.onnx") and len(layer.inputs) > 1
                and not layer.appends_cache and all(layer.inputs) and len(layer.outputs) == 1)

    def next_link(layer: Layer) -> Layer | None:
        """The Concat that extends ``layer``'s output, if exactly one does and nothing else concats it."""
        out = layer.outputs[0]
        if out in outputs:
            return None
        concats = [r for r in readers.get(out, []) if concat(r) and out in r.inputs]
        if len(concats) != 1 or concats[0].inputs[0] != out or out in concats[0].inputs[1:]:
            return None
        following = concats[0]
        return following if following.attrs.get("axis", 1) == layer.attrs.get("axis", 1) else None

    def added(layer: Layer) -> int | None:
        """How many entries ``layer`` adds along its axis to its first input, if shapes say."""
        axis = layer.attrs.get("axis", 1)
        total = 0
        for name in layer.inputs[1:]:
            info = model.value_info.get(name)
            shape = None if info is None else info.shape
            if shape is None or not -len(shape) <= axis < len(shape) or not isinstance(shape[axis], int):
                return None
            total += shape[axis]
        return total

    links = [layer for layer in model.layers if concat(layer)]
    extended = {id(following) for layer in links if (following := next_link(layer)) is not None}
    marked = 0
    for head in links:
        if id(head) in extended:
            continue  # (not a chain's first link)
        chain = [head]
        while (following := next_link(chain[-1])) is not None:
            chain.append(following)
        if len(chain) < 2:
            continue
        sizes = [added(link) for link in chain[1:]]
        if any(size is None for size in sizes):
            continue
        room = sum(sizes)  # type: ignore[arg-type]
        for link, size in zip(chain, sizes + [0]):
            link.grow_room = room
            room -= size  # type: ignore[operator]
            marked += 1
    return marked


PASSES: list[tuple[str, Callable[[Model], int]]] = [
    ("eliminate_identities", eliminate_identities),
    ("fold_constants", fold_constants),
    ("remove_dead_layers", remove_dead_layers),
    ("promote_narrow_floats", promote_narrow_floats),
    *PATTERN_PASSES,
    ("simplify_reshapes", simplify_reshapes),
    ("fold_affine", fold_affine),
    ("fuse_activations", fuse_activations),
    ("widen_narrow_weights", widen_narrow_weights),
    ("untranspose_gemm_weights", untranspose_gemm_weights),  # (after the weights' dtype is settled)
    ("fuse_gemm_reshapes", fuse_gemm_reshapes),  # after both: a Gemm's activations and weights settled
    ("fuse_squeeze_excite", fuse_squeeze_excite),  # (after the convs' activations are fused too)
    ("fuse_matmul_bias", fuse_matmul_bias),  # (after the Add's activations are fused)
    ("fuse_sibling_products", fuse_sibling_products),  # (after: Q, K and V as MatMulBias layers)
    ("fuse_add_layer_norm", fuse_add_layer_norm),  # (after: a projection's bias Add is that fusion's)
    ("fuse_channel_shuffles", fuse_channel_shuffles),  # (after the convs' activations; before the next)
    ("fuse_joined_convs", fuse_joined_convs),  # (after the convs' activations)
    ("fuse_sibling_convs", fuse_sibling_convs),  # (after: a 1x1 conv joined to a 3x3 one is taken)
    ("fuse_residual_adds", fuse_residual_adds),  # (after both, and the Add's activations)
    ("fuse_conv_max_pools", fuse_conv_max_pools),  # (after the convs' activations)
    ("fuse_joined_conv_max_pools", fuse_joined_conv_max_pools),  # (after fuse_joined_convs)
    ("fuse_expand_depthwise", fuse_expand_depthwise),  # (after the other conv fusions)
    ("fuse_reshape_transposes", fuse_reshape_transposes),
    ("fuse_split_heads", fuse_split_heads),
    ("mark_cache_appends", mark_cache_appends),
    ("mark_concat_chains", mark_concat_chains),  # (after: a KV cache's Concat is not a chain's)
    ("drop_unread_constants", drop_unread_constants),  # (last: after every pass that replaces weights)
]


def optimize(model: Model) -> Model:
    """Run every pass in order, recording rewrite counts in ``model.optimizations``; then mark CPU-bound values.

    Passes guard against malformed models themselves; should one still fail, the failure is a
    ModelLoadError naming the model and the pass, never a raw exception out of ``load_model``."""
    for name, run_pass in PASSES + [("cpu_bound_values", mark_cpu_bound)]:
        try:
            with np.errstate(all="ignore"):  # constants may hold inf/NaN: IEEE results, no warnings
                model.optimizations[name] = run_pass(model)
        except AsyncInferError:
            raise
        except Exception as exc:  # noqa: BLE001 - an untrusted model must never surface a raw error
            raise ModelLoadError(f"{model.source}: optimizer pass {name} failed on this model: "
                                 f"{type(exc).__name__}: {exc}") from exc
    return model
