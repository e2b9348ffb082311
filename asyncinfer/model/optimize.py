"""Graph passes run at load time. Each pass is a function ``Model -> int`` (how many rewrites).

They never change results beyond float rounding: folding runs the very kernels that would run
later; Conv+BatchNormalization folding is exact algebra done in float64.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import ops
from ..errors import AsyncInferError
from .ir import Layer, Model

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
    kept, removed = [], 0
    for layer in model.layers:
        passthrough = layer.op_type == "Identity" or (
            layer.op_type == "Dropout" and (len(layer.outputs) < 2 or not layer.outputs[1])
            and not layer.attrs.get("training_mode") and (len(layer.inputs) < 3 or not layer.inputs[2]))
        if passthrough and layer.domain == "" and layer.outputs[0] not in outputs and layer.inputs and layer.inputs[0]:
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


def fold_conv_batchnorm(model: Model) -> int:
    """Fold an inference BatchNormalization into the Conv before it: W' = W·s, B' = (B − mean)·s + beta."""
    consumers = model.consumers()
    outputs = _graph_outputs(model)
    producers = model.producers()
    removed: set[int] = set()
    count = 0
    for bn in model.layers:
        if bn.op_type != "BatchNormalization" or bn.domain or bn.attrs.get("training_mode", 0):
            continue
        if len(bn.outputs) > 1 and any(bn.outputs[1:]):
            continue
        conv = producers.get(bn.inputs[0])
        if conv is None or conv.op_type != "Conv" or conv.domain or conv.fused:
            continue
        if conv.outputs[0] in outputs or len(consumers.get(conv.outputs[0], [])) != 1:
            continue
        params = bn.inputs[1:5]
        weight_names = [n for n in conv.inputs[1:3] if n]
        if not all(n in model.constants for n in params + weight_names):
            continue
        scale, beta, mean, var = (model.constants[n].astype(np.float64) for n in params)
        w = model.constants[conv.inputs[1]]
        if w.dtype != np.float32 and w.dtype != np.float64:
            continue
        eps = bn.attrs.get("epsilon", 1e-5)
        s = scale / np.sqrt(var + eps)
        bias = model.constants[conv.inputs[2]].astype(np.float64) if len(conv.inputs) > 2 and conv.inputs[2] else 0.0
        new_w = (w.astype(np.float64) * s.reshape((-1,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        new_b = ((bias - mean) * s + beta).astype(w.dtype)
        w_name, b_name = f"{conv.name}::folded_weight", f"{conv.name}::folded_bias"
        model.constants[w_name] = _frozen(new_w)
        model.constants[b_name] = _frozen(new_b)
        conv.inputs = [conv.inputs[0], w_name, b_name]
        conv.outputs = [bn.outputs[0]]
        removed.add(id(bn))
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
    ("fold_conv_batchnorm", fold_conv_batchnorm),
    ("fuse_activations", fuse_activations),
]


def optimize(model: Model) -> Model:
    """Run every pass in order, recording rewrite counts in ``model.optimizations``; then mark CPU-bound values."""
    for name, run_pass in PASSES:
        model.optimizations[name] = run_pass(model)
    model.optimizations["cpu_bound_values"] = mark_cpu_bound(model)
    return model
