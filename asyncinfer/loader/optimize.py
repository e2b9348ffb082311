"""Graph passes run at load time. Each pass is a function ``Model -> int`` (how many rewrites).

They never change results beyond float rounding: folding runs the very kernels that would run
later; Conv+BatchNormalization folding is exact algebra done in float64.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import ml_dtypes
import numpy as np

from .. import ops
from ..errors import AsyncInferError
from ..ops.elementwise import compute_dtype
from ..model.ir import Layer, Model

# Folding is skipped for layers producing more than this: a 1-GiB broadcast is cheaper to compute
# at run time than to keep resident. ConstantOfShape weights of real models are far below it.
MAX_FOLDED_BYTES = 1 << 30
# Ops whose output depends only on the *shape* of their input: CPU-bound propagation stops there.
SHAPE_ONLY_OPS = {"Shape", "Size"}
# Ops that may carry a fused activation: the activation then runs on the same thread, in place.
FUSION_HOSTS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sum", "BatchNormalization"}
CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}


def _graph_outputs(model: Model) -> set[str]:
    return {o.name for o in model.outputs}


def _rename_input(model: Model, old: str, new: str) -> None:
    for layer in model.layers:
        layer.inputs = [new if n == old else n for n in layer.inputs]


def eliminate_identities(model: Model) -> int:
    """Drop Identity and inference-mode Dropout layers, wiring consumers to their input."""
    outputs = _graph_outputs(model)
    # subgraphs read outer values by name: those names must survive
    pinned = outputs | {n for layer in model.layers for n in layer.outer_inputs}
    kept, removed = [], 0
    for layer in model.layers:
        passthrough = layer.op_type == "Identity" or (
            layer.op_type == "Dropout" and (len(layer.outputs) < 2 or not layer.outputs[1])
            and not layer.attrs.get("training_mode") and (len(layer.inputs) < 3 or not layer.inputs[2]))
        if passthrough and layer.domain == "" and layer.outputs[0] not in pinned and layer.inputs and layer.inputs[0]:
            _rename_input(model, layer.outputs[0], layer.inputs[0])
            removed += 1
        else:
            kept.append(layer)
    model.layers = kept
    return removed


def fold_constants(model: Model) -> int:
    """Evaluate layers whose inputs are all constant; also ``Shape``/``Size`` of statically shaped values."""
    folded, kept = 0, []
    for layer in model.layers:
        value = _try_fold(model, layer)
        if value is None:
            kept.append(layer)
            continue
        for name, array in zip(layer.outputs, value):
            if name:
                model.constants[name] = array
        folded += 1
    model.layers = kept
    return folded


def _try_fold(model: Model, layer: Layer) -> tuple | None:
    if layer.op_type in CONTROL_FLOW or layer.fused:
        return None
    if layer.op_type in SHAPE_ONLY_OPS and layer.domain == "" and layer.inputs[0] not in model.constants:
        return _fold_shape(model, layer)
    if not all(name in model.constants for name in layer.inputs if name):
        return None
    try:
        op = ops.create(layer)
    except AsyncInferError:
        return None  # reported by the support check with every other unsupported op
    if not op.deterministic:
        return None
    try:
        with np.errstate(all="ignore"):
            outs = op(*[model.constants[n] if n else None for n in layer.inputs])
    except Exception:
        return None  # leave it to run time, where a failure is an ExecutionError naming the layer
    if any(isinstance(o, np.ndarray) and o.nbytes > MAX_FOLDED_BYTES for o in outs):
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


def _fold_shape(model: Model, layer: Layer) -> tuple | None:
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
    for name in [c for c in model.constants if c not in needed]:
        del model.constants[name]
    return removed


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
            self.weight = w.astype(np.float64)
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
        c = model.constants
        if layer.domain or layer.fused or len([o for o in layer.outputs if o]) != 1:
            return False
        if layer.op_type == "Conv":
            names = [n for n in layer.inputs[1:3] if n]
            return all(n in c for n in names) and c[layer.inputs[1]].dtype in (np.float16, np.float32, np.float64)
        if layer.op_type == "BatchNormalization":
            return not layer.attrs.get("training_mode", 0) and all(n in c for n in layer.inputs[1:5]) \
                and c[layer.inputs[1]].dtype in (np.float16, np.float32, np.float64)
        return False

    def scale_by(self, s: np.ndarray) -> None:
        self.weight = self.weight * (s.reshape((-1,) + (1,) * (self.weight.ndim - 1)) if self.weight.ndim > 1 else s)
        self.bias = self.bias * s

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
            c[f"{name}::folded_weight"] = _frozen(self.weight.astype(self.dtype))
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
    widen = []
    for info in model.inputs:
        if narrow(info.name):
            wide = f"{info.name}::float32"
            _rename_input(model, info.name, wide)
            widen.append(Layer(name=f"{info.name}::widen", op_type="Cast", inputs=[info.name], outputs=[wide],
                               attrs={"to": FLOAT32_CODE}, version=version))
            model.value_info[wide] = replace(info, name=wide, dtype=np.dtype(np.float32))
    for info in model.outputs:
        if narrow(info.name):
            wide = f"{info.name}::float32"
            _rename_input(model, info.name, wide)
            layer = producers[info.name]
            layer.outputs = [wide if o == info.name else o for o in layer.outputs]
            model.layers.append(Layer(name=f"{info.name}::round", op_type="Cast", inputs=[wide], outputs=[info.name],
                                      attrs={"to": PROMOTED_FLOATS[np.dtype(info.dtype)]}, version=version))
            model.value_info[wide] = replace(info, name=wide, dtype=np.dtype(np.float32))
    model.layers[:0] = widen
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


PASSES: list[tuple[str, Callable[[Model], int]]] = [
    ("eliminate_identities", eliminate_identities),
    ("fold_constants", fold_constants),
    ("remove_dead_layers", remove_dead_layers),
    ("promote_narrow_floats", promote_narrow_floats),
    ("fold_affine", fold_affine),
    ("fuse_activations", fuse_activations),
    ("widen_narrow_weights", widen_narrow_weights),
]


def optimize(model: Model) -> Model:
    """Run every pass in order, recording rewrite counts in ``model.optimizations``; then mark CPU-bound values."""
    for name, run_pass in PASSES:
        model.optimizations[name] = run_pass(model)
    model.optimizations["cpu_bound_values"] = mark_cpu_bound(model)
    return model
