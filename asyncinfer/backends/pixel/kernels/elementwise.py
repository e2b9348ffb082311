"""Element-wise kernels: unary math and activations, binary and variadic arithmetic with NumPy
broadcasting, comparisons, logic, Where and Clip.

No expression is written here (Where's ``pick(a, b, c)`` aside): each op's GLSL is its device
expression in the element-wise tables (`asyncinfer.ops.pointwise`), whose dialect is GLSL
with the helpers of ``shader.py``. Every expression works on ``float`` and ``vec4`` alike, so the
same text serves the ``vec4`` fast path (all inputs share the output's shape and layout: one texel
in, one texel out) and the broadcasting path (one element at a time through ``*_at``).
"""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from ....ops.base import Op
from ....ops.elementwise import clip_bounds
from ....ops.pointwise import BINARY_OPS, UNARY_OPS, clip_template, fill, fold_expression, rename
from ..layout import natural_layout
from .base import PixelKernel, broadcast_index, glsl_float, pixel_kernel

#: Dialect functions (`asyncinfer.ops.pointwise.DIALECT`) that are GLSL built-ins; shader.py's
#: HELPERS define the others.
GLSL_BUILTINS = frozenset({"abs", "sign", "floor", "ceil", "roundEven", "sqrt", "exp", "log", "sin", "cos", "tan",
                           "asin", "acos", "atan", "asinh", "acosh", "atanh", "min", "max", "clamp"})


_NAN_UNSAFE = re.compile(r"\b(min|max|clamp)\(")


def glsl_spelling(template: str) -> str:
    """A dialect template as gpu_pixel draws it: ``min``/``max``/``clamp`` become the prelude's
    NaN-propagating ``min_``/``max_``/``clamp_`` (NumPy's semantics, which the CPU op has)."""
    return _NAN_UNSAFE.sub(lambda m: f"{m[1]}_(", template)


def unary_glsl(op: Op) -> str:
    """The GLSL expression over ``x`` of a unary op's layer (attributes read through its CPU op)."""
    return UNARY_OPS[op.op_type].device_expression(op, glsl_float, glsl_spelling)


def binary_glsl(op: Op) -> str:
    """The GLSL expression over ``a`` and ``b`` of a two-input op's layer."""
    return BINARY_OPS[op.op_type].device_expression(op, glsl_float, glsl_spelling)


def clip_glsl(lo: object, hi: object) -> str:
    """The GLSL expression over ``x`` of Clip with host bounds ``lo``/``hi`` (None: absent)."""
    template, values = clip_template(lo, hi)
    return fill(glsl_spelling(template), values, glsl_float)


#: Unary ops with a shader, each the GLSL of its layer's expression over ``x`` (from the table);
#: also what fused activations are drawn with.
UNARY: dict[str, Callable[[Op], str]] = {
    name: unary_glsl for name, entry in UNARY_OPS.items() if entry.on_device}

#: Two-input ops with a shader (arithmetic, comparisons, logic), each the GLSL of its layer's
#: expression over ``a`` and ``b`` (from the binary table).
BINARY: dict[str, Callable[[Op], str]] = {
    name: binary_glsl for name, entry in BINARY_OPS.items() if entry.on_device and not entry.variadic}
#: Ops of any number of inputs with a shader (Sum, Mean, Max, Min): the binary template folded.
VARIADIC = tuple(name for name, entry in BINARY_OPS.items() if entry.on_device and entry.variadic)


def activation_chain(activations: list, var: str = "v") -> str:
    """The GLSL of a layer's fused activations (``(op, constant extra inputs)`` pairs, in order)
    applied to the vec4 ``var``."""
    expression = var
    for op, extras in activations:
        if op.op_type == "Clip":
            template = clip_glsl(*clip_bounds(op, *extras[:2]))
        else:
            template = UNARY[op.op_type](op)
        expression = rename(template, "x", expression)
    return expression


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
        entry = UNARY_OPS[layer.op_type]
        self.bool_output = entry.to_bool
        if entry.bool_input:
            self.index_inputs = frozenset({0})
        self.glsl = rename(UNARY[layer.op_type](op), "x", "a")

    def expression(self) -> str:
        return self.glsl


@pixel_kernel(*BINARY)
class Binary(_Elementwise):
    """Two-input arithmetic, comparisons and logic, with NumPy broadcasting."""

    def __init__(self, layer, op):  # type: ignore[no-untyped-def]
        super().__init__(layer, op)
        entry = BINARY_OPS[layer.op_type]
        self.bool_output = entry.to_bool
        self.logical = entry.logical
        if entry.logical:
            self.index_inputs = frozenset({0, 1})
        self.glsl = BINARY[layer.op_type](op)

    def supports(self, types):  # type: ignore[no-untyped-def]
        if self.logical:
            return all(types.get(n) is not None and np.dtype(types[n]) == np.dtype(bool)
                       for n in list(self.layer.inputs) + list(self.layer.outputs) if n)
        return super().supports(types) and len([n for n in self.layer.inputs if n]) == 2

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        a, b = inputs[0], inputs[1]
        if self.op.version < 7:
            # Legacy broadcast=1 with axis aligns B with A from axis on, not from the right: B is
            # viewed with the trailing unit axes the CPU op gives it (a free reshape here).
            probe = lambda t: np.broadcast_to(np.zeros((), np.float32), t.shape)  # noqa: E731
            b = b.view(tuple(self.op._legacy_align(probe(a), probe(b)).shape))
        return self.draw(device, [a, b], self.glsl, post)

    def expression(self) -> str:
        return self.glsl


@pixel_kernel(*VARIADIC)
class Variadic(_Elementwise):
    """Sum, Mean, Max and Min of any number of broadcast inputs: the table's two-input
    expression folded over them."""

    def expression(self) -> str:
        entry = BINARY_OPS[self.layer.op_type]
        count = len([n for n in self.layer.inputs if n])
        template = fill(glsl_spelling(entry.template({})), {}, glsl_float)
        return fold_expression(entry, template, [chr(ord("a") + k) for k in range(count)])


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

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        low, high = clip_bounds(self.op, *inputs[1:3])
        return self.draw(device, [inputs[0]], rename(clip_glsl(low, high), "x", "a"), post)
