"""Subgraph fusions: element-wise expansions that exporters write out, folded back into one op.

PyTorch exports at opset 17 spell GELU as ``Div/Erf/Add/Mul/Mul``, older LayerNorms as nine
layers from ``ReduceMean`` to the bias ``Add``, Llama's RMSNorm as ``Pow/ReduceMean/Add/Sqrt/
Div/Mul/Mul`` and SiLU as ``Mul(x, Sigmoid(x))``. Each pass here recognises one such expansion
and replaces it by the ONNX op that defines the same function (``Gelu`` 20, ``LayerNormalization``
17, ``RMSNormalization`` 23, ``Swish`` 24), whatever the model's opset: one layer instead of
five to nine, one task, fewer passes over memory, and an activation that ``fuse_activations``
can then run in place inside the MatMul or Conv before it. Every backend implements the fused ops.
The attention of exported decoders (scores, scale, masks, softmax, values: seven layers) becomes
``MaskedAttention`` of asyncinfer's own domain (``ops/fused.py``), and a CNN's
squeeze-and-excitation block (pool, two convs, Mul) ``SqueezeExcite``, and an STFT's magnitude
(``Sqrt`` of a sum of two squares) ``Magnitude``; a backend without such a
kernel runs the layers it keeps (``Layer.expansion``). Layout layers that only serve a GEMM or
split attention heads go into one layer with it (``ReshapedGemm``, ``ReshapeTranspose``: passes
run late by ``optimize``, after the activations are fused), and so does the channel shuffle after
a grouped conv (``ShuffledConv``).

A pattern is fused only when it is exactly the function: the constants are checked (√2, 1, ½,
ε…), every intermediate value has no consumer outside the pattern and is no graph output, and
the reductions run over the last axis. Anything else is left as it is. The fused layer takes the
place of the pattern's last layer, so the layer order stays topological.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import numpy as np

from .. import ops
from ..errors import AsyncInferError
from ..model.ir import Layer, Model, TensorInfo
from ..model.mapped import is_mapped
from ..ops.conv_direct import MAX_CHANNELS as DIRECT_MAX_CHANNELS
from ..ops.conv_direct import PANEL_WIDTH
from ..ops.conv_pool import MAX_TAPS as CONV_POOL_MAX_TAPS
from ..ops.expand_depthwise import joins as joins_expand_depthwise
from ..ops.fused import FUSED_DOMAIN, SPLIT_HEADS_PARTS

# Relative tolerance when recognising a constant written by an exporter (float32 literals).
CONSTANT_RTOL = 1e-5
#: The op each fusion produces: (op_type, schema version).
GELU, LAYER_NORM, RMS_NORM, SWISH = ("Gelu", 20), ("LayerNormalization", 17), ("RMSNormalization", 23), ("Swish", 24)
MASKED_ATTENTION, ROTARY_HALF = ("MaskedAttention", 1), ("RotaryHalfEmbedding", 1)  # in FUSED_DOMAIN
RESHAPED_GEMM, RESHAPE_TRANSPOSE = ("ReshapedGemm", 1), ("ReshapeTranspose", 1)  # in FUSED_DOMAIN
SPLIT_HEADS = ("SplitHeads", 1)  # in FUSED_DOMAIN
SQUEEZE_EXCITE = ("SqueezeExcite", 1)  # in FUSED_DOMAIN
MATMUL_BIAS = ("MatMulBias", 1)  # in FUSED_DOMAIN
SHUFFLED_CONV = ("ShuffledConv", 1)  # in FUSED_DOMAIN
JOINED_CONV = ("JoinedConv", 1)  # in FUSED_DOMAIN
RESIDUAL_CONV = ("ResidualConv", 1)  # in FUSED_DOMAIN
CONV_MAX_POOL = ("ConvMaxPool", 1)  # in FUSED_DOMAIN
EXPAND_DEPTHWISE = ("ExpandDepthwise", 1)  # in FUSED_DOMAIN
JOINED_CONV_MAX_POOL = ("JoinedConvMaxPool", 1)  # in FUSED_DOMAIN
ADD_LAYER_NORM = ("AddLayerNormalization", 1)  # in FUSED_DOMAIN
MAGNITUDE = ("Magnitude", 1)  # in FUSED_DOMAIN
#: Ops that read only the shape of their input: a Reshape they also read may still be fused away.
SHAPE_READERS = frozenset({"Shape", "Size"})


class _Graph:
    """What the matchers ask of the model: producers, single consumers, scalar constants."""

    def __init__(self, model: Model):
        self.model = model
        self.producers = model.producers()
        self.consumers = model.consumers()
        self.pinned = {o.name for o in model.outputs} | {n for l in model.layers for n in l.outer_inputs}
        self.removed: set[int] = set()  # ids of layers taken by an earlier match

    def candidates(self, *op_types: str) -> Iterator[Layer]:
        """The layers of ``op_types`` (default domain, nothing fused into them) a match may start
        from, in graph order, skipping those an earlier match of the pass took."""
        for layer in list(self.model.layers):
            if id(layer) not in self.removed and not layer.domain and not layer.fused and layer.op_type in op_types:
                yield layer

    def op(self, name: str, *op_types: str) -> Layer | None:
        """The live producer of ``name`` if it is one of ``op_types`` (default domain, one output)."""
        layer = self.producers.get(name)
        if (layer is None or id(layer) in self.removed or layer.domain or layer.op_type not in op_types
                or layer.fused or len([o for o in layer.outputs if o]) != 1):
            return None
        return layer

    def private(self, name: str, uses: int = 1) -> bool:
        """``name`` has exactly ``uses`` consumers and is no graph output: the pattern owns it."""
        return name not in self.pinned and len(self.consumers.get(name, ())) == uses

    def only_consumer(self, name: str, *op_types: str) -> Layer | None:
        users = self.consumers.get(name, [])
        if len(users) != 1 or name in self.pinned:
            return None
        layer = users[0]
        if id(layer) in self.removed or layer.domain or layer.op_type not in op_types or layer.fused:
            return None
        return layer

    def scalar(self, name: str) -> float | None:
        """The value of a one-element float constant, else None."""
        value = self.model.constants.get(name)
        if value is None or not isinstance(value, np.ndarray) or value.size != 1 or value.dtype.kind != "f":
            return None
        return float(value.reshape(-1)[0])

    def is_scalar(self, name: str, expected: float) -> bool:
        value = self.scalar(name)
        return value is not None and math.isclose(value, expected, rel_tol=CONSTANT_RTOL)

    def last_axis_vector(self, name: str, x: str) -> bool:
        """``name`` is a float constant of shape ``[C]`` (or ``[1, …, C]``) with C the last dim of ``x``."""
        value = self.model.constants.get(name)
        if value is None or not isinstance(value, np.ndarray) or value.dtype.kind != "f" or value.ndim < 1:
            return False
        if any(d != 1 for d in value.shape[:-1]):
            return False
        last = self.last_dim(x)
        return last is not None and value.shape[-1] == last

    def last_dim(self, name: str) -> int | None:
        info = self.info(name)
        if info is None or not info.shape or not isinstance(info.shape[-1], int):
            return None
        return info.shape[-1]

    def rank(self, name: str) -> int | None:
        info = self.info(name)
        return None if info is None or info.shape is None else len(info.shape)

    @staticmethod
    def other(layer: Layer, name: str) -> str | None:
        """The other input of a two-input layer that reads ``name`` once."""
        if len(layer.inputs) != 2 or layer.inputs.count(name) != 1:
            return None
        return layer.inputs[1] if layer.inputs[0] == name else layer.inputs[0]

    def reduces_last_axis(self, layer: Layer, x: str) -> bool:
        """``layer`` is a ReduceMean of ``x`` over its last axis only, keeping dims."""
        if layer.attrs.get("keepdims", 1) != 1 or layer.inputs[0] != x:
            return False
        if len(layer.inputs) > 1 and layer.inputs[1]:
            axes = self.model.constants.get(layer.inputs[1])
            axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
        else:
            axes = layer.attrs.get("axes")
            axes = None if axes is None else [int(a) for a in axes]
        if axes is None or len(axes) != 1:
            return False
        return axes[0] == -1 or (self.rank(x) is not None and axes[0] == self.rank(x) - 1)

    def info(self, name: str) -> TensorInfo | None:
        return self.model.value_info.get(name) or next((i for i in self.model.inputs if i.name == name), None)

    def replace(self, pattern: Iterable[Layer], last: Layer, fused: Layer) -> None:
        """Put ``fused`` in place of ``last`` (same object, same place in the layer order) and
        drop the rest of ``pattern``, keeping the consumer lists true for later matches."""
        for layer in pattern:
            self.removed.add(id(layer))
            for name in layer.inputs:
                users = self.consumers.get(name)
                if users is not None:
                    users[:] = [u for u in users if u is not layer]
        last.__dict__.update(fused.__dict__)
        self.removed.discard(id(last))
        for name in last.inputs:
            self.consumers.setdefault(name, []).append(last)

    def commit(self) -> None:
        self.model.layers = [l for l in self.model.layers if id(l) not in self.removed]


def _available(op: tuple[str, int]) -> bool:
    try:
        ops.lookup(op[0], op[1], "")
        return True
    except AsyncInferError:  # RMSNormalization needs onnx >= 1.18
        return False


def _product_with_half(g: _Graph, x: str, factor: str) -> tuple[list[Layer], Layer] | None:
    """The layers computing ``x · factor · ½`` from ``factor`` in any of the ways exporters write it
    (``(x·f)·½``, ``(f·x)·½``, ``(x·½)·f``, ``(f·½)·x``), and the last of them."""
    first = g.only_consumer(factor, "Mul")
    if first is None:
        return None
    other = g.other(first, factor)
    if other is None:
        return None
    if other == x or g.is_scalar(other, 0.5):  # (x·f)·½ or (f·½)·x
        second = g.only_consumer(first.outputs[0], "Mul")
        if second is None:
            return None
        want = (lambda n: g.is_scalar(n, 0.5)) if other == x else (lambda n: n == x)
        rest = g.other(second, first.outputs[0])
        return ([first, second], second) if rest is not None and want(rest) else None
    half = g.op(other, "Mul")  # (x·½)·f with x·½ computed on the side
    if half is not None and g.private(other) and sorted(half.inputs, key=lambda n: n != x)[0] == x:
        rest = g.other(half, x)
        if rest is not None and g.is_scalar(rest, 0.5):
            return [half, first], first
    return None


def _gelu_layer(name: str, x: str, out: str, approximate: str) -> Layer:
    return Layer(name=name, op_type=GELU[0], inputs=[x], outputs=[out], attrs={"approximate": approximate},
                 version=GELU[1])


def fuse_gelu(model: Model) -> int:
    """``x·½·(1 + erf(x/√2))`` → ``Gelu``, and ``x·½·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` →
    ``Gelu(approximate="tanh")``."""
    if not _available(GELU):
        return 0
    g, count = _Graph(model), 0
    for layer in g.candidates("Erf", "Tanh"):
        inner = layer.inputs[0]
        match = _erf_argument(g, inner) if layer.op_type == "Erf" else _tanh_argument(g, inner)
        if match is None or not g.private(inner):
            continue
        x, argument_layers = match
        plus_one = g.only_consumer(layer.outputs[0], "Add")
        if plus_one is None or not g.is_scalar(g.other(plus_one, layer.outputs[0]) or "", 1.0):
            continue
        product = _product_with_half(g, x, plus_one.outputs[0])
        if product is None:
            continue
        tail, last = product
        fused = _gelu_layer(last.name, x, last.outputs[0], "none" if layer.op_type == "Erf" else "tanh")
        g.replace(argument_layers + [layer, plus_one] + tail, last, fused)
        count += 1
    g.commit()
    return count


def _erf_argument(g: _Graph, name: str) -> tuple[str, list[Layer]] | None:
    """``x`` if ``name`` is ``x / √2`` or ``x · (1/√2)``."""
    scaled = g.op(name, "Div", "Mul")
    if scaled is None or len(scaled.inputs) != 2:
        return None
    a, b = scaled.inputs
    if scaled.op_type == "Div" and g.is_scalar(b, math.sqrt(2.0)):
        return a, [scaled]
    if scaled.op_type == "Mul":
        for x, c in ((a, b), (b, a)):
            if g.is_scalar(c, 1 / math.sqrt(2.0)):
                return x, [scaled]
    return None


def _tanh_argument(g: _Graph, name: str) -> tuple[str, list[Layer]] | None:
    """``x`` if ``name`` is ``√(2/π)·(x + 0.044715·x³)`` (x³ as ``Pow(x, 3)`` or ``x·x·x``)."""
    scaled = g.op(name, "Mul")
    if scaled is None or len(scaled.inputs) != 2:
        return None
    for s, c in (scaled.inputs, scaled.inputs[::-1]):
        add = g.op(s, "Add")
        if add is None or not g.is_scalar(c, math.sqrt(2 / math.pi)) or not g.private(s) or len(add.inputs) != 2:
            continue
        for x, cube_term in (add.inputs, add.inputs[::-1]):
            cube_layers = _times_cube(g, cube_term, x)
            if cube_layers is not None:
                return x, [scaled, add] + cube_layers
    return None


def _times_cube(g: _Graph, name: str, x: str) -> list[Layer] | None:
    """The layers of ``0.044715·x³`` if ``name`` is that."""
    mul = g.op(name, "Mul")
    if mul is None or not g.private(name) or len(mul.inputs) != 2:
        return None
    for cube, c in (mul.inputs, mul.inputs[::-1]):
        if not g.is_scalar(c, 0.044715) or not g.private(cube):
            continue
        power = g.op(cube, "Pow")
        if power is not None and power.inputs[0] == x and g.is_scalar(power.inputs[1], 3.0):
            return [mul, power]
    return None


def fuse_layer_norm(model: Model) -> int:
    """``(x - mean(x)) / sqrt(mean((x - mean(x))²) + ε) · γ + β`` over the last axis →
    ``LayerNormalization(axis=-1)`` (γ, β constants of the last dim's size)."""
    if not _available(LAYER_NORM):
        return 0
    g, count = _Graph(model), 0
    for mean in g.candidates("ReduceMean"):
        x = mean.inputs[0]
        if not g.reduces_last_axis(mean, x):
            continue
        sub = g.only_consumer(mean.outputs[0], "Sub")
        if sub is None or sub.inputs != [x, mean.outputs[0]]:
            continue
        d = sub.outputs[0]
        users = list({id(u): u for u in g.consumers.get(d, [])}.values())  # Mul(d, d) reads d twice
        if len(users) != 2 or d in g.pinned:
            continue
        square = next((u for u in users if _squares(g, u, d)), None)
        divide = next((u for u in users if u.op_type == "Div" and u.inputs[0] == d), None)
        if square is None or divide is None or square is divide:
            continue
        rms = _root_mean_square(g, square)
        if rms is None:
            continue
        rms_layers, eps, root = rms
        if divide.inputs != [d, root] or not g.private(root):
            continue
        pattern = [mean, sub, *rms_layers, divide]
        last, scale, bias = divide, None, None
        times = g.only_consumer(divide.outputs[0], "Mul")
        gamma = g.other(times, divide.outputs[0]) if times is not None else None
        if gamma is not None and g.last_axis_vector(gamma, x):
            pattern.append(times)
            last, scale = times, gamma
            plus = g.only_consumer(times.outputs[0], "Add")
            beta = g.other(plus, times.outputs[0]) if plus is not None else None
            if beta is not None and g.last_axis_vector(beta, x):
                pattern.append(plus)
                last, bias = plus, beta
        if scale is None:  # LayerNormalization needs a scale: ones, when x's type is known
            info, channels = g.info(x), g.last_dim(x)
            if channels is None or info is None or info.dtype is None or np.dtype(info.dtype).kind != "f":
                continue
            dtype = info.dtype
            scale = f"{divide.name}/ones"
            model.constants[scale] = np.ones(channels, dtype=dtype)
        inputs = [x, scale] + ([bias] if bias is not None else [])
        fused = Layer(name=last.name, op_type=LAYER_NORM[0], inputs=inputs, outputs=[last.outputs[0]],
                      attrs={"axis": -1, "epsilon": eps}, version=LAYER_NORM[1])
        g.replace(pattern, last, fused)
        count += 1
    g.commit()
    return count


def fuse_rms_norm(model: Model) -> int:
    """``x / sqrt(mean(x²) + ε) · γ`` over the last axis (the division as ``x · (1 / sqrt(…))``,
    ``x · Reciprocal(sqrt(…))`` or ``x / sqrt(…)``) → ``RMSNormalization(axis=-1)``."""
    if not _available(RMS_NORM):
        return 0
    g, count = _Graph(model), 0
    for square in g.candidates("Pow", "Mul"):
        x = square.inputs[0]
        rms = _root_mean_square(g, square) if _squares(g, square, x) else None
        if rms is None:
            continue
        pattern, eps, root = rms
        normed = _divided_by(g, x, root, pattern)
        if normed is None:
            continue
        times = g.only_consumer(normed.outputs[0], "Mul")
        gamma = g.other(times, normed.outputs[0]) if times is not None else None
        if gamma is None or not g.last_axis_vector(gamma, x):
            continue
        pattern.append(times)
        fused = Layer(name=times.name, op_type=RMS_NORM[0], inputs=[x, gamma], outputs=[times.outputs[0]],
                      attrs={"axis": -1, "epsilon": eps}, version=RMS_NORM[1])
        g.replace(pattern, times, fused)
        count += 1
    g.commit()
    return count


def _squares(g: _Graph, layer: Layer, x: str) -> bool:
    """``layer`` computes ``x²``, as ``Pow(x, 2)`` or ``Mul(x, x)``."""
    return (layer.op_type == "Pow" and len(layer.inputs) == 2 and layer.inputs[0] == x
            and g.is_scalar(layer.inputs[1], 2.0)) or (layer.op_type == "Mul" and layer.inputs == [x, x])


def _root_mean_square(g: _Graph, square: Layer) -> tuple[list[Layer], float, str] | None:
    """From a squaring layer: ``sqrt(ReduceMean(square over the last axis) + ε)``, as its layers
    (the square first), ε and the name of the root; None if that is not what follows."""
    mean = g.only_consumer(square.outputs[0], "ReduceMean")
    if mean is None or not g.reduces_last_axis(mean, square.outputs[0]):
        return None
    plus_eps = g.only_consumer(mean.outputs[0], "Add")
    eps = g.scalar(g.other(plus_eps, mean.outputs[0]) or "") if plus_eps is not None else None
    if plus_eps is None or eps is None or eps < 0:
        return None
    root = g.only_consumer(plus_eps.outputs[0], "Sqrt")
    if root is None:
        return None
    return [square, mean, plus_eps, root], eps, root.outputs[0]


def _divided_by(g: _Graph, x: str, root: str, pattern: list[Layer]) -> Layer | None:
    """The layer giving ``x / root`` (appending the layers on the way to ``pattern``)."""
    user = g.only_consumer(root, "Div", "Reciprocal")
    if user is None:
        return None
    if user.op_type == "Div" and user.inputs == [x, root]:
        pattern.append(user)
        return user
    if user.op_type == "Div" and (user.inputs[1] != root or not g.is_scalar(user.inputs[0], 1.0)):
        return None
    times = g.only_consumer(user.outputs[0], "Mul")  # x · (1 / root)
    if times is None or g.other(times, user.outputs[0]) != x:
        return None
    pattern += [user, times]
    return times


def fuse_silu(model: Model) -> int:
    """``x · Sigmoid(x)`` → ``Swish`` (SiLU; EfficientNet's and Llama's activation), which
    ``fuse_activations`` then runs in place inside the Conv or MatMul producing ``x``."""
    if not _available(SWISH):
        return 0
    g, count = _Graph(model), 0
    for sigmoid in g.candidates("Sigmoid"):
        x = sigmoid.inputs[0]
        times = g.only_consumer(sigmoid.outputs[0], "Mul")
        if times is None or g.other(times, sigmoid.outputs[0]) != x:
            continue
        fused = Layer(name=times.name, op_type=SWISH[0], inputs=[x], outputs=[times.outputs[0]],
                      attrs={"alpha": 1.0}, version=SWISH[1])
        g.replace([sigmoid, times], times, fused)
        count += 1
    g.commit()
    return count


def fuse_magnitude(model: Model) -> int:
    """``Sqrt(Add(Mul(a, a), Mul(b, b)))`` → ``Magnitude(a, b)`` (``ops/fused.py``): an STFT's
    magnitude in an audio model, four layers to one. The squares and their sum have no reader
    outside the pattern; the four stay in the expansion for backends without the fused kernel."""
    g, count = _Graph(model), 0
    for root in g.candidates("Sqrt"):
        total = g.op(root.inputs[0], "Add")
        if total is None or not g.private(total.outputs[0]) or len(total.inputs) != 2:
            continue
        squares = [g.op(name, "Mul") for name in total.inputs]
        if any(sq is None or not g.private(sq.outputs[0]) or len(sq.inputs) != 2 or sq.inputs[0] != sq.inputs[1]
               for sq in squares) or squares[0] is squares[1]:
            continue
        pattern = [*squares, total, root]
        expansion = [replace(layer) for layer in pattern]  # the originals: ``replace`` rewrites ``root``
        inputs = [sq.inputs[0] for sq in squares]  # type: ignore[union-attr]
        fused = Layer(name=root.name, op_type=MAGNITUDE[0], inputs=inputs, outputs=[root.outputs[0]],
                      domain=FUSED_DOMAIN, version=MAGNITUDE[1], expansion=expansion)
        g.replace(pattern, root, fused)  # type: ignore[arg-type]
        count += 1
    g.commit()
    return count


def fuse_attention(model: Model) -> int:
    """``Softmax(Add(Where(keep, Div(MatMul(Q, Transpose(K)), scale), fill), bias)) @ V``, each of
    the Div (or Mul), Where and Add optional, → ``MaskedAttention`` (``ops/fused.py``): the
    attention of exported decoders, seven layers a block that a decode step ran one by one. An
    encoder's too: K's Transpose may go straight from ``(B, S, H, D)`` to ``(B, H, D, S)``
    (``k_perm``), and the Transposes splitting Q and V into heads are taken in (``q_perm``,
    ``v_perm``: read through views), but for a head split after a ``Split``, left to
    ``fuse_split_heads``. The fused layer keeps them all as its expansion, for backends without
    the fused kernel."""
    g, count = _Graph(model), 0
    for softmax in g.candidates("Softmax"):
        match = _attention(g, softmax)
        if match is None:
            continue
        pattern, inputs, attrs = match
        last = pattern[-1]
        expansion = [replace(layer) for layer in pattern]  # the originals: ``replace`` rewrites ``last``
        fused = Layer(name=last.name, op_type=MASKED_ATTENTION[0], inputs=inputs, outputs=[last.outputs[0]],
                      attrs=attrs, domain=FUSED_DOMAIN, version=MASKED_ATTENTION[1], expansion=expansion)
        g.replace(pattern, last, fused)
        count += 1
    g.commit()
    return count


def _attention(g: _Graph, softmax: Layer) -> tuple[list[Layer], list[str], dict[str, int]] | None:
    """The layers of an attention ending in ``softmax``'s MatMul (in graph order), the fused
    layer's inputs and attributes; None when it is not exactly that pattern."""
    axis = softmax.attrs.get("axis", -1 if softmax.version >= 13 else 1)
    rank = g.rank(softmax.inputs[0])
    if axis != -1 and (rank is None or axis != rank - 1):
        return None
    out = g.only_consumer(softmax.outputs[0], "MatMul")
    if out is None or out.inputs[0] != softmax.outputs[0] or out.inputs[1] == softmax.outputs[0]:
        return None
    chain = [out, softmax]
    x = softmax.inputs[0]
    bias = keep = fill = scale = ""
    divides = True
    add = g.op(x, "Add") if g.private(x) else None
    if add is not None:
        inner = next((n for n in add.inputs if g.private(n) and g.op(n, "Where", "Div", "Mul", "MatMul")), None)
        if inner is None or len(add.inputs) != 2:
            return None
        bias, x = g.other(add, inner) or "", inner
        if not bias:
            return None
        chain.append(add)
    where = g.op(x, "Where") if g.private(x) else None
    if where is not None:
        if where.inputs[1] == where.inputs[0] or not g.private(where.inputs[1]) or g.scalar(where.inputs[2]) is None:
            return None
        keep, x, fill = where.inputs
        chain.append(where)
    times = g.op(x, "Div", "Mul") if g.private(x) else None
    if times is not None:
        constant = times.inputs[1] if times.op_type == "Div" else next(
            (n for n in times.inputs if g.scalar(n) is not None), "")
        inner = g.other(times, constant) if constant else None
        if g.scalar(constant) is None or inner is None or not g.private(inner):
            return None
        scale, x, divides = constant, inner, times.op_type == "Div"
        chain.append(times)
    product = g.op(x, "MatMul") if g.private(x) else None
    if product is None:
        return None
    transpose = g.op(product.inputs[1], "Transpose") if g.private(product.inputs[1]) else None
    if transpose is None or product.inputs[0] == product.inputs[1]:
        return None
    perm = [int(p) for p in transpose.attrs.get("perm", [])]
    if len(perm) < 2 or sorted(perm) != list(range(len(perm))):
        return None
    for constant in (scale, fill):  # scalars that do not raise the scores' rank
        if constant and np.ndim(g.model.constants[constant]) > len(perm):
            return None
    chain += [product, transpose]
    inputs = [product.inputs[0], transpose.inputs[0], out.inputs[1], scale, keep, fill, bias]
    attrs: dict[str, object] = {"scale_divides": int(divides)}
    k_perm = perm[:-2] + [perm[-1], perm[-2]]  # K itself from the Transpose's input (Kᵀ: the last two swapped)
    if k_perm != list(range(len(perm))):  # an encoder's (B, S, H, D) → (B, H, D, S) in one Transpose
        attrs["k_perm"] = k_perm
    for slot, key in ((0, "q_perm"), (2, "v_perm")):  # the heads' split of Q and V, read through views
        split = _heads_split(g, inputs[slot])
        if split is not None:
            inputs[slot] = split.inputs[0]
            attrs[key] = [int(p) for p in split.attrs["perm"]]
            chain.append(split)
    merge = g.only_consumer(out.outputs[0], "Transpose")
    if merge is not None and "perm" in merge.attrs:  # the heads' merge (B, H, S, D) -> (B, S, H, D)
        attrs["out_perm"] = [int(p) for p in merge.attrs["perm"]]
        chain.append(merge)
    repeats = [_head_repeat(g, name) for name in (transpose.inputs[0], out.inputs[1])]
    if all(repeats) and len(attrs) > 1:  # (the repeats come before any perm: not this op's order)
        return None
    if all(repeats):  # grouped-query attention: take K and V before their heads are repeated
        for (source, expand, shape, allowzero, layers), slot, key in zip(repeats, (1, 2), ("k", "v")):  # type: ignore[misc]
            inputs[slot] = source
            inputs += [expand, shape]
            attrs[f"{key}_allowzero"] = allowzero
            chain += layers  # (only when nothing else reads the repeated heads: else they stay)
    return sorted(chain, key=g.model.layers.index), inputs, attrs


def _heads_split(g: _Graph, name: str) -> Layer | None:
    """The ``Transpose`` with an explicit ``perm`` that makes ``name``, read by nothing else, for
    `_attention` to take in; None for none, or for one that splits a ``Split``'s part (after a
    ``Reshape``) into heads: ``fuse_split_heads`` takes those with the Split."""
    transpose = g.op(name, "Transpose") if g.private(name) else None
    if transpose is None or "perm" not in transpose.attrs:
        return None
    reshape = g.op(transpose.inputs[0], "Reshape")
    source = None if reshape is None else g.producers.get(reshape.inputs[0])
    if source is not None and source.op_type == "Split":
        return None
    return transpose


def _head_repeat(g: _Graph, name: str) -> tuple[str, str, str, int, list[Layer]] | None:
    """``name = Reshape(Expand(Unsqueeze(x, [2]), e), s)`` (how exporters repeat K/V heads for
    grouped-query attention): ``(x, e, s, the Reshape's allowzero, the three layers if nothing
    else reads their results, else none)``; None when ``name`` is not made so."""
    reshape = g.producers.get(name)
    if (reshape is None or id(reshape) in g.removed or reshape.op_type != "Reshape" or reshape.domain
            or reshape.fused or reshape.version < 5 or len(reshape.inputs) != 2):
        return None
    expand = g.op(reshape.inputs[0], "Expand") if g.private(reshape.inputs[0]) else None
    unsqueeze = g.op(expand.inputs[0], "Unsqueeze") if expand is not None and g.private(expand.inputs[0]) else None
    if unsqueeze is None:
        return None
    axes = g.model.constants.get(unsqueeze.inputs[1]) if len(unsqueeze.inputs) > 1 else unsqueeze.attrs.get("axes")
    if axes is None or [int(a) for a in np.asarray(axes).reshape(-1)] != [2]:
        return None
    owned = [unsqueeze, expand, reshape] if g.private(name) else []
    return unsqueeze.inputs[0], expand.inputs[1], reshape.inputs[1], int(reshape.attrs.get("allowzero", 0)), owned


def fuse_rotary(model: Model) -> int:
    """``X·cos + Concat(-X[..., h:e], X[..., :h])·sin`` (rotate-half rotary embedding, Slices
    along the last axis with constant bounds) → ``RotaryHalfEmbedding`` (``ops/fused.py``),
    keeping the seven layers as its expansion for backends without the fused kernel."""
    g, count = _Graph(model), 0
    for add in g.candidates("Add"):
        match = _rotary(g, add)
        if match is None:
            continue
        pattern, inputs, split, end = match
        fused = Layer(name=add.name, op_type=ROTARY_HALF[0], inputs=inputs, outputs=[add.outputs[0]],
                      attrs={"split": split, "end": end}, domain=FUSED_DOMAIN, version=ROTARY_HALF[1],
                      expansion=[replace(layer) for layer in pattern])
        g.replace(pattern, add, fused)
        count += 1
    g.commit()
    return count


def _rotary(g: _Graph, add: Layer) -> tuple[list[Layer], list[str], int, int] | None:
    """The layers of a rotate-half embedding ending in ``add`` (graph order), the fused layer's
    inputs and the split and end bounds; None when it is not exactly that pattern."""
    if len(add.inputs) != 2:
        return None
    products = [g.op(n, "Mul") if g.private(n) else None for n in add.inputs]
    if None in products or products[0] is products[1]:
        return None
    for direct, turned in (products, products[::-1]):
        concat = next((g.op(n, "Concat") for n in turned.inputs if g.private(n) and g.op(n, "Concat")), None)
        if concat is None or len(concat.inputs) != 2 or not _last_axis(g, concat.attrs.get("axis"), concat.inputs[1]):
            continue
        sin = g.other(turned, concat.outputs[0])
        neg = g.op(concat.inputs[0], "Neg") if g.private(concat.inputs[0]) else None
        upper = g.op(neg.inputs[0], "Slice") if neg is not None and g.private(neg.inputs[0]) else None
        lower = g.op(concat.inputs[1], "Slice") if g.private(concat.inputs[1]) else None
        if sin is None or upper is None or lower is None or upper.inputs[0] != lower.inputs[0]:
            continue
        x = lower.inputs[0]
        cos = g.other(direct, x)
        high, low = _slice_bounds(g, upper), _slice_bounds(g, lower)
        if cos is None or high is None or low is None or low[0] != 0 or low[1] != high[0]:
            continue
        return [lower, upper, neg, concat, turned, direct, add], [x, cos, sin], high[0], high[1]
    return None


def _slice_bounds(g: _Graph, layer: Layer) -> tuple[int, int] | None:
    """``(start, end)`` of a Slice along the last axis only, step 1, non-negative constant bounds."""
    if layer.version < 10 or not 3 <= len(layer.inputs) <= 5:
        return None
    values = []
    for name in layer.inputs[1:]:
        value = g.model.constants.get(name) if name else None
        if name and (value is None or np.size(value) != 1):
            return None
        values.append(None if value is None else int(np.asarray(value).reshape(-1)[0]))
    start, end = values[0], values[1]
    axis = values[2] if len(values) > 2 else None
    step = values[3] if len(values) > 3 else 1
    if axis is None or not _last_axis(g, axis, layer.inputs[0]) or step not in (None, 1) or start < 0 or end < 0:
        return None
    return start, end


def _last_axis(g: _Graph, axis: object, name: str) -> bool:
    """``axis`` is the last axis of value ``name`` (-1, or rank - 1 when the rank is known)."""
    if axis is None:
        return False
    rank = g.rank(name)
    return int(axis) == -1 or (rank is not None and int(axis) == rank - 1)


def fuse_gemm_reshapes(model: Model) -> int:
    """``Reshape → Gemm → Reshape`` (either Reshape alone too) → ``ReshapedGemm`` (``ops/fused.py``):
    how exporters write a transformer's projections (flatten to two axes, Gemm, restore the axes).
    Runs after ``fuse_activations`` (a Gemm's fused activations stay with it) and keeps the layers
    as the expansion for backends without the fused kernel.

    The Reshape before is taken when the Gemm is the only reader of its result besides ``Shape``
    layers (which keep it: runs of known input shapes skip it, see ``Plan.with_precomputed``); the
    Reshape after, when it is the Gemm's only reader."""
    g, count = _Graph(model), 0
    for gemm in list(model.layers):  # (a Gemm with fused activations is a candidate too)
        if gemm.op_type != "Gemm" or gemm.domain or id(gemm) in g.removed:
            continue
        before = _reshape_feeding(g, gemm)
        after = _reshape_after(g, gemm)
        if before is None and after is None:
            continue
        pattern = [layer for layer in (before, gemm, after) if layer is not None]
        last = pattern[-1]
        inputs = (gemm.inputs + [""])[:3]
        if before is not None:
            inputs[0] = before.inputs[0]
        inputs += [before.inputs[1] if before is not None else "", after.inputs[1] if after is not None else ""]
        attrs = {"transA": int(gemm.attrs.get("transA", 0)), "transB": int(gemm.attrs.get("transB", 0)),
                 "alpha": float(gemm.attrs.get("alpha", 1.0)), "beta": float(gemm.attrs.get("beta", 1.0)),
                 "a_allowzero": int(before.attrs.get("allowzero", 0)) if before is not None else 0,
                 "y_allowzero": int(after.attrs.get("allowzero", 0)) if after is not None else 0}
        expansion = [replace(layer) for layer in pattern]  # the originals: ``replace`` rewrites ``last``
        fused = Layer(name=gemm.name, op_type=RESHAPED_GEMM[0], inputs=inputs, outputs=[last.outputs[0]],
                      attrs=attrs, domain=FUSED_DOMAIN, version=RESHAPED_GEMM[1], fused=list(gemm.fused),
                      expansion=expansion)
        g.replace(_taking(g, pattern, before), last, fused)
        count += 1
    g.commit()
    return count


def _reshape_feeding(g: _Graph, layer: Layer) -> Layer | None:
    """The Reshape making ``layer``'s first input, when nothing but ``layer`` and ``Shape`` layers
    reads it (a fusion then takes it, and leaves it to the Shape layers if there are any)."""
    name = layer.inputs[0] if layer.inputs else ""
    reshape = g.producers.get(name)
    if (reshape is None or id(reshape) in g.removed or reshape.op_type != "Reshape" or reshape.domain
            or reshape.fused or reshape.version < 5 or len(reshape.inputs) != 2 or not reshape.inputs[1]
            or name in g.pinned or layer.inputs.count(name) != 1):
        return None
    if any(r is not layer and r.op_type not in SHAPE_READERS for r in g.consumers.get(name, [])):
        return None
    return reshape


def _taking(g: _Graph, pattern: list[Layer], reshape: Layer | None) -> list[Layer]:
    """``pattern`` without ``reshape`` when Shape layers still read its result (it stays for them:
    runs of known input shapes skip it, see ``Plan.with_precomputed``)."""
    if reshape is None or len(g.consumers.get(reshape.outputs[0], ())) == 1:
        return pattern
    return [layer for layer in pattern if layer is not reshape]


def _reshape_after(g: _Graph, gemm: Layer) -> Layer | None:
    """The Reshape of the Gemm's result, when it is its only reader."""
    if len(gemm.outputs) != 1:
        return None
    reshape = g.only_consumer(gemm.outputs[0], "Reshape")
    if (reshape is None or reshape.version < 5 or len(reshape.inputs) != 2 or not reshape.inputs[1]
            or reshape.inputs[0] != gemm.outputs[0]):
        return None
    return reshape


def fuse_matmul_bias(model: Model) -> int:
    """``Add(MatMul(A, W), bias)`` → ``MatMulBias`` (``ops/fused.py``), ``W`` a 2-D float32 constant
    and ``bias`` a float32 constant row of its width: ``nn.Linear`` on 3-D inputs as exporters
    write it. Runs after ``fuse_activations``: the Add's activations (``Add+Gelu``) go with the
    fused layer, a MatMul with its own is no candidate. The product has no other reader; the
    layers stay as the expansion for backends without the fused kernel."""
    g, count = _Graph(model), 0
    constants = model.constants
    for add in list(model.layers):
        if add.op_type != "Add" or add.domain or id(add) in g.removed or len(add.inputs) != 2:
            continue
        for product, bias in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            matmul = g.op(product, "MatMul")
            w = None if matmul is None else constants.get(matmul.inputs[1])
            b = constants.get(bias)
            if (matmul is None or not g.private(product) or not isinstance(w, np.ndarray) or w.ndim != 2
                    or w.dtype != np.float32 or not isinstance(b, np.ndarray) or b.dtype != np.float32
                    or b.shape != (w.shape[1],) or g.rank(matmul.inputs[0]) in (None, 0, 1)):
                continue
            fused = Layer(name=add.name, op_type=MATMUL_BIAS[0], inputs=[matmul.inputs[0], matmul.inputs[1], bias],
                          outputs=[add.outputs[0]], domain=FUSED_DOMAIN, version=MATMUL_BIAS[1],
                          fused=list(add.fused), expansion=[replace(matmul), replace(add)])
            g.replace([matmul, add], add, fused)
            count += 1
            break
    g.commit()
    return count


def _own_float32_constants(model: Model) -> Callable[[str, int], np.ndarray | None]:
    """A lookup of the float32 constants a join may take (``own(name, ndim)``: the array, or None):
    read by one layer alone, no graph output, not overridable, not memory-mapped from the model's
    file (joined, that would be an anonymous copy held for good)."""
    readers: dict[str, int] = {}
    for layer in model.layers:
        for name in list(layer.inputs) + list(layer.outer_inputs):
            if name:
                readers[name] = readers.get(name, 0) + 1
    keep = {o.name for o in model.outputs} | set(model.input_defaults)

    def own(name: str, ndim: int) -> np.ndarray | None:
        value = model.constants.get(name)
        if (not isinstance(value, np.ndarray) or value.ndim != ndim or value.dtype != np.float32
                or readers.get(name) != 1 or name in keep or is_mapped(value)):
            return None
        return value
    return own


def _split_of_join(first: Layer, names: dict[str, str], siblings: list[Layer], axis: int) -> Layer:
    """The ``Split`` along ``axis`` of a join's result (``names["out"]``, sizes ``names["sizes"]``)
    into the outputs of the layers it joined."""
    return Layer(name=f"{first.name}/joined_split", op_type="Split", inputs=[names["out"], names["sizes"]],
                 outputs=[s.outputs[0] for s in siblings], attrs={"axis": axis}, version=13)


def _put_joins(model: Model, joins: dict[int, list[Layer]], taken: set[int]) -> None:
    """Each join's layers in the place of its first layer (``joins``, by that layer's id); the
    other layers it took (``taken``) dropped."""
    if joins:
        model.layers = [new for layer in model.layers
                        for new in joins.get(id(layer), [] if id(layer) in taken else [layer])]


def fuse_sibling_products(model: Model) -> int:
    """Products of one input by constant weights side by side → one product and a ``Split``:
    ``MatMulBias`` layers (no fused activations) that read the same ``A``, or plain ``MatMul``
    layers that do, each with a 2-D float32 weight of its own (and bias), become one layer of
    that kind on the weights (and biases) concatenated along their width, whose result a
    ``Split`` along the last axis cuts into the layers' outputs (views, no copy). A
    transformer's Q, K and V projections, a gated FFN's gate and up: one larger product keeps
    both cores busy where three small ones each paid a hand-off (a model of just BERT-tiny's
    three 128x128 projections of 128 rows: 123 µs a run, joined 91; BERT-tiny 0.92x in one
    process). Each column is summed over the depth in the same order as before: the same bits
    where every part is whole panels of the GEMM wide, else within rounding (a narrow part may
    have gone to another kernel than the joined product).

    Runs after ``fuse_matmul_bias``. Weights that are overridable inputs, read by another layer
    or graph outputs stay apart, and so do weights memory-mapped from the model's file: joined,
    they would be an anonymous copy held for good beside the packed one the product makes,
    where apart each packed copy stands in for its mapped original, whose pages go back to the
    page cache (`model.mapped`; the Llama block joined was 0.99x). The originals are dropped
    (one copy of the weights). The fused
    layer takes the first product's place (every reader of every part comes after it) and
    keeps ``MatMul`` then ``Add`` as the expansion for backends without ``MatMulBias``."""
    own_constant = _own_float32_constants(model)
    groups: dict[tuple[str, str], list[Layer]] = {}
    for layer in model.layers:
        biased = layer.domain == FUSED_DOMAIN and layer.op_type == MATMUL_BIAS[0]
        if not (biased or (layer.op_type == "MatMul" and not layer.domain)) or layer.fused:
            continue
        if len(layer.inputs) != (3 if biased else 2) or len(layer.outputs) != 1 or not layer.outputs[0]:
            continue
        w = own_constant(layer.inputs[1], 2)
        b = own_constant(layer.inputs[2], 1) if biased else None
        if w is None or (biased and (b is None or b.shape != (w.shape[1],))):
            continue
        groups.setdefault((layer.inputs[0], layer.op_type), []).append(layer)
    taken: set[int] = set()  # every joined product's id
    joins: dict[int, list[Layer]] = {}  # the first product's id: the layers in its place
    used: set[str] | None = None  # the value names taken (once there is a join to name)
    for (x, op_type), siblings in groups.items():
        if len(siblings) < 2:
            continue
        if used is None:
            used = set(model.constants) | set(model.value_info) | {o for layer in model.layers for o in layer.outputs}
        first, biased = siblings[0], op_type == MATMUL_BIAS[0]
        weights = [model.constants[s.inputs[1]] for s in siblings]
        if len({w.shape[0] for w in weights}) != 1:
            continue
        widths = [w.shape[1] for w in weights]
        names = _fresh_names(used, f"{first.name}/joined", ("weight", "bias", "out", "product", "sizes"))
        joined = np.concatenate(weights, axis=1)
        joined.flags.writeable = False  # shared by every run, as every constant
        model.constants[names["weight"]] = joined
        inputs = [x, names["weight"]]
        if biased:
            bias = np.concatenate([model.constants[s.inputs[2]] for s in siblings])
            bias.flags.writeable = False
            model.constants[names["bias"]] = bias
            inputs.append(names["bias"])
        sizes = np.array(widths, np.int64)
        sizes.flags.writeable = False
        model.constants[names["sizes"]] = sizes
        for s in siblings:
            for name in s.inputs[1:]:
                del model.constants[name]
        # typed whatever its input is (a graph input has no value_info): a device backend places
        # only layers whose values' types it knows
        info = model.value_info.get(x) or next((i for i in model.inputs if i.name == x), None)
        shape = tuple(info.shape[:-1]) + (sum(widths),) if info is not None and info.shape else None
        model.value_info[names["out"]] = TensorInfo(names["out"], np.dtype(np.float32), shape)
        if biased:
            matmul, add = first.expansion
            expansion = [replace(matmul, name=f"{first.name}/joined", inputs=[x, names["weight"]],
                                 outputs=[names["product"]]),
                         replace(add, name=f"{first.name}/joined_bias", inputs=[names["product"], names["bias"]],
                                 outputs=[names["out"]])]
        else:
            expansion = []
        product = Layer(name=f"{first.name}/joined", op_type=op_type, inputs=inputs, outputs=[names["out"]],
                        domain=first.domain, version=first.version, expansion=expansion)
        joins[id(first)] = [product, _split_of_join(first, names, siblings, -1)]
        taken.update(id(s) for s in siblings)
    _put_joins(model, joins, taken)
    return len(joins)


def fuse_sibling_convs(model: Model) -> int:
    """1x1 convs of one input side by side → one conv and a ``Split``: 2-D ``Conv`` layers of one
    group, 1x1 windows at unit strides without padding, that read the same input, each with a
    float32 weight of its own (every one a bias of its own, or none), and the same fused
    activation, become one such conv on their weights (and biases) joined along the output
    channels, whose result a ``Split`` along the channels cuts into the layers' outputs (views;
    for one image each is contiguous). Inception's modules start with two or three 1x1 convs of
    the module's input, 64 to 352 channels each: one conv of them all is one layer and one
    hand-off to the helpers where there were three. Each output channel is summed over the input
    channels as before; where the joined conv takes another kernel than a part did, within
    rounding.

    Runs after ``fuse_activations`` (the activation goes with the joined conv) and
    ``fuse_joined_convs`` (a 1x1 conv a Concat joins to a 3x3 one stays there). Weights shared,
    overridable, graph outputs or memory-mapped from the model's file stay apart, as in
    ``fuse_sibling_products``; the originals are dropped (one copy of the weights). Both new
    layers are standard ops, which every backend runs; the joined conv takes the first one's
    place (every reader of every part comes after it)."""
    own_constant = _own_float32_constants(model)
    groups: dict[tuple, list[Layer]] = {}
    for layer in model.layers:
        if (layer.op_type != "Conv" or layer.domain or len(layer.inputs) not in (2, 3) or not all(layer.inputs)
                or len(layer.outputs) != 1 or not layer.outputs[0] or not _pointwise_conv_attrs(layer.attrs)):
            continue
        w = own_constant(layer.inputs[1], 4)
        b = own_constant(layer.inputs[2], 1) if len(layer.inputs) == 3 else None
        if w is None or w.shape[2:] != (1, 1) or (len(layer.inputs) == 3 and (b is None or b.shape != (w.shape[0],))):
            continue
        activation = _activation_key(layer)
        if activation is not None:
            groups.setdefault((layer.inputs[0], len(layer.inputs), w.shape[1], activation), []).append(layer)
    taken: set[int] = set()
    joins: dict[int, list[Layer]] = {}  # the first conv's id: the layers in its place
    used: set[str] | None = None
    for (x, arity, _, _), siblings in groups.items():
        if len(siblings) < 2:
            continue
        if used is None:
            used = set(model.constants) | set(model.value_info) | {o for layer in model.layers for o in layer.outputs}
        first = siblings[0]
        names = _fresh_names(used, f"{first.name}/joined", ("weight", "bias", "out", "sizes"))
        widths = [model.constants[s.inputs[1]].shape[0] for s in siblings]
        inputs = [x]
        for role, index in (("weight", 1), ("bias", 2))[:arity - 1]:
            joined = np.concatenate([model.constants.pop(s.inputs[index]) for s in siblings])
            joined.flags.writeable = False  # shared by every run, as every constant
            model.constants[names[role]] = joined
            inputs.append(names[role])
        sizes = np.array(widths, np.int64)
        sizes.flags.writeable = False
        model.constants[names["sizes"]] = sizes
        info = model.value_info.get(x) or next((i for i in model.inputs if i.name == x), None)
        shape = info.shape if info is not None and info.shape and len(info.shape) == 4 else None
        model.value_info[names["out"]] = TensorInfo(names["out"], np.dtype(np.float32),
                                                    None if shape is None else (shape[0], sum(widths), *shape[2:]))
        conv = replace(first, name=f"{first.name}/joined", inputs=inputs, outputs=[names["out"]],
                       fused=list(first.fused))
        joins[id(first)] = [conv, _split_of_join(first, names, siblings, 1)]
        taken.update(id(s) for s in siblings)
    _put_joins(model, joins, taken)
    return len(joins)


def _pointwise_conv_attrs(attrs: dict) -> bool:
    """Whether a Conv's attributes make it a 1x1 conv of one group at unit strides, no padding."""
    return (int(attrs.get("group", 1)) == 1 and attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID")
            and all(int(v) == 1 for key in ("strides", "dilations") for v in attrs.get(key, ()))
            and all(int(v) == 0 for v in attrs.get("pads", ())) and list(attrs.get("kernel_shape", [1, 1])) == [1, 1])


def _fresh_names(used: set[str], stem: str, roles: Iterable[str]) -> dict[str, str]:
    """A value name per role, ``stem/role``, not in ``used`` (the names taken: constants,
    values, layer outputs), which then holds it."""
    names = {}
    for role in roles:
        name, n = f"{stem}/{role}", 0
        while name in used:
            n += 1
            name = f"{stem}/{role}_{n}"
        used.add(name)
        names[role] = name
    return names


def fuse_add_layer_norm(model: Model) -> int:
    """``LayerNormalization(Add(A, B), scale, bias)`` over the last axis → ``AddLayerNormalization``
    (``ops/normalization.py``): a transformer block's residual sum and the normalisation after
    it, twice a block, one pass over the rows. Where the sum has other readers (a pre-norm
    block's residual stream) it becomes the fused layer's second output. Taken when the Add has
    no fused activations of its own and the LayerNormalization only its first output; runs after
    ``fuse_matmul_bias`` (a projection's bias Add is that fusion's). The two layers stay as the
    expansion, for backends without the fused kernel."""
    g, count = _Graph(model), 0
    order = {id(layer): i for i, layer in enumerate(model.layers)}
    for norm in g.candidates("LayerNormalization"):
        axis = int(norm.attrs.get("axis", -1))
        if len([o for o in norm.outputs if o]) != 1 or (axis != -1 and axis != (g.rank(norm.inputs[0]) or 0) - 1):
            continue
        add = g.op(norm.inputs[0], "Add")
        if add is None or len(add.inputs) != 2 or not all(add.inputs) or len(norm.inputs) < 2 or not norm.inputs[1]:
            continue
        total = add.outputs[0]
        shared = not g.private(total)
        if any(order[id(reader)] < order[id(norm)] for reader in g.consumers.get(total, [])):
            continue  # (a reader before the normalisation: the fused layer, in its place, comes too late)
        outputs = [norm.outputs[0]] + ([total] if shared else [])
        attrs = {"axis": -1, "epsilon": float(norm.attrs.get("epsilon", 1e-5))}
        if "stash_type" in norm.attrs:
            attrs["stash_type"] = int(norm.attrs["stash_type"])
        fused = Layer(name=norm.name, op_type=ADD_LAYER_NORM[0], inputs=[*add.inputs, *norm.inputs[1:]],
                      outputs=outputs, attrs=attrs, domain=FUSED_DOMAIN, version=ADD_LAYER_NORM[1],
                      expansion=[replace(add), replace(norm)])
        g.replace([add, norm], norm, fused)
        count += 1
    g.commit()
    return count


def fuse_squeeze_excite(model: Model) -> int:
    """``Mul(x, act2(Conv(act1(Conv(GlobalAveragePool(x))))))`` → ``SqueezeExcite``
    (``ops/squeeze_excite.py``): the squeeze-and-excitation block of MobileNetV3 (Relu, HardSigmoid) and
    EfficientNet (Swish, Sigmoid). Runs after ``fuse_activations``: the convs' activations stay
    with them in the expansion, which backends without the fused kernel run. The convs are 1x1
    of one group with constant float32 weights and biases, and activations without extra inputs;
    the pool, the convs' results and the gate have no reader outside the block."""
    g, count = _Graph(model), 0
    for mul in list(model.layers):
        if mul.op_type != "Mul" or mul.domain or mul.fused or id(mul) in g.removed or len(mul.inputs) != 2:
            continue
        match = _squeeze_excite(g, mul)
        if match is None:
            continue
        pattern, inputs = match
        expansion = [replace(layer) for layer in pattern]  # the originals: ``replace`` rewrites ``mul``
        fused = Layer(name=mul.name, op_type=SQUEEZE_EXCITE[0], inputs=inputs, outputs=[mul.outputs[0]],
                      domain=FUSED_DOMAIN, version=SQUEEZE_EXCITE[1], expansion=expansion)
        g.replace(pattern, mul, fused)
        count += 1
    g.commit()
    return count


def _squeeze_excite(g: _Graph, mul: Layer) -> tuple[list[Layer], list[str]] | None:
    """The block's layers (pool, convs, ``mul``) and the fused layer's inputs, or None."""
    for x, gate in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        excite = _one_pixel_conv(g, gate)
        squeeze = None if excite is None else _one_pixel_conv(g, excite.inputs[0])
        pool = None if squeeze is None else g.producers.get(squeeze.inputs[0])
        if (pool is None or id(pool) in g.removed or pool.op_type != "GlobalAveragePool" or pool.domain
                or pool.fused or pool.inputs[0] != x or not g.private(pool.outputs[0]) or g.rank(x) != 4):
            continue
        w1, w2 = g.model.constants[squeeze.inputs[1]], g.model.constants[excite.inputs[1]]  # type: ignore[union-attr]
        if w1.shape[1] != w2.shape[0] or w2.shape[1] != w1.shape[0]:
            continue
        bias = lambda conv: conv.inputs[2] if len(conv.inputs) > 2 else ""  # noqa: E731
        return ([pool, squeeze, excite, mul],  # type: ignore[list-item]
                [x, squeeze.inputs[1], bias(squeeze), excite.inputs[1], bias(excite)])  # type: ignore[union-attr]
    return None


def _one_pixel_conv(g: _Graph, name: str) -> Layer | None:
    """The 1x1 Conv making ``name``, when the block owns its result and it is one `SqueezeExcite`
    runs: one group, unit strides and dilations, no padding, constant float32 weights and bias,
    fused activations that take no extra input."""
    conv = g.producers.get(name)
    if (conv is None or id(conv) in g.removed or conv.op_type != "Conv" or conv.domain or not g.private(name)
            or len(conv.inputs) < 2 or len([o for o in conv.outputs if o]) != 1
            or any(len(f.inputs) != 1 for f in conv.fused)):
        return None
    constants = g.model.constants
    w = constants.get(conv.inputs[1])
    b = conv.inputs[2] if len(conv.inputs) > 2 else ""
    if (not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 4 or w.shape[2:] != (1, 1)
            or (b and not (isinstance(constants.get(b), np.ndarray) and constants[b].dtype == np.float32
                           and constants[b].shape == (w.shape[0],)))):
        return None
    attrs = conv.attrs
    if (int(attrs.get("group", 1)) != 1 or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID")
            or any(int(v) != 1 for key in ("strides", "dilations") for v in attrs.get(key, ()))
            or any(int(v) != 0 for v in attrs.get("pads", ())) or list(attrs.get("kernel_shape", [1, 1])) != [1, 1]):
        return None
    return conv


def fuse_channel_shuffles(model: Model) -> int:
    """``Reshape(Transpose(Reshape(Conv(x), shape), perm), shape_after)`` → ``ShuffledConv``
    (``ops/shuffled_conv.py``): ShuffleNet's grouped 1x1 conv and the channel shuffle after it,
    which the conv's GEMM then stores in place (no copy of the map). Runs after
    ``fuse_activations`` (the conv's activations go with the fused layer, in the expansion too)
    and before ``fuse_reshape_transposes`` would take the Reshape and the Transpose.

    Taken when the conv has groups and constant 4-D weights, the Transpose's ``perm`` is the
    shuffle's ``(0, 2, 1, 3, 4)``, both Reshape targets are constants, and each result has no
    other reader; the fused op checks at run time that the targets shuffle the conv's groups
    (else it runs the layers)."""
    g, count = _Graph(model), 0
    for transpose in g.candidates("Transpose"):
        if [int(p) for p in transpose.attrs.get("perm", ())] != [0, 2, 1, 3, 4]:
            continue
        before = _constant_reshape(g, g.producers.get(transpose.inputs[0]))
        conv = None if before is None else g.producers.get(before.inputs[0])
        after = _constant_reshape(g, g.only_consumer(transpose.outputs[0], "Reshape"))
        if (conv is None or after is None or id(conv) in g.removed or conv.op_type != "Conv" or conv.domain
                or len(conv.inputs) < 2 or len([o for o in conv.outputs if o]) != 1
                or int(conv.attrs.get("group", 1)) < 2 or not g.private(conv.outputs[0])
                or not g.private(before.outputs[0])
                or getattr(g.model.constants.get(conv.inputs[1]), "ndim", 0) != 4):
            continue
        pattern = [conv, before, transpose, after]
        attrs = {**conv.attrs, "group": int(conv.attrs.get("group", 1)),
                 "auto_pad": conv.attrs.get("auto_pad", "NOTSET"), "perm": [0, 2, 1, 3, 4],
                 "allowzero": int(before.attrs.get("allowzero", 0)),
                 "allowzero_after": int(after.attrs.get("allowzero", 0))}
        expansion = [replace(layer) for layer in pattern]  # the originals: ``replace`` rewrites ``after``
        fused = Layer(name=conv.name, op_type=SHUFFLED_CONV[0],
                      inputs=(conv.inputs + [""])[:3] + [before.inputs[1], after.inputs[1]], outputs=[after.outputs[0]],
                      attrs=attrs, domain=FUSED_DOMAIN, version=SHUFFLED_CONV[1], fused=list(conv.fused),
                      expansion=expansion)
        g.replace(pattern, after, fused)
        count += 1
    g.commit()
    return count


def _constant_reshape(g: _Graph, layer: Layer | None) -> Layer | None:
    """``layer`` when it is a live Reshape (opset 5 on) of the default domain, nothing fused into
    it, whose target is a constant."""
    if (layer is None or id(layer) in g.removed or layer.op_type != "Reshape" or layer.domain or layer.fused
            or layer.version < 5 or len(layer.inputs) != 2 or layer.inputs[1] not in g.model.constants):
        return None
    return layer


def fuse_residual_adds(model: Model) -> int:
    """``Add(Conv(X, W, B), R)`` (either order; an ``Add`` from opset 7 on, or a ``Sum`` of two) →
    ``ResidualConv`` (``ops/residual_conv.py``): the end of a residual block, the Add's
    activations fused into it already (``fuse_activations``). The conv's result is added to in
    place: one layer, no map of its own for the sum. Taken when the conv has no activations of its
    own, one output, and the Add is the only reader of it; the two stay as the expansion, for
    backends without the kernel. Runs after ``fuse_joined_convs`` and ``fuse_sibling_convs``,
    whose convs it would otherwise take."""
    g, count = _Graph(model), 0
    for add in list(model.layers):
        if (id(add) in g.removed or add.domain or len(add.inputs) != 2 or not all(add.inputs)
                or len([o for o in add.outputs if o]) != 1
                or not ((add.op_type == "Add" and add.version >= 7) or add.op_type == "Sum")):
            continue
        for conv_first, (name, residual) in ((True, add.inputs), (False, add.inputs[::-1])):
            conv = g.producers.get(name)
            if (conv is not None and id(conv) not in g.removed and conv.op_type == "Conv" and not conv.domain
                    and not conv.fused and len(conv.inputs) >= 2 and len([o for o in conv.outputs if o]) == 1
                    and g.private(name) and residual != name):
                break
        else:
            continue
        pattern = [conv, add]
        attrs = {**conv.attrs, "group": int(conv.attrs.get("group", 1)),
                 "auto_pad": conv.attrs.get("auto_pad", "NOTSET"), "conv_first": int(conv_first)}
        fused = Layer(name=add.name, op_type=RESIDUAL_CONV[0], inputs=(conv.inputs + [""])[:3] + [residual],
                      outputs=[add.outputs[0]], attrs=attrs, domain=FUSED_DOMAIN, version=RESIDUAL_CONV[1],
                      fused=list(add.fused), expansion=[replace(layer) for layer in pattern])
        g.replace(pattern, add, fused)
        count += 1
    g.commit()
    return count


def fuse_conv_max_pools(model: Model) -> int:
    """``MaxPool(Conv(X, W, B))`` → ``ConvMaxPool`` (``ops/conv_pool.py``): a network's 3x3 stem
    and the 3x3/2 pool after it (SqueezeNet, ShuffleNet), whose 3 MB map then stays in the core's
    L2 under concurrent requests. Runs after ``fuse_activations`` (the Relu between them, a folded
    BatchNormalization's too, is the conv's). Taken when the pool is a 3x3/2 window with one
    output and nothing fused after it, and the conv's weight a constant float32 4-D one of at
    most `conv_direct.MAX_CHANNELS` input channels and `conv_pool.MAX_TAPS` taps (7x7 stems
    measured slower fused), its only reader the pool; the fused op checks the rest at run time
    (the kernels the two would take) and else runs the two, its expansion (for backends without
    the kernel too)."""
    g, count = _Graph(model), 0
    for pool in g.candidates("MaxPool"):
        if not _three_by_two_max_pool(pool):
            continue
        conv = g.producers.get(pool.inputs[0])
        if (conv is None or id(conv) in g.removed or conv.op_type != "Conv" or conv.domain or len(conv.inputs) < 2
                or len([o for o in conv.outputs if o]) != 1 or not g.private(pool.inputs[0])
                or _activation_key(conv) is None):
            continue
        weight = model.constants.get(conv.inputs[1])
        if (not isinstance(weight, np.ndarray) or weight.dtype != np.float32 or weight.ndim != 4
                or weight.shape[1] > DIRECT_MAX_CHANNELS or math.prod(weight.shape[1:]) > CONV_POOL_MAX_TAPS
                or int(conv.attrs.get("group", 1)) != 1):
            continue
        pattern = [conv, pool]
        expansion = [replace(layer) for layer in pattern]
        fused = Layer(name=pool.name, op_type=CONV_MAX_POOL[0], inputs=list(conv.inputs), outputs=[pool.outputs[0]],
                      attrs={**conv.attrs, "group": int(conv.attrs.get("group", 1)),
                             "auto_pad": conv.attrs.get("auto_pad", "NOTSET")},
                      domain=FUSED_DOMAIN, version=CONV_MAX_POOL[1], fused=list(conv.fused),
                      expansion=expansion)
        g.replace(pattern, pool, fused)
        count += 1
    g.commit()
    return count


def fuse_expand_depthwise(model: Model) -> int:
    """``Conv_dw(Conv_1x1(X, W1, B1), W2, B2)`` → ``ExpandDepthwise`` (``ops/expand_depthwise.py``):
    an inverted residual block's 1x1 expansion and the depthwise conv that alone reads its wide
    map, each with its fused activations (the 1x1's kept in the expansion), run as one layer that
    keeps the wide map channels last in the cache. Runs after ``fuse_activations`` and the other
    conv fusions (a 1x1 conv they took is not taken). Taken when both weights are constant
    float32 4-D ones, the first 1x1 of one group and the second one input channel a group for
    each of its output channels (M, 1, kh, kw), their biases constant float32 or absent, and the
    1x1 reads enough input channels for the window (`expand_depthwise.joins`; the extra inputs of
    its activations, a ReLU6's Clip bounds, follow the layer's five); the fused op checks the rest at run time (strides,
    pads, the epilogue) and else runs the two layers, its expansion (for other backends too)."""
    g, count = _Graph(model), 0
    constants = model.constants
    for dw in list(model.layers):
        if (id(dw) in g.removed or dw.op_type != "Conv" or dw.domain or len(dw.inputs) < 2 or not dw.inputs[0]
                or len([o for o in dw.outputs if o]) != 1 or not g.private(dw.inputs[0])):
            continue
        expand = g.producers.get(dw.inputs[0])
        if (expand is None or id(expand) in g.removed or expand.op_type != "Conv" or expand.domain
                or len(expand.inputs) < 2 or len([o for o in expand.outputs if o]) != 1):
            continue
        w1, w2 = constants.get(expand.inputs[1]), constants.get(dw.inputs[1])
        if (not isinstance(w1, np.ndarray) or not isinstance(w2, np.ndarray) or w1.dtype != np.float32
                or w2.dtype != np.float32 or w1.ndim != 4 or w2.ndim != 4 or w1.shape[2:] != (1, 1)
                or int(expand.attrs.get("group", 1)) != 1 or w2.shape[:2] != (w1.shape[0], 1)
                or int(dw.attrs.get("group", 1)) != w1.shape[0]
                or not joins_expand_depthwise(w1.shape[1], w2.shape[2:], tuple(dw.attrs.get("strides", (1, 1))))):
            continue
        biases = [layer.inputs[2] if len(layer.inputs) > 2 else "" for layer in (expand, dw)]
        if any(b and not (isinstance(constants.get(b), np.ndarray) and constants[b].dtype == np.float32
                          and constants[b].shape == (w1.shape[0],)) for b in biases):
            continue
        pattern = [expand, dw]
        expansion = [replace(layer) for layer in pattern]  # the originals: ``replace`` rewrites ``dw``
        fused = Layer(name=dw.name, op_type=EXPAND_DEPTHWISE[0],
                      inputs=[expand.inputs[0], expand.inputs[1], biases[0], dw.inputs[1], biases[1],
                              *(name for f in expand.fused for name in f.inputs[1:])],
                      outputs=[dw.outputs[0]], domain=FUSED_DOMAIN, version=EXPAND_DEPTHWISE[1],
                      fused=list(dw.fused), expansion=expansion)
        g.replace(pattern, dw, fused)
        count += 1
    g.commit()
    return count


def _three_by_two_max_pool(pool: Layer) -> bool:
    """Whether ``pool`` (a MaxPool) is a 3x3/2 window of one output (no indices)."""
    return not (len([o for o in pool.outputs if o]) != 1 or len(pool.outputs) > 1 and pool.outputs[1]
                or [int(k) for k in pool.attrs.get("kernel_shape", ())] != [3, 3]
                or [int(s) for s in pool.attrs.get("strides", ())] != [2, 2]
                or any(int(d) != 1 for d in pool.attrs.get("dilations", ())))


def fuse_joined_conv_max_pools(model: Model) -> int:
    """``MaxPool(JoinedConv(X, …))`` → ``JoinedConvMaxPool`` (``ops/conv_pool.py``): SqueezeNet
    1.1's fire modules before its pools, whose 1.5 and 0.75 MB maps then stay in the core's L2
    wherever the joined conv runs on one thread. Runs after ``fuse_joined_convs``; taken when the
    pool is a 3x3/2 window with one output and nothing fused after it, and the joined convs'
    result is read by the pool alone. Its expansion is the joined convs' layers, then the pool's
    (for backends without the kernel); the fused op checks the rest at run time (the kernels the
    two would take) and else runs the two."""
    g, count = _Graph(model), 0
    for pool in g.candidates("MaxPool"):
        if not _three_by_two_max_pool(pool):
            continue
        joined = g.producers.get(pool.inputs[0])
        if (joined is None or id(joined) in g.removed or joined.domain != FUSED_DOMAIN
                or joined.op_type != JOINED_CONV[0] or joined.fused or not g.private(pool.inputs[0])):
            continue
        fused = Layer(name=pool.name, op_type=JOINED_CONV_MAX_POOL[0], inputs=list(joined.inputs),
                      outputs=[pool.outputs[0]], domain=FUSED_DOMAIN, version=JOINED_CONV_MAX_POOL[1],
                      expansion=[*joined.expansion, replace(pool)])
        g.replace([joined, pool], pool, fused)
        count += 1
    g.commit()
    return count


def fuse_joined_convs(model: Model) -> int:
    """``Concat(Conv(X, W_1, B_1), …, Conv(X, W_k, B_k), axis=1)`` → ``JoinedConv``
    (``ops/joined_conv.py``): convs of one input whose results only the Concat reads, SqueezeNet's
    1x1 and 3x3 expand layers, computed as one conv (no Concat copy, one hand-off to the helpers).
    Runs after ``fuse_activations``: each conv keeps its activations, in the expansion too (the
    convs and the Concat, for backends without the kernel). Taken when every conv is 2-D, of one
    group, with constant float32 weights (biases constant or absent), one at least with a window
    larger than 1x1 (1x1 convs alone are ``fuse_sibling_convs``'), every conv's channels but the
    last's fill whole panels of the kernel (`conv_direct.PANEL_WIDTH`), and they share one
    activation that takes no extra input; the fused op checks the rest at run time (the strides,
    the output maps, the kernel the deepest conv would take) and else runs the layers."""
    g, count = _Graph(model), 0
    constants = model.constants
    for concat in g.candidates("Concat"):
        axis = int(concat.attrs.get("axis", 0))
        if len(concat.inputs) < 2 or not (axis == 1 or (axis == -3 and g.rank(concat.outputs[0]) == 4)):
            continue
        convs = [g.producers.get(name) for name in concat.inputs]
        if any(conv is None or id(conv) in g.removed or conv.op_type != "Conv" or conv.domain
               or len(conv.inputs) < 2 or len([o for o in conv.outputs if o]) != 1 or not g.private(name)
               for conv, name in zip(convs, concat.inputs)):
            continue
        if len({id(conv) for conv in convs}) != len(convs) or len({conv.inputs[0] for conv in convs}) != 1:
            continue
        weights = [constants.get(conv.inputs[1]) for conv in convs]
        biases = [conv.inputs[2] if len(conv.inputs) > 2 else "" for conv in convs]
        if (any(not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 4 for w in weights)
                or all(w.shape[2:] == (1, 1) for w in weights)  # (1x1 convs: `fuse_sibling_convs`)
                or len({w.shape[1] for w in weights}) != 1
                or any(m % PANEL_WIDTH for m in [w.shape[0] for w in weights][:-1])
                or any(int(conv.attrs.get("group", 1)) != 1 for conv in convs)
                or any(b and not (isinstance(constants.get(b), np.ndarray) and constants[b].dtype == np.float32
                                  and constants[b].shape == (w.shape[0],)) for b, w in zip(biases, weights))
                or len({_activation_key(conv) for conv in convs}) != 1 or _activation_key(convs[0]) is None):
            continue
        pattern = [*convs, concat]
        expansion = [replace(layer) for layer in pattern]  # the originals: ``replace`` rewrites ``concat``
        inputs = [convs[0].inputs[0]] + [name for conv, b in zip(convs, biases) for name in (conv.inputs[1], b)]
        fused = Layer(name=concat.name, op_type=JOINED_CONV[0], inputs=inputs, outputs=[concat.outputs[0]],
                      domain=FUSED_DOMAIN, version=JOINED_CONV[1], expansion=expansion)
        g.replace(pattern, concat, fused)
        count += 1
    g.commit()
    return count


def _activation_key(conv: Layer) -> tuple | None:
    """What a conv's fused activations are, comparable between convs (op types and attributes);
    None where one takes an extra input (a Clip's bounds as inputs)."""
    if any(len(f.inputs) != 1 for f in conv.fused):
        return None
    return tuple((f.op_type, f.domain, f.version, repr(sorted(f.attrs.items()))) for f in conv.fused)


def fuse_reshape_transposes(model: Model) -> int:
    """``Transpose(Reshape(x, shape))`` → ``ReshapeTranspose`` (``ops/fused.py``): the head split of
    exported attention, for each of Q, K and V. Runs after ``fuse_attention`` (whose pattern
    starts at the Transpose of K) and keeps the layers as the expansion. The Reshape is taken
    when the Transpose is the only reader of its result besides ``Shape`` layers (which keep it).
    A KV cache's ``Concat(past, heads)`` that is the only reader of the result goes in too (see
    `_cache_append`)."""
    g, count = _Graph(model), 0
    for transpose in g.candidates("Transpose"):
        reshape = _reshape_feeding(g, transpose)
        if reshape is None:
            continue
        attrs: dict[str, object] = {"allowzero": int(reshape.attrs.get("allowzero", 0))}
        if "perm" in transpose.attrs:
            attrs["perm"] = [int(p) for p in transpose.attrs["perm"]]
        pattern, inputs = [reshape, transpose], list(reshape.inputs)
        concat = _cache_append(g, transpose.outputs[0])
        if concat is not None:
            pattern.append(concat)
            inputs.append(concat.inputs[0])
            attrs["append_axis"] = int(concat.attrs.get("axis", 0))
        fused = Layer(name=transpose.name, op_type=RESHAPE_TRANSPOSE[0], inputs=inputs,
                      outputs=[pattern[-1].outputs[0]], attrs=attrs, domain=FUSED_DOMAIN,
                      version=RESHAPE_TRANSPOSE[1], expansion=[replace(layer) for layer in pattern])
        g.replace(_taking(g, pattern, reshape), pattern[-1], fused)
        count += 1
    g.commit()
    return count


def _cache_append(g: _Graph, name: str) -> Layer | None:
    """The ``Concat(past, name)`` growing a KV cache (a graph input, into a graph output: what
    ``optimize.mark_cache_appends`` marks) when it is the only reader of ``name``."""
    concat = g.only_consumer(name, "Concat")
    graph_inputs = {i.name for i in g.model.inputs}
    graph_outputs = {o.name for o in g.model.outputs}
    if (concat is None or "axis" not in concat.attrs or concat.inputs[1:] != [name]
            or concat.inputs[0] not in graph_inputs or concat.outputs[0] not in graph_outputs):
        return None
    return concat


def fuse_split_heads(model: Model) -> int:
    """``Split`` whose every part is read by a ``ReshapeTranspose`` alone → ``SplitHeads``
    (``ops/fused.py``): GPT-2-style attention's fused Q/K/V projection split into Q, K and V heads
    (K and V appended to their caches), six layers of a block in one. Runs after
    ``fuse_reshape_transposes`` and keeps the Split and the ReshapeTransposes as the expansion.

    Taken when each part's Transpose has an explicit ``perm`` of one rank, and the fused layer,
    in the place of the pattern's last layer, still comes before every reader of its outputs.
    ``Shape`` layers may read the parts too: the Split then stays for them."""
    g, count = _Graph(model), 0
    order = {id(layer): i for i, layer in enumerate(model.layers)}
    for split in g.candidates("Split"):
        parts = [_heads_reading(g, name) for name in split.outputs]
        if not 1 <= len(parts) <= SPLIT_HEADS_PARTS or any(p is None for p in parts):
            continue
        heads: list[Layer] = parts  # type: ignore[assignment]
        perms = [h.attrs.get("perm") for h in heads]
        if any(p is None or len(p) != len(perms[0]) for p in perms):  # type: ignore[arg-type]
            continue
        pattern = [split, *heads]
        last = max(pattern, key=lambda layer: order[id(layer)])
        if any(order[id(reader)] <= order[id(last)] for h in heads for reader in g.consumers.get(h.outputs[0], [])):
            continue  # (a reader between the parts: the fused layer would come after it)
        pasts = [(h.inputs + ["", ""])[2] for h in heads]
        fill = [""] * (SPLIT_HEADS_PARTS - len(heads))
        inputs = [split.inputs[0], (split.inputs + [""])[1],
                  *[h.inputs[1] for h in heads], *fill, *pasts, *fill]
        while inputs[-1] == "":
            inputs.pop()
        rank = len(perms[0])  # type: ignore[arg-type]
        attrs: dict[str, object] = {"axis": int(split.attrs.get("axis", 0)), "perm_rank": rank,
                                    "perms": [int(p) for perm in perms for p in perm],  # type: ignore[union-attr]
                                    "allowzero": [int(h.attrs.get("allowzero", 0)) for h in heads],
                                    "append_axes": [int(h.attrs.get("append_axis", 0)) for h in heads]}
        if split.version < 13 and "split" in split.attrs:
            attrs["split"] = [int(s) for s in split.attrs["split"]]
        # A Split whose parts Shape layers read stays for them (runs of known shapes skip it, see
        # ``Plan.with_precomputed``); the fused layer takes a ReshapeTranspose's place (the last),
        # under a name of its own then (a profile names each layer by its name).
        shape_read = any(len(g.consumers.get(name, ())) > 1 for name in split.outputs)
        fused = Layer(name=f"{split.name}/heads" if shape_read else split.name, op_type=SPLIT_HEADS[0],
                      inputs=inputs, outputs=[h.outputs[0] for h in heads],
                      attrs=attrs, domain=FUSED_DOMAIN, version=SPLIT_HEADS[1],
                      expansion=[replace(layer) for layer in sorted(pattern, key=lambda layer: order[id(layer)])])
        g.replace(heads if shape_read else pattern, last, fused)
        count += 1
    g.commit()
    return count


def _heads_reading(g: _Graph, name: str) -> Layer | None:
    """The ``ReshapeTranspose`` that alone reads ``name`` (as its data), ``Shape`` layers aside."""
    users = [u for u in g.consumers.get(name, []) if u.op_type not in SHAPE_READERS]
    if not name or name in g.pinned or len(users) != 1:
        return None
    layer = users[0]
    if (id(layer) in g.removed or layer.domain != FUSED_DOMAIN or layer.op_type != RESHAPE_TRANSPOSE[0]
            or layer.inputs[0] != name or layer.inputs[1:].count(name)):
        return None
    return layer


#: The fusions, in the order ``optimize`` runs them (before ``fuse_activations``).
PATTERN_PASSES: list[tuple[str, Callable[[Model], int]]] = [
    ("fuse_gelu", fuse_gelu),
    ("fuse_layer_norm", fuse_layer_norm),
    ("fuse_rms_norm", fuse_rms_norm),
    ("fuse_silu", fuse_silu),
    ("fuse_magnitude", fuse_magnitude),
    ("fuse_attention", fuse_attention),
    ("fuse_rotary", fuse_rotary),
]
