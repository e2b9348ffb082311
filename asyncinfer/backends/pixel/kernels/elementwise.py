"""Element-wise kernels: unary math and activations, binary and variadic arithmetic with NumPy
broadcasting, comparisons, logic, Where and Clip.

Every expression is written once in GLSL over ``x`` (and ``a``, ``b``...) with functions that
exist both for ``float`` and ``vec4`` (GLSL's own, or the helpers of ``shader.py``), so the same text serves the ``vec4`` fast path (all inputs
share the output's shape and layout: one texel in, one texel out) and the broadcasting path
(one element at a time through ``*_at``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..layout import natural_layout
from .base import PixelKernel, broadcast_index, glsl_float, pixel_kernel

Template = Callable[[Mapping[str, Any]], str]


def _attrs(text: str, **defaults: float) -> Template:
    """A unary template with ``{name}`` placeholders filled from the layer's float attributes."""
    return lambda attrs: text.format(**{k: glsl_float(attrs.get(k, v)) for k, v in defaults.items()})


_SELU = dict(alpha=1.67326319217681884765625, gamma=1.05070102214813232421875)

#: Unary ops as GLSL expressions of ``x``; also what fused activations are drawn with.
UNARY: dict[str, Template] = {
    "Relu": _attrs("relu(x)"),
    "Neg": _attrs("-x"),
    "Abs": _attrs("abs(x)"),
    "Exp": _attrs("exp(x)"),
    "Log": _attrs("log(x)"),
    "Sqrt": _attrs("sqrt(x)"),
    "Reciprocal": _attrs("1.0 / x"),
    "Floor": _attrs("floor(x)"),
    "Ceil": _attrs("ceil(x)"),
    "Round": _attrs("roundEven(x)"),
    "Sign": _attrs("sign(x)"),
    "Sin": _attrs("sin(x)"),
    "Cos": _attrs("cos(x)"),
    "Tan": _attrs("tan(x)"),
    "Sinh": _attrs("0.5 * (exp(x) - exp(-x))"),
    "Cosh": _attrs("0.5 * (exp(x) + exp(-x))"),
    "Atan": _attrs("atan(x)"),
    "Asin": _attrs("asin(x)"),
    "Acos": _attrs("acos(x)"),
    "Erf": _attrs("erf_(x)"),
    "Sigmoid": _attrs("1.0 / (1.0 + exp(-x))"),
    "Tanh": _attrs("tanh_(x)"),
    "Softplus": _attrs("softplus(x)"),
    "Softsign": _attrs("x / (1.0 + abs(x))"),
    "Mish": _attrs("x * tanh_(softplus(x))"),
    "HardSigmoid": _attrs("clamp({alpha} * x + {beta}, 0.0, 1.0)", alpha=0.2, beta=0.5),
    "HardSwish": _attrs("x * clamp(x / 6.0 + 0.5, 0.0, 1.0)"),
    "LeakyRelu": _attrs("pick(ge(x, x * 0.0), x, {alpha} * x)", alpha=0.01),
    "Elu": _attrs("pick(gt(x, x * 0.0), x, {alpha} * (exp(x) - 1.0))", alpha=1.0),
    "Selu": _attrs("{gamma} * pick(gt(x, x * 0.0), x, {alpha} * (exp(x) - 1.0))", **_SELU),
    "Celu": _attrs("max(x, 0.0) + min(x * 0.0, {alpha} * (exp(x / {alpha}) - 1.0))", alpha=1.0),
    "ThresholdedRelu": _attrs("pick(gt(x, x * 0.0 + {alpha}), x, x * 0.0)", alpha=1.0),
    "Gelu": lambda attrs: ("0.5 * x * (1.0 + tanh_(0.7978845608028654 * (x + 0.044715 * x * x * x)))"
                           if attrs.get("approximate", "none") == "tanh" else
                           "0.5 * x * (1.0 + erf_(x * 0.7071067811865476))"),
    "IsNaN": _attrs("is_nan(x)"),
    "Not": _attrs("1.0 - x"),
}

BINARY: dict[str, str] = {
    "Add": "a + b", "Sub": "a - b", "Mul": "a * b", "Div": "a / b", "Pow": "pow_(a, b)",
    "Max": "max(a, b)", "Min": "min(a, b)", "PRelu": "pick(ge(a, a * 0.0), a, a * b)",
    "Equal": "eq(a, b)", "Less": "lt(a, b)", "LessOrEqual": "le(a, b)", "Greater": "gt(a, b)",
    "GreaterOrEqual": "ge(a, b)", "And": "a * b", "Or": "max(a, b)", "Xor": "abs(a - b)",
}
_COMPARISONS = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"}
_LOGIC = {"And", "Or", "Xor", "Not"}


def activation_chain(activations: list, var: str = "v") -> str:
    """The GLSL of a layer's fused activations (``(op, constant extra inputs)`` pairs, in order)
    applied to the vec4 ``var``."""
    expression = var
    for op, extras in activations:
        if op.layer.op_type == "Clip":
            low = extras[0] if extras and extras[0] is not None else op.attrs.get("min", -math.inf)
            high = extras[1] if len(extras) > 1 and extras[1] is not None else op.attrs.get("max", math.inf)
            template = f"min(max(x, {glsl_float(float(np.asarray(low)))}), {glsl_float(float(np.asarray(high)))})"
        else:
            template = UNARY[op.layer.op_type](op.attrs)
        expression = _substitute(template, expression)
    return expression


def _substitute(expression: str, var: str) -> str:
    """``expression`` with the variable ``x`` renamed (whole identifiers only)."""
    import re

    return "(" + re.sub(r"\bx\b", var, expression) + ")"


class _Elementwise(PixelKernel):
    """Shared drawing: a ``vec4`` per texel when every input matches the output's shape and
    layout, else one broadcast element at a time."""

    def expression(self) -> str:
        raise NotImplementedError

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        return self.draw(device, [t for t in inputs if t is not None], self.expression(), post)

    def draw(self, device, tensors: list, expression: str, post: str | None) -> list:  # type: ignore[no-untyped-def]
        names = [chr(ord("a") + k) for k in range(len(tensors))]
        out_shape = tuple(np.broadcast_shapes(*(t.shape for t in tensors)))
        same = [t for t in tensors if t.shape == out_shape]
        layout = same[0].layout if same else natural_layout(out_shape)
        dtype = bool if self.bool_output else np.float32
        bound = dict(zip((n.upper() for n in names), tensors))
        if all(t.shape == out_shape and t.layout == layout for t in tensors):
            fetch = " ".join(f"vec4 {n} = {n.upper()}_texel(t);" for n in names)
            body = f"vec4 texel(int t, int outer, int block, int inner) {{ {fetch} return {expression}; }}"
            return [device.draw(out_shape, body, bound, mode="texel", layout=layout, dtype=dtype, post=post)]
        fetch = " ".join(f"float {n} = {n.upper()}_at({broadcast_index('i', out_shape, t.shape)});"
                         for n, t in zip(names, tensors))
        body = f"float value(int i) {{ {fetch} return {expression}; }}"
        return [device.draw(out_shape, body, bound, mode="value", layout=layout, dtype=dtype, post=post)]


@pixel_kernel(*UNARY)
class Unary(_Elementwise):
    """One-input math and activations."""

    def __init__(self, layer, op):  # type: ignore[no-untyped-def]
        super().__init__(layer, op)
        self.bool_output = layer.op_type in ("IsNaN", "Not")
        if layer.op_type == "Not":
            self.index_inputs = frozenset({0})

    def expression(self) -> str:
        return _substitute(UNARY[self.layer.op_type](self.layer.attrs), "a")



@pixel_kernel(*BINARY)
class Binary(_Elementwise):
    """Two-input arithmetic, comparisons and logic, with NumPy broadcasting."""

    def __init__(self, layer, op):  # type: ignore[no-untyped-def]
        super().__init__(layer, op)
        self.bool_output = layer.op_type in _COMPARISONS | _LOGIC
        if layer.op_type in _LOGIC:
            self.index_inputs = frozenset({0, 1})

    def supports(self, types):  # type: ignore[no-untyped-def]
        if self.layer.op_type in _LOGIC:
            return all(types.get(n) is not None and np.dtype(types[n]) == np.dtype(bool)
                       for n in list(self.layer.inputs) + list(self.layer.outputs) if n)
        if self.layer.op_type in ("Max", "Min") and len(self.layer.inputs) != 2:
            return False
        return super().supports(types) and len([n for n in self.layer.inputs if n]) == 2

    def expression(self) -> str:
        return BINARY[self.layer.op_type]


@pixel_kernel("Sum", "Mean")
class Variadic(_Elementwise):
    """Sum and Mean of any number of broadcast inputs."""

    def expression(self) -> str:
        count = len([n for n in self.layer.inputs if n])
        total = " + ".join(chr(ord("a") + k) for k in range(count))
        return f"({total}) / {float(count)}" if self.layer.op_type == "Mean" else f"({total})"


@pixel_kernel("Where")
class Where(_Elementwise):
    """``condition ? x : y`` with broadcasting; the condition is stored as 0/1."""

    index_inputs = frozenset({0})

    def supports(self, types):  # type: ignore[no-untyped-def]
        cond = types.get(self.layer.inputs[0])
        return cond is not None and np.dtype(cond) == np.dtype(bool) and super().supports(types)

    def expression(self) -> str:
        return "pick(a, b, c)"


@pixel_kernel("Clip")
class Clip(_Elementwise):
    """``clamp(x, min, max)``; the bounds are read on the host (attributes, or constant inputs)."""

    def __init__(self, layer, op):  # type: ignore[no-untyped-def]
        super().__init__(layer, op)
        self.host_inputs = frozenset({1, 2})
        self.bounds = (layer.attrs.get("min", -math.inf), layer.attrs.get("max", math.inf))

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        low, high = self.bounds
        if len(inputs) > 1 and inputs[1] is not None:
            low = float(np.asarray(inputs[1]).reshape(()))
        if len(inputs) > 2 and inputs[2] is not None:
            high = float(np.asarray(inputs[2]).reshape(()))
        return self.draw(device, [inputs[0]], f"min(max(a, {glsl_float(low)}), {glsl_float(high)})", post)
