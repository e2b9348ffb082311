"""``ai.onnx.preview.training::Gradient``: reverse-mode differentiation of part of the graph.

The importer gives each Gradient layer its forward graph (`asyncinfer.model.gradient_graph`): the
nodes computing ``y`` from ``xs`` and ``zs``. A run evaluates it on the layer's inputs, keeping
every value, then walks it backwards applying each op's vector-Jacobian product (`RULES`), from
``dy = 1`` everywhere: for a ``y`` with more than one element the outputs are the gradients of the
sum of its elements (the vector-Jacobian product with ones, as ORT's training and PyTorch's
``backward(ones)`` define it). Outputs are in the dtype of their x.

Differentiable ops (their default-domain versions): Add, Sub, Mul, Div, Pow, Neg, Abs, Sqrt, Exp,
Log, Relu, Sigmoid, Tanh, Identity, Sum, MatMul, Gemm, ReduceSum, ReduceMean, Reshape, Flatten,
Squeeze, Unsqueeze and Transpose, with broadcasting reduced back to each input's shape. Shape and
Size cut the path (their outputs are integers). Any other op on a path from an x to y is refused
at load with UnsupportedOperatorError naming it; ops that only read ``zs`` and constants run
forward whatever they are. Only first-order gradients are computed (a Gradient of a Gradient's
output is refused).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..model.gradient_graph import FORWARD, FORWARD_OPSETS, TRAINING_DOMAIN
from .base import Op
from .controlflow import Subgraph
from .registry import register
from .shape import op_error

Array = np.ndarray
#: ``rule(op, inputs, output, dy)``: the gradient of each input (None: not differentiated).
Rule = Callable[[Op, Sequence[Any], Array, Array], list[Any]]


def unbroadcast(g: Array, shape: Sequence[int]) -> Array:
    """``g`` summed over the axes NumPy broadcasting added or stretched to reach it from ``shape``."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    stretched = tuple(i for i, d in enumerate(shape) if d == 1 and g.shape[i] != 1)
    return (g.sum(axis=stretched, keepdims=True) if stretched else g).reshape(shape)


def _binary(fn: Callable[[Array, Array, Array, Array], tuple[Any, Any]]) -> Rule:
    """A rule for a broadcasting two-input op: ``fn(a, b, y, dy)`` before the broadcast is undone."""
    def rule(op: Op, inputs: Sequence[Any], y: Array, dy: Array) -> list[Any]:
        a, b = inputs[0], inputs[1]
        da, db = fn(a, b, y, dy)
        return [None if da is None else unbroadcast(np.asarray(da), np.shape(a)),
                None if db is None else unbroadcast(np.asarray(db), np.shape(b))]
    return rule


def _unary(fn: Callable[[Array, Array, Array], Any]) -> Rule:
    """A rule for a one-input op (extra inputs, such as a shape, get no gradient): ``fn(x, y, dy)``."""
    def rule(op: Op, inputs: Sequence[Any], y: Array, dy: Array) -> list[Any]:
        return [fn(inputs[0], y, dy)] + [None] * (len(inputs) - 1)
    return rule


def _pow(a: Array, b: Array, y: Array, dy: Array) -> tuple[Any, Any]:
    da = dy * b * np.power(a, b - 1) if b.dtype.kind == "f" else dy * b.astype(a.dtype) * np.power(a, b - 1)
    db = dy * y * np.log(a) if b.dtype.kind == "f" else None  # an integer exponent is not differentiated
    return da, db


def _matmul(op: Op, inputs: Sequence[Any], y: Array, dy: Array) -> list[Any]:
    a, b = inputs
    a2 = a[np.newaxis] if a.ndim == 1 else a  # NumPy's 1-D promotions, undone at the end
    b2 = b[:, np.newaxis] if b.ndim == 1 else b
    g = dy.reshape(np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + (a2.shape[-2], b2.shape[-1]))
    da = unbroadcast(np.matmul(g, np.swapaxes(b2, -1, -2)), a2.shape).reshape(a.shape)
    db = unbroadcast(np.matmul(np.swapaxes(a2, -1, -2), g), b2.shape).reshape(b.shape)
    return [da, db]


def _gemm(op: Op, inputs: Sequence[Any], y: Array, dy: Array) -> list[Any]:
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    ta, tb = bool(op.attr("transA")), bool(op.attr("transB"))
    alpha, beta = op.attr("alpha"), op.attr("beta")
    a_op, b_op = (a.T if ta else a), (b.T if tb else b)
    da = alpha * (dy @ b_op.T)
    db = alpha * (a_op.T @ dy)
    grads = [da.T if ta else da, db.T if tb else db]
    return grads + ([] if c is None else [unbroadcast(beta * dy, c.shape)])


def _reduce(mean: bool) -> Rule:
    def rule(op: Op, inputs: Sequence[Any], y: Array, dy: Array) -> list[Any]:
        x = inputs[0]
        axes = op.reduced_axes(x.ndim, inputs[1] if len(inputs) > 1 else None)  # type: ignore[attr-defined]
        if axes is None:  # noop_with_empty_axes: the identity
            return [dy] + [None] * (len(inputs) - 1)
        kept = dy if op.attr("keepdims") else np.expand_dims(dy, axes)
        dx = np.broadcast_to(kept, x.shape)
        if mean:
            dx = dx / max(int(np.prod([x.shape[a] for a in axes])), 1)
        return [np.array(dx)] + [None] * (len(inputs) - 1)
    return rule


def _transpose(op: Op, inputs: Sequence[Any], y: Array, dy: Array) -> list[Any]:
    perm = op.attr("perm", None) or list(range(inputs[0].ndim))[::-1]
    return [np.transpose(dy, np.argsort(perm))]


def _sum(op: Op, inputs: Sequence[Any], y: Array, dy: Array) -> list[Any]:
    return [unbroadcast(dy, np.shape(x)) for x in inputs]


_RESHAPE = _unary(lambda x, y, dy: dy.reshape(x.shape))

#: The vector-Jacobian product of each differentiable op (default domain, every version).
RULES: dict[str, Rule] = {
    "Add": _binary(lambda a, b, y, dy: (dy, dy)),
    "Sub": _binary(lambda a, b, y, dy: (dy, -dy)),
    "Mul": _binary(lambda a, b, y, dy: (dy * b, dy * a)),
    "Div": _binary(lambda a, b, y, dy: (dy / b, -dy * a / (b * b))),
    "Pow": _binary(_pow),
    "Neg": _unary(lambda x, y, dy: -dy),
    "Abs": _unary(lambda x, y, dy: dy * np.sign(x)),
    "Sqrt": _unary(lambda x, y, dy: dy / (2 * y)),
    "Exp": _unary(lambda x, y, dy: dy * y),
    "Log": _unary(lambda x, y, dy: dy / x),
    "Relu": _unary(lambda x, y, dy: dy * (x > 0)),
    "Sigmoid": _unary(lambda x, y, dy: dy * y * (1 - y)),
    "Tanh": _unary(lambda x, y, dy: dy * (1 - y * y)),
    "Identity": _unary(lambda x, y, dy: dy),
    "Sum": _sum,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "ReduceSum": _reduce(mean=False),
    "ReduceMean": _reduce(mean=True),
    "Reshape": _RESHAPE,
    "Flatten": _RESHAPE,
    "Squeeze": _RESHAPE,
    "Unsqueeze": _RESHAPE,
    "Transpose": _transpose,
}
#: Ops whose outputs are integers: they cut a path from an x (no gradient flows through them).
CUTS = frozenset({"Shape", "Size"})


@register("Gradient", versions=(1,), domain=TRAINING_DOMAIN)
class Gradient(Op):
    """The gradient of ``y`` with respect to each of ``xs`` (see the module)."""

    def check(self) -> None:
        if FORWARD not in self.attrs:
            self.unsupported("a Gradient layer without the forward graph the importer gives it")
        self.forward = Subgraph(self, FORWARD, self.attrs.get(FORWARD_OPSETS))
        self.xs = [str(x) for x in self.attr("xs")]
        self.y = str(self.attr("y"))
        depends = set(self.xs)
        self.path: list[int] = []  # steps on a path from an x to y, in order
        refused = []
        for index, (layer, _) in enumerate(self.forward.steps):
            if layer.op_type in CUTS or not any(n in depends for n in layer.inputs if n):
                continue
            if layer.domain or layer.op_type not in RULES or layer.fused:
                refused.append(f"{layer.op_type} ({layer.name})")
                continue
            if layer.version < 7 and layer.attrs.get("broadcast") and layer.attrs.get("axis") is not None:
                refused.append(f"{layer.op_type} with the legacy broadcast attribute ({layer.name})")
                continue
            self.path.append(index)
            depends.update(o for o in layer.outputs if o)
        if refused:
            self.unsupported(f"differentiating {', '.join(refused)} (differentiable ops: {', '.join(sorted(RULES))})")
        self.depends = depends

    def run(self, *args: Any) -> tuple[Any, ...]:
        n_outer = len(self.layer.outer_inputs)
        declared = args[:len(args) - n_outer]
        if len(declared) != len(self.forward.input_names):
            raise op_error(self, f"{len(declared)} inputs for the {len(self.forward.input_names)} values of xs and zs")
        values: dict[str, Any] = dict(zip(self.layer.outer_inputs, args[len(args) - n_outer:]))
        values.update(self.forward.constants)
        values.update(zip(self.forward.input_names, declared))
        for x in self.xs:
            if np.asarray(values[x]).dtype.kind != "f":
                raise op_error(self, f"x {x!r} is {np.asarray(values[x]).dtype}: only floating-point values "
                                     "are differentiated")
        for layer, kernel in self.forward.steps:
            results = kernel(*[values[name] if name else None for name in layer.inputs])
            values.update((name, value) for name, value in zip(layer.outputs, results) if name)
        return tuple(self._backward(values)[: len(self.layer.outputs)])

    def _backward(self, values: dict[str, Any]) -> list[Array]:
        y = np.asarray(values[self.y])
        grads: dict[str, Array] = {}
        if self.y in self.depends:
            if y.dtype.kind != "f":
                raise op_error(self, f"y {self.y!r} is {y.dtype}: only a floating-point y is differentiated")
            grads[self.y] = np.ones_like(y)
        for index in reversed(self.path):
            layer, kernel = self.forward.steps[index]
            dy = grads.get(layer.outputs[0])
            if dy is None:  # this value does not reach y
                continue
            inputs = [values[n] if n else None for n in layer.inputs]
            for name, g in zip(layer.inputs, RULES[layer.op_type](kernel, inputs, values[layer.outputs[0]], dy)):
                if g is None or name not in self.depends:
                    continue
                g = np.asarray(g, dtype=np.asarray(values[name]).dtype)
                grads[name] = grads[name] + g if name in grads else g
        return [grads[x] if x in grads else np.zeros_like(values[x]) for x in self.xs]
