"""Element-wise ops written once: the tables every backend is generated from.

One entry per ONNX op: `Unary` (``x``; math, predicates, activations) or `Binary`
(``a``, ``b``; arithmetic, comparisons, logic, bitwise, the variadic Sum/Mean/Max/Min). It gives
the name, the schema versions implemented, the array-API function ``fn(xp, x, **attributes)``
(run on NumPy by the CPU op, on CuPy or NumPy by gpu_compute) and the *device expression*: one
C-like expression in the small dialect of `DIALECT`, which is GLSL as it stands (gpu_pixel
draws it on ``float`` and ``vec4``) and CUDA C once `to_cuda` has prefixed its calls
(gpu_compute's fused epilogues). Attributes are ``fn``'s keyword parameters; their values always
come from `Op.attr` (the layer's, else ONNX's schema default)
and fill the expression's ``{name}`` placeholders as float literals: no default is restated.

How to add an element-wise op: one table line, plus its array-API function (inline or above it).
Swish (opset 24) came to every backend so, the CPU op, gpu_compute's kernel, gpu_pixel's shader
and the fused Conv+Swish epilogues of both GPU backends included::

    Unary("Swish", (24,), lambda xp, x, alpha: x * sigmoid(xp, alpha * x),
          "x / (1.0 + exp(-{alpha} * x))", activation=True),

``(24,)`` lists the schema versions implemented; ``alpha`` is read with ``Op.attr`` (default 1.0)
and fills ``{alpha}``; ``activation=True`` lets the optimizer fuse it into the layer before it;
``to_bool=True`` would mark a predicate. A two-input op is ``Binary(name, versions, lambda xp, a, b:
..., "expression of a and b")``. Expressions are checked at import: dialect calls only, float
literals, no ``?:`` (use ``pick(cond, a, b)``), and a variable before a literal in ``max``/
``min``/``pick``/comparisons (``ge(x, 0.0)``, not ``ge(0.0, x)``) so that it holds on ``vec4``.
The tests pick a new line up by themselves: tests/ops/test_pointwise.py (against onnx's reference),
tests/backends/pixel/test_pointwise_glsl.py (drawn on gpu_pixel) and
tests/backends/cupy/test_pointwise_cuda.py (the CUDA C compiled by the host's C++ compiler).
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
import re
import string
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .base import Op
from .compiled import activations as compiled_activations
from .compiled.one_pass import GELU, GELU_TANH
from .elementwise import compute_dtype, float_kernel
from .elementwise import erf as host_erf
from .epilogue import Activations, Epilogue, apply_activations
from .one_pass import activated, fused_add
from .registry import register
from .shape import op_error

#: The device dialect: the functions an expression may call, with their arity. Everything is
#: float -> float (GLSL: float and vec4 alike); comparisons give 1.0 or 0.0; ``pick(c, a, b)`` is
#: ``c != 0 ? a : b`` (both sides evaluated). Names ending in ``_`` differ from the GLSL built-in
#: of that name at the edges (``tanh_`` saturates, ``pow_`` follows ONNX for negative bases),
#: ``relu`` keeps NaN. gpu_pixel's GLSL prelude (``shader.HELPERS``) defines what GLSL lacks;
#: gpu_compute's CUDA prelude (``fusion.CUDA_PRELUDE``) defines every one as ``ai_<name>``.
DIALECT: Mapping[str, int] = {
    "abs": 1, "sign": 1, "floor": 1, "ceil": 1, "roundEven": 1, "sqrt": 1, "exp": 1, "expm1": 1, "log": 1,
    "sin": 1, "cos": 1, "tan": 1, "asin": 1, "acos": 1, "atan": 1, "sinh_": 1, "cosh_": 1,
    "asinh": 1, "acosh": 1, "atanh": 1, "tanh_": 1, "erf_": 1, "softplus": 1, "relu": 1, "is_nan": 1,
    "min": 2, "max": 2, "lt": 2, "le": 2, "gt": 2, "ge": 2, "eq": 2, "pow_": 2,
    "clamp": 3, "pick": 3,
}

_CALL = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
_IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")
_NUMBER = re.compile(r"(?<![\w.])(\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)(?![\w.])")
_INTEGER = re.compile(r"(?<![\w.])\d+(?![\w.])")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


# --------------------------------------------------------------------------------------------
# The dialect: checking, filling attributes in, renaming variables, CUDA spelling
# --------------------------------------------------------------------------------------------
def float_literal(value: float, *, nan: str, inf: str, neg_inf: str, suffix: str = "") -> str:
    """``value`` rounded to float32 as a literal of a device language, which spells the
    non-finite values its own way (each backend binds its spellings once)."""
    value = float(np.float32(value))
    if math.isnan(value):
        return nan
    if math.isinf(value):
        return inf if value > 0 else neg_inf
    return f"{value!r}{suffix}"


def placeholders(template: str) -> list[str]:
    """The ``{name}`` attribute placeholders of an expression template, in order."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def check_expression(template: str, variables: tuple[str, ...] = ("x",)) -> None:
    """Raise ValueError unless ``template`` is a valid dialect expression over ``variables``."""
    text = _PLACEHOLDER.sub("1.0", template)
    problems = []
    if re.search(r"[?:<>=!&|%;\[\]]", text):
        problems.append("only + - * / and dialect calls are allowed (no ?:, comparisons, indexing)")
    for match in _CALL.finditer(text):
        if match[1] not in DIALECT:
            problems.append(f"{match[1]}() is not a dialect function")
    calls = {m.start(1) for m in _CALL.finditer(text)}
    for match in _IDENTIFIER.finditer(text):
        if match.start() not in calls and match[0] not in variables:
            problems.append(f"unknown name {match[0]!r}")
    if _INTEGER.search(_NUMBER.sub("1.0", text)):
        problems.append("write float literals (1.0, not 1)")
    if problems:
        raise ValueError(f"device expression {template!r}: " + "; ".join(problems))


def fill(template: str, values: Mapping[str, Any], literal: Callable[[float], str]) -> str:
    """``template`` with each ``{name}`` replaced by ``literal(values[name])`` (negative literals
    in parentheses, so that ``-{alpha}`` never becomes ``--0.5``)."""
    def text(name: str) -> str:
        out = literal(float(np.asarray(values[name])))
        return f"({out})" if out.startswith("-") else out

    return template.format(**{name: text(name) for name in placeholders(template)})


def substitute(expression: str, mapping: Mapping[str, str]) -> str:
    """``expression`` with its variables replaced at once as ``mapping`` says (whole identifiers
    only), in parentheses."""
    pattern = r"\b(" + "|".join(re.escape(v) for v in mapping) + r")\b"
    return "(" + re.sub(pattern, lambda m: mapping[m[1]], expression) + ")"


def rename(expression: str, var: str, to: str) -> str:
    """``expression`` with the variable ``var`` renamed ``to`` (whole identifiers only), in parentheses."""
    return substitute(expression, {var: to})


def to_cuda(template: str) -> str:
    """The CUDA C spelling of a dialect expression: calls become the CUDA prelude's ``ai_<name>``
    functions and float literals get their ``f`` suffix (``0.5`` would be a double in C)."""
    renamed = _CALL.sub(lambda m: f"ai_{m[1]}(" if m[1] in DIALECT else m[0], template)
    return _NUMBER.sub(lambda m: m[1] + "f", renamed)


def clip_template(lo: Any, hi: Any) -> tuple[str, dict[str, float]]:
    """Clip's expression and placeholder values for host bounds ``lo``/``hi`` (None: absent).
    An infinite bound that cannot clip (``lo = -inf``, ``hi = +inf``) is left out, which keeps
    NaN as NaN the way the CPU op does."""
    expression, values = "x", {}
    if lo is not None and float(np.asarray(lo)) != -math.inf:
        expression, values["min"] = f"max({expression}, {{min}})", float(np.asarray(lo))
    if hi is not None and float(np.asarray(hi)) != math.inf:  # applied last: lo > hi gives hi
        expression, values["max"] = f"min({expression}, {{max}})", float(np.asarray(hi))
    return expression, values


# --------------------------------------------------------------------------------------------
# Array-API helpers the table's functions share
# --------------------------------------------------------------------------------------------
def erf(xp: Any, x: Any) -> Any:
    """The error function on ``xp``: the namespace's own ``erf`` if it has one (gpu_compute passes
    the device's), else the host's (SciPy, or a float64 polynomial); may return float64."""
    own = getattr(xp, "erf", None)
    return own(x) if own is not None else host_erf(x)


def sigmoid(xp: Any, x: Any) -> Any:
    return 1 / (1 + xp.exp(-x))  # exp overflow for x << 0 gives 1/inf = 0, which is right


def softplus(xp: Any, x: Any) -> Any:
    return xp.logaddexp(x.dtype.type(0), x)  # log(1 + e^x) without overflow


def _zero(x: Any) -> Any:
    return x.dtype.type(0)  # a scalar of x's type: no promotion on NumPy or CuPy


def _gelu(xp: Any, x: Any, approximate: str) -> Any:
    if approximate == "tanh":
        return 0.5 * x * (1 + xp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + erf(xp, x / math.sqrt(2)).astype(x.dtype, copy=False))


#: Gelu's two forms as codes of the compiled one-pass activation (`one_pass.activated`, shared with
#: the spinning helpers from 32 k values: BERT-tiny's 128 x 512 and ViT-B/16's 197 x 3072 after
#: their products), which no epilogue of a kernel's stores applies.
_GELU_PASSES = {"none": Epilogue(GELU), "tanh": Epilogue(GELU_TANH)}


def _gelu_inplace(xp: Any, x: Any, approximate: str) -> Any:
    if _compiled_float32(xp, x) and x.flags.writeable and activated(x, _GELU_PASSES[approximate], True) is not None:
        return x
    if approximate == "tanh":
        gate = xp.multiply(x, x)
        gate *= 0.044715
        gate += 1
        gate *= x  # x + 0.044715·x³
        gate *= math.sqrt(2 / math.pi)
        xp.tanh(gate, out=gate)
    else:
        gate = erf(xp, x * (1 / math.sqrt(2))).astype(x.dtype, copy=False)
    gate += 1
    gate *= 0.5
    x *= gate
    return x


def _swish_inplace(xp: Any, x: Any, alpha: float) -> Any:
    if _compiled_float32(xp, x):
        compiled_activations.swish(x.reshape(-1), alpha)
        return x
    gate = xp.multiply(x, alpha)
    x *= _sigmoid_inplace(xp, gate)
    return x


_GELU = {"tanh": "0.5 * x * (1.0 + tanh_(0.7978845608028654 * (x + 0.044715 * x * x * x)))",
         "none": "0.5 * x * (1.0 + erf_(x * 0.7071067811865476))"}


# --------------------------------------------------------------------------------------------
# The unary table
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    """What unary and binary entries share: name, schema versions, the array-API function
    ``fn(xp, *variables, **attributes)``, the device expression and the string-attribute choices.

    ``expression`` is a dialect template over the entry's variables (``{attr}`` placeholders), or
    a function of the attribute values giving one (Gelu picks its form by ``approximate``), or
    None for ops with no device form: those run on the CPU only. ``choices`` lists the accepted
    values of string attributes (others are refused at worker creation). ``to_bool`` marks a
    predicate (its output is bool, its expression gives 1.0 or 0.0).
    """

    variables: ClassVar[tuple[str, ...]] = ()

    name: str
    versions: tuple[int, ...]
    fn: Callable[..., Any]
    expression: str | Callable[[Mapping[str, Any]], str] | None = None
    to_bool: bool = False
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    attributes: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        params = list(inspect.signature(self.fn).parameters)[1 + len(self.variables):]  # after (xp, x…)
        object.__setattr__(self, "attributes", tuple(params))
        for template in self.templates():
            check_expression(template, self.variables)
            unknown = set(placeholders(template)) - set(params)
            if unknown:
                raise ValueError(f"{self.name}: placeholders {sorted(unknown)} are not attributes of fn")

    @property
    def on_device(self) -> bool:
        """Whether the GPU backends run it (it has a device expression)."""
        return self.expression is not None

    def values(self, op: Any) -> dict[str, Any]:
        """The attribute values of a layer, read through its CPU op (``op.attr``: schema defaults)."""
        return {name: op.attr(name) for name in self.attributes}

    def template(self, values: Mapping[str, Any]) -> str:
        """The dialect template (placeholders unfilled) for these attribute values."""
        if self.expression is None:
            raise ValueError(f"{self.name} has no device expression")
        return self.expression(values) if callable(self.expression) else self.expression

    def templates(self) -> Iterator[str]:
        """Every template the entry can give (over the product of its ``choices``)."""
        if self.expression is None:
            return
        if not callable(self.expression):
            yield self.expression
            return
        names = list(self.choices)
        for combo in itertools.product(*(self.choices[n] for n in names)):
            yield self.expression(dict(zip(names, combo)))

    def device_expression(self, op: Any, literal: Callable[[float], str],
                          spell: Callable[[str], str] = lambda t: t) -> str:
        """The expression of ``op``'s layer with its attributes filled in as ``literal``\\ s,
        after ``spell`` (e.g. `to_cuda`) has turned the template into the backend's language."""
        values = self.values(op)
        return fill(spell(self.template(values)), values, literal)


@dataclass(frozen=True)
class Unary(_Entry):
    """One element-wise single-input op over ``x``; see the module docstring. ``activation``
    makes it fusable into the layer before it; ``inplace`` is an optional ``f(xp, x, **values)``
    writing the result into ``x`` with operations NumPy and CuPy share; ``bool_input`` marks Not
    (bool in, bool out)."""

    variables: ClassVar[tuple[str, ...]] = ("x",)

    activation: bool = False
    bool_input: bool = False
    inplace: Callable[[Any, Any], Any] | None = None


def _compiled_float32(xp: Any, x: Any) -> bool:
    """Whether ``x`` can take a one-pass compiled activation (`compiled.activations`): a
    contiguous float32 NumPy array (float64 and device arrays keep the ufunc chains)."""
    return xp is np and x.dtype == np.float32 and x.flags.c_contiguous


def _sigmoid_inplace(xp: Any, x: Any) -> Any:
    if _compiled_float32(xp, x):
        compiled_activations.sigmoid(x.reshape(-1))
        return x
    xp.negative(x, out=x)
    xp.exp(x, out=x)  # overflow for x << 0 gives inf, and 1 / (1 + inf) = 0, which is right
    x += 1
    return xp.reciprocal(x, out=x)


def _hard_sigmoid_inplace(xp: Any, x: Any, alpha: float, beta: float) -> Any:
    if _compiled_float32(xp, x):
        compiled_activations.hard_sigmoid(x.reshape(-1), alpha, beta)
        return x
    x *= x.dtype.type(alpha)
    x += x.dtype.type(beta)
    return xp.clip(x, 0, 1, out=x)


def _hard_swish_inplace(xp: Any, x: Any) -> Any:
    if _compiled_float32(xp, x):
        compiled_activations.hard_swish(x.reshape(-1))
        return x
    gate = xp.divide(x, 6)
    gate += 0.5
    xp.clip(gate, 0, 1, out=gate)
    x *= gate
    return x


UNARY_OPS: dict[str, Unary] = {entry.name: entry for entry in [
    # -- math ---------------------------------------------------------------------------------
    Unary("Abs", (1, 6, 13), lambda xp, x: xp.abs(x), "abs(x)"),
    Unary("Neg", (1, 6, 13), lambda xp, x: xp.negative(x), "-x"),
    Unary("Reciprocal", (1, 6, 13), lambda xp, x: xp.reciprocal(x), "1.0 / x"),
    Unary("Floor", (1, 6, 13), lambda xp, x: xp.floor(x), "floor(x)"),
    Unary("Ceil", (1, 6, 13), lambda xp, x: xp.ceil(x), "ceil(x)"),
    Unary("Round", (11, 22), lambda xp, x: xp.rint(x), "roundEven(x)"),  # half to even, as ONNX says
    Unary("Sign", (9, 13), lambda xp, x: xp.sign(x), "sign(x)"),
    Unary("Sqrt", (1, 6, 13), lambda xp, x: xp.sqrt(x), "sqrt(x)"),
    Unary("Exp", (1, 6, 13), lambda xp, x: xp.exp(x), "exp(x)"),
    Unary("Log", (1, 6, 13), lambda xp, x: xp.log(x), "log(x)"),
    Unary("Sin", (7, 22), lambda xp, x: xp.sin(x), "sin(x)"),
    Unary("Cos", (7, 22), lambda xp, x: xp.cos(x), "cos(x)"),
    Unary("Tan", (7, 22), lambda xp, x: xp.tan(x), "tan(x)"),
    Unary("Asin", (7, 22), lambda xp, x: xp.arcsin(x), "asin(x)"),
    Unary("Acos", (7, 22), lambda xp, x: xp.arccos(x), "acos(x)"),
    Unary("Atan", (7, 22), lambda xp, x: xp.arctan(x), "atan(x)"),
    Unary("Sinh", (9, 22), lambda xp, x: xp.sinh(x), "sinh_(x)"),
    Unary("Cosh", (9, 22), lambda xp, x: xp.cosh(x), "cosh_(x)"),
    Unary("Asinh", (9, 22), lambda xp, x: xp.arcsinh(x), "asinh(x)"),
    Unary("Acosh", (9, 22), lambda xp, x: xp.arccosh(x), "acosh(x)"),
    Unary("Atanh", (9, 22), lambda xp, x: xp.arctanh(x), "atanh(x)"),
    Unary("Erf", (9, 13), erf, "erf_(x)"),
    Unary("IsNaN", (9, 13, 20), lambda xp, x: xp.isnan(x), "is_nan(x)", to_bool=True),
    Unary("Not", (1,), lambda xp, x: xp.logical_not(x), "1.0 - x", to_bool=True, bool_input=True),
    Unary("BitwiseNot", (18,), lambda xp, x: xp.invert(x)),
    # -- activations (fusable into the layer before them) --------------------------------------
    Unary("Relu", (1, 6, 13, 14), lambda xp, x: xp.maximum(x, _zero(x)), "relu(x)", activation=True,
          inplace=lambda xp, x: xp.maximum(x, _zero(x), out=x)),
    Unary("Sigmoid", (1, 6, 13), sigmoid, "1.0 / (1.0 + exp(-x))", activation=True, inplace=_sigmoid_inplace),
    Unary("Tanh", (1, 6, 13), lambda xp, x: xp.tanh(x), "tanh_(x)", activation=True),
    Unary("HardSigmoid", (1, 6, 22), lambda xp, x, alpha, beta: xp.clip(alpha * x + beta, 0, 1),
          "clamp({alpha} * x + {beta}, 0.0, 1.0)", activation=True, inplace=_hard_sigmoid_inplace),
    Unary("HardSwish", (14, 22), lambda xp, x: x * xp.clip(x / 6 + 0.5, 0, 1),
          "x * clamp(x / 6.0 + 0.5, 0.0, 1.0)", activation=True, inplace=_hard_swish_inplace),
    Unary("LeakyRelu", (1, 6, 16), lambda xp, x, alpha: xp.where(x >= 0, x, alpha * x),
          "pick(ge(x, 0.0), x, {alpha} * x)", activation=True),
    Unary("Elu", (1, 6, 22), lambda xp, x, alpha: xp.where(x > 0, x, alpha * xp.expm1(x)),
          "pick(gt(x, 0.0), x, {alpha} * expm1(x))", activation=True),
    Unary("Selu", (1, 6, 22), lambda xp, x, alpha, gamma: gamma * xp.where(x > 0, x, alpha * xp.expm1(x)),
          "{gamma} * pick(gt(x, 0.0), x, {alpha} * expm1(x))", activation=True),
    Unary("Celu", (12, 28), lambda xp, x, alpha: xp.maximum(x, 0) + xp.minimum(0, alpha * xp.expm1(x / alpha)),
          "max(x, 0.0) + min({alpha} * expm1(x / {alpha}), 0.0)", activation=True),
    Unary("Softplus", (1, 22), softplus, "softplus(x)", activation=True),
    Unary("Softsign", (1, 22), lambda xp, x: x / (1 + xp.abs(x)), "x / (1.0 + abs(x))", activation=True),
    Unary("ThresholdedRelu", (10, 22), lambda xp, x, alpha: xp.where(x > alpha, x, _zero(x)),
          "pick(gt(x, {alpha}), x, 0.0)", activation=True),
    Unary("Mish", (18, 22), lambda xp, x: x * xp.tanh(softplus(xp, x)), "x * tanh_(softplus(x))", activation=True),
    Unary("Shrink", (9,), lambda xp, x, lambd, bias: xp.where(x < -lambd, x + bias,
                                                              xp.where(x > lambd, x - bias, _zero(x))),
          "pick(lt(x, -{lambd}), x + {bias}, pick(gt(x, {lambd}), x - {bias}, 0.0))", activation=True),
    Unary("Gelu", (20,), _gelu, lambda attrs: _GELU[attrs["approximate"]], activation=True,
          choices={"approximate": ("none", "tanh")}, inplace=_gelu_inplace),
    Unary("Swish", (24,), lambda xp, x, alpha: x * sigmoid(xp, alpha * x),
          "x / (1.0 + exp(-{alpha} * x))", activation=True, inplace=_swish_inplace),
]}

#: The fusable activations, by name.
ACTIVATIONS: dict[str, Unary] = {name: e for name, e in UNARY_OPS.items() if e.activation}


# --------------------------------------------------------------------------------------------
# The binary table
# --------------------------------------------------------------------------------------------
def _trunc_divide(xp: Any, a: Any, b: Any) -> Any:
    """Division; integers truncate toward zero (C semantics, as ONNX runtimes do), not floor."""
    if a.dtype.kind not in "iu":
        return xp.divide(a, b)
    q = xp.floor_divide(a, b)
    if a.dtype.kind == "i":  # floor and trunc differ when the signs differ and there is a remainder
        q = q + ((xp.remainder(a, b) != 0) & ((a < 0) != (b < 0))).astype(q.dtype)
    return q


def _power(xp: Any, a: Any, b: Any) -> Any:
    """Pow; the result has the base's type. A float base is raised in its compute type (float32
    for narrow floats), an integer exponent converted to it; integer powers of integers stay
    exact (NumPy refuses negative integer exponents of integers: 1 / a**|b|, truncated like C)."""
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        out = xp.power(a, xp.maximum(b, 0))
        negative = b < 0
        if negative.any():
            out = xp.where(negative, xp.trunc(xp.float_power(a, b)), out)
        return out
    base = compute_dtype(a.dtype)
    exponent = base if b.dtype.kind in "iub" else compute_dtype(b.dtype)
    return xp.power(a.astype(base, copy=False), b.astype(exponent, copy=False))


def _prelu(xp: Any, a: Any, b: Any) -> Any:
    return xp.where(a < 0, a * b.astype(a.dtype, copy=False), a)  # the slope broadcasts to x


def _ufunc(name: str) -> Callable[..., Any]:
    """The ``fn`` of an entry that is one call of the array library's ufunc ``name``; the CPU op
    calls NumPy's own straight (`BinaryOp.bound_run`: one Python call less on every layer)."""
    def call(xp: Any, a: Any, b: Any) -> Any:
        return getattr(xp, name)(a, b)

    call.ufunc = name  # type: ignore[attr-defined]
    return call


@dataclass(frozen=True)
class Binary(_Entry):
    """One element-wise two-input op over ``a`` and ``b`` (NumPy broadcasting); see the module
    docstring. ``logical`` marks And/Or/Xor (bool inputs, stored as 0/1 on devices);
    ``variadic`` ops fold ``fn`` over any number of inputs (Sum, Mean, Max, Min; Mean then
    divides by their count)."""

    variables: ClassVar[tuple[str, ...]] = ("a", "b")

    logical: bool = False
    variadic: bool = False


_ARITHMETIC = (1, 6, 7, 13, 14)

BINARY_OPS: dict[str, Binary] = {entry.name: entry for entry in [
    Binary("Add", _ARITHMETIC, _ufunc("add"), "a + b"),
    Binary("Sub", _ARITHMETIC, _ufunc("subtract"), "a - b"),
    Binary("Mul", _ARITHMETIC, _ufunc("multiply"), "a * b"),
    Binary("Div", _ARITHMETIC, _trunc_divide, "a / b"),
    Binary("Pow", (1, 7, 12, 13, 15), _power, "pow_(a, b)"),
    Binary("PRelu", (7, 9, 16), _prelu, "pick(lt(a, 0.0), a * b, a)"),  # opset 6 and older: not supported
    Binary("Mod", (10, 13, 28), lambda xp, a, b, fmod: (xp.fmod if fmod else xp.mod)(a, b)),
    Binary("BitShift", (11, 28), lambda xp, a, b, direction: (xp.left_shift if direction == "LEFT" else
                                                               xp.right_shift)(a, b.astype(a.dtype, copy=False)),
           choices={"direction": ("LEFT", "RIGHT")}),
    Binary("BitwiseAnd", (18,), _ufunc("bitwise_and")),
    Binary("BitwiseOr", (18,), _ufunc("bitwise_or")),
    Binary("BitwiseXor", (18,), _ufunc("bitwise_xor")),
    # -- comparisons and logic: bool outputs ------------------------------------------------------
    Binary("Equal", (1, 7, 11, 13, 19), _ufunc("equal"), "eq(a, b)", to_bool=True),
    Binary("Less", (1, 7, 9, 13), _ufunc("less"), "lt(a, b)", to_bool=True),
    Binary("LessOrEqual", (12, 16), _ufunc("less_equal"), "le(a, b)", to_bool=True),
    Binary("Greater", (1, 7, 9, 13), _ufunc("greater"), "gt(a, b)", to_bool=True),
    Binary("GreaterOrEqual", (12, 16), _ufunc("greater_equal"), "ge(a, b)", to_bool=True),
    Binary("And", (1, 7), _ufunc("logical_and"), "a * b", to_bool=True, logical=True),
    Binary("Or", (1, 7), _ufunc("logical_or"), "max(a, b)", to_bool=True, logical=True),
    Binary("Xor", (1, 7), _ufunc("logical_xor"), "abs(a - b)", to_bool=True, logical=True),
    # -- variadic: folded over any number of inputs -------------------------------------------------
    Binary("Sum", (1, 6, 8, 13), _ufunc("add"), "a + b", variadic=True),
    Binary("Mean", (1, 6, 8, 13), _ufunc("add"), "a + b", variadic=True),
    Binary("Max", (1, 6, 8, 12, 13), _ufunc("maximum"), "max(a, b)", variadic=True),
    Binary("Min", (1, 6, 8, 12, 13), _ufunc("minimum"), "min(a, b)", variadic=True),
]}


def fold_expression(entry: Binary, template: str, names: list[str]) -> str:
    """A variadic entry's expression over the variables ``names`` (its template folded left;
    Mean divided by their count)."""
    expression = names[0]
    for name in names[1:]:
        expression = substitute(template, {"a": expression, "b": name})
    return f"{expression} / {float(len(names))}" if entry.name == "Mean" else expression


# --------------------------------------------------------------------------------------------
# The CPU ops, generated
# --------------------------------------------------------------------------------------------
class _TableOp(Op):
    """What the generated CPU ops share: refusing unknown string choices, reading attributes once."""

    spec: ClassVar[_Entry]

    def check(self) -> None:
        for name, allowed in self.spec.choices.items():
            if self.attr(name) not in allowed:
                self.unsupported(f"{name}={self.attr(name)!r}")
        self.values = self.spec.values(self)  # parsed once per layer; run only reads them

    def _add_activated(self, operands: tuple[np.ndarray, ...], pair: bool, activations: Activations) -> np.ndarray:
        """(``Add``, ``Sum``: `FUSED_ADDS`) The sum of ``operands`` and then ``activations``: in one
        compiled pass when they are a ``pair`` it takes (`one_pass.fused_add`), else the op's NumPy
        way followed by the activations."""
        out = fused_add(operands[0], operands[1], activations) if pair else None
        if out is not None:
            return out
        out = self._plain(*operands)
        return apply_activations(out, activations, operands) if activations else out

    def _plain(self, *operands: np.ndarray) -> np.ndarray:
        """The op's NumPy way (binary ops)."""
        raise NotImplementedError


class UnaryOp(_TableOp):
    """The CPU op of a `Unary` entry: its function on NumPy (narrow floats in float32), a
    float32 activation in one compiled pass (`one_pass.activated`)."""

    spec: ClassVar[Unary]

    def check(self) -> None:
        super().check()
        # the epilogue doing this op alone (None: not an activation it has)
        self.epilogue = Epilogue.of(((self, ()),), np.dtype(np.float32)) if self.spec.activation else None

    def run(self, x: np.ndarray) -> np.ndarray:
        if self.spec.to_bool:
            return np.asarray(self.spec.fn(np, x, **self.values), dtype=bool)
        out = activated(x, self.epilogue)  # one compiled pass where the epilogue has this activation
        if out is not None:
            return out
        if self.spec.inplace is not None and x.dtype.kind == "f" and x.dtype.itemsize >= 4:
            # The in-place form on a copy: fewer temporaries, and the very bits of the fused form.
            return self.spec.inplace(np, np.array(x, copy=True), **self.values)
        return _FLOAT_CALL(x, self.spec.fn, self.values)

    def run_inplace(self, x: np.ndarray) -> np.ndarray:
        """The op's result written into ``x`` (a fresh float buffer) where the table has an
        in-place form: fewer passes over memory, no allocation; a float32 activation in the
        compiled pass `run` takes (`one_pass.activated`, shared with the spinning helpers from
        32 k values), else NumPy's in-place form. Narrow floats are computed in float32 by `run`,
        so they never take this path."""
        if self.spec.inplace is None or x.dtype.itemsize < 4:
            return self.run(x)
        if not self.spec.to_bool and x.flags.writeable and activated(x, self.epilogue, in_place=True) is not None:
            return x
        return self.spec.inplace(np, x, **self.values)


#: ``fn(np, x, **values)`` with narrow floats computed in float32 and x's dtype kept.
_FLOAT_CALL = float_kernel(lambda x, fn, values: fn(np, x, **values))


class BinaryOp(_TableOp):
    """The CPU op of a `Binary` entry, with NumPy broadcasting; the result has A's type
    (bool for comparisons and logic). Before opset 7, ``broadcast=1`` with ``axis`` aligned B's
    dims with A's from ``axis`` on: emulated by reshaping B first."""

    spec: ClassVar[Binary]

    def _legacy_align(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        axis = self.attr("axis", None)  # absent: suffix matching, which NumPy broadcasting does
        if not self.attr("broadcast") or axis is None:
            return b
        axis = axis % a.ndim if a.ndim else 0
        return b.reshape(b.shape + (1,) * (a.ndim - axis - b.ndim))

    def run(self, a: np.ndarray, b: np.ndarray, *, activations: Activations = ()) -> np.ndarray:
        if self.takes_activations:  # (Add)
            return self._add_activated((a, b), self.version >= 7, activations)
        return self._plain(a, b)

    def _plain(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:  # type: ignore[override]
        if self.version < 7:
            b = self._legacy_align(a, b)
        out = self.spec.fn(np, a, b, **self.values)
        if self.spec.to_bool:
            return np.asarray(out, dtype=bool)
        # (most results are already arrays of A's type: no conversion call, on every layer of a run)
        return out if type(out) is np.ndarray and out.dtype == a.dtype else np.asarray(out).astype(a.dtype, copy=False)

    def bound_run(self, activations: Activations = ()) -> Callable[[list], list]:
        # `run` without its opset test and keyword call: half the time of a small Add (0.6 of
        # 1.2 µs), and chains of small element-wise layers are common (decoders, streaming models);
        # NumPy's ufunc itself where the entry is one (`_ufunc`): 0.52 µs against 0.61
        if activations or self.version < 7 or self.spec.to_bool or self.values:
            return super().bound_run(activations)
        ufunc = getattr(self.spec.fn, "ufunc", None)
        call = getattr(np, ufunc) if ufunc else functools.partial(self.spec.fn, np)

        def outputs(args: list) -> list:
            a = args[0]
            out = call(a, args[1])
            if type(out) is not np.ndarray or out.dtype != a.dtype:
                out = np.asarray(out).astype(a.dtype, copy=False)
            return [out]

        return outputs


class VariadicOp(_TableOp):
    """The CPU op of a variadic `Binary` entry: ``fn`` folded over the inputs (with
    broadcasting); Mean then divides by their count."""

    spec: ClassVar[Binary]

    def run(self, *xs: np.ndarray, activations: Activations = ()) -> np.ndarray:
        if self.takes_activations:  # (Sum)
            return self._add_activated(xs, len(xs) == 2, activations)
        return self._plain(*xs)

    def _plain(self, *xs: np.ndarray) -> np.ndarray:
        dtype = xs[0].dtype
        out = functools.reduce(lambda a, b: self.spec.fn(np, a, b), xs)
        if self.spec.name == "Mean":
            out = np.divide(out, np.asarray(len(xs), dtype))
        return np.asarray(out).astype(dtype, copy=False)


#: The binary entries whose CPU op takes its layer's fused activations (`one_pass.fused_add`).
FUSED_ADDS = frozenset({"Add", "Sum"})


def op_class(spec: _Entry) -> type[_TableOp]:
    """A new CPU op class for ``spec`` (not registered)."""
    if isinstance(spec, Unary):
        base: type[_TableOp] = UnaryOp
        kind = "activation" if spec.activation else "element-wise"
    else:
        base = VariadicOp if spec.variadic else BinaryOp  # type: ignore[union-attr]
        kind = "of any number of inputs" if spec.variadic else "element-wise with broadcasting"  # type: ignore
    return type(spec.name, (base,), {"spec": spec, "elementwise_unary": getattr(spec, "activation", False),
                                     "takes_activations": spec.name in FUSED_ADDS,
                                     "__doc__": f"ONNX {spec.name} ({kind}), generated from the element-wise "
                                                f"table of {__name__}.", "__module__": __name__})


#: The registered CPU op class of every table entry (unary and binary), by name.
OP_CLASSES: dict[str, type[_TableOp]] = {
    name: register(name, spec.versions)(op_class(spec))  # type: ignore[misc]
    for name, spec in [*UNARY_OPS.items(), *BINARY_OPS.items()]}


@register("PRelu", versions=(1, 6))
class PRelu6(OP_CLASSES["PRelu"]):  # type: ignore[misc, valid-type]
    """PRelu before opset 7: the slope is one value, or one per channel (axis 1 of X, as the
    schema's "shared across different channels" and the pytorch exporters of the time mean),
    not NumPy-broadcast from the right. A slope of any other shape must broadcast to X."""

    def _legacy_align(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if b.size == 1:
            return b.reshape(())
        if b.ndim == 1 and a.ndim >= 2 and b.shape[0] == a.shape[1]:
            return b.reshape(b.shape + (1,) * (a.ndim - 2))
        try:
            np.broadcast_shapes(b.shape, a.shape)
        except ValueError:
            raise op_error(self, f"slope of shape {b.shape} is neither one value, one per channel "
                                 f"(axis 1 of X, shape {a.shape}) nor broadcastable to X") from None
        return b
