"""Element-wise kernels: arithmetic, comparison, logic, bitwise, unary math, variadic, Where, Clip, Cast.

Binary ops use NumPy (multidirectional) broadcasting; before opset 7 they used an explicit
``broadcast``/``axis`` scheme, emulated by aligning B to A first. Every kernel returns the dtype ONNX
specifies: results are cast back wherever NumPy would promote, and narrow floats (float16, bfloat16…)
are evaluated in float32, which NumPy computes faster and more accurately.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
from onnx import TensorProto

from ..dtypes import onnx_to_numpy
from ..errors import ModelLoadError
from .base import Op
from .registry import register

# Float types with fewer than 32 bits: NumPy has no (or slow, imprecise) math for them.
_NARROW_FLOATS = frozenset(np.dtype(t) for t in (
    np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz))
# Float8 types whose Cast obeys the ``saturate`` attribute (clamp to ±max instead of inf/NaN).
_SATURABLE = frozenset(np.dtype(t) for t in (
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz))
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype to evaluate math in: float32 for narrow floats, ``dtype`` itself otherwise."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in _NARROW_FLOATS else dtype


def float_kernel(fn: Callable[..., Any]) -> Callable[..., np.ndarray]:
    """Wrap ``fn(x, ...)``: evaluate narrow floats in float32, silence FP warnings, return x's dtype.

    ONNX expects inf/NaN silently where IEEE arithmetic produces them; the cast back also turns NumPy
    scalars (from 0-d inputs) into arrays.
    """

    @functools.wraps(fn)
    def kernel(x: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        with np.errstate(all="ignore"):
            y = fn(x.astype(compute_dtype(x.dtype), copy=False), *args, **kwargs)
            return np.asarray(y).astype(x.dtype, copy=False)

    return kernel


# --------------------------------------------------------------------------------------------
# Unary math
# --------------------------------------------------------------------------------------------
def _define_unary(name: str, fn: Callable[[np.ndarray], Any], versions: tuple[int, ...],
                  *, to_bool: bool = False) -> type[Op]:
    """Build and register a single-input op applying ``fn`` (output dtype: input's, or bool)."""
    kernel = (lambda x: np.asarray(fn(x), dtype=bool)) if to_bool else float_kernel(fn)

    def run(self: Op, x: np.ndarray) -> np.ndarray:
        return kernel(x)

    cls = type(name, (Op,), {"run": run, "__doc__": f"ONNX {name}, element-wise."})
    return register(name, versions)(cls)


def _erf_fallback(x: np.ndarray) -> np.ndarray:
    """erf without SciPy: Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), evaluated in float64."""
    a = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-a * a))


try:  # SciPy's erf is exact to double precision; it is optional, not a dependency
    from scipy.special import erf as _erf
except ImportError:  # pragma: no cover - depends on the environment
    _erf = _erf_fallback


def erf(x: np.ndarray) -> np.ndarray:
    """Element-wise error function (float64 or the input's float dtype)."""
    return _erf(x)


_UNARY: dict[str, tuple[Callable[[np.ndarray], Any], tuple[int, ...]]] = {
    "Abs": (np.abs, (1, 6, 13)),
    "Neg": (np.negative, (1, 6, 13)),
    "Reciprocal": (np.reciprocal, (1, 6, 13)),
    "Floor": (np.floor, (1, 6, 13)),
    "Ceil": (np.ceil, (1, 6, 13)),
    "Round": (np.rint, (11, 22)),  # rint rounds half to even, as ONNX specifies
    "Sign": (np.sign, (9, 13)),
    "Sqrt": (np.sqrt, (1, 6, 13)),
    "Exp": (np.exp, (1, 6, 13)),
    "Log": (np.log, (1, 6, 13)),
    "Sin": (np.sin, (7, 22)),
    "Cos": (np.cos, (7, 22)),
    "Tan": (np.tan, (7, 22)),
    "Asin": (np.arcsin, (7, 22)),
    "Acos": (np.arccos, (7, 22)),
    "Atan": (np.arctan, (7, 22)),
    "Sinh": (np.sinh, (9, 22)),
    "Cosh": (np.cosh, (9, 22)),
    "Asinh": (np.arcsinh, (9, 22)),
    "Acosh": (np.arccosh, (9, 22)),
    "Atanh": (np.arctanh, (9, 22)),
    "Erf": (erf, (9, 13)),
    "Not": (np.logical_not, (1,)),
    "BitwiseNot": (np.invert, (18,)),
}
for _name, (_fn, _versions) in _UNARY.items():
    _define_unary(_name, _fn, _versions)
_define_unary("IsNaN", np.isnan, (9, 13, 20), to_bool=True)


@register("IsInf", versions=(10, 20))
class IsInf(Op):
    def run(self, x: np.ndarray) -> np.ndarray:
        pos, neg = self.attr("detect_positive", 1), self.attr("detect_negative", 1)
        return np.isinf(x) & (((x > 0) & bool(pos)) | ((x < 0) & bool(neg)))


# --------------------------------------------------------------------------------------------
# Binary ops
# --------------------------------------------------------------------------------------------
def _trunc_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Division; integers truncate toward zero (C semantics, as ONNX runtimes do), not floor."""
    if a.dtype.kind not in "iu":
        return np.divide(a, b)
    q = np.floor_divide(a, b)
    if a.dtype.kind == "i":  # floor and trunc differ when the signs differ and there is a remainder
        q = q + ((np.remainder(a, b) != 0) & ((a < 0) != (b < 0))).astype(q.dtype)
    return q


def _power(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pow; the result has the base's type. NumPy refuses negative integer exponents of integers."""
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        out = np.power(a, np.maximum(b, 0))
        negative = b < 0
        if negative.any():  # 1 / a**|b|, truncated toward zero like C
            out = np.where(negative, np.trunc(np.float_power(a, b)), out)
        return out
    cd = compute_dtype(a.dtype)
    return np.power(a.astype(cd, copy=False), b.astype(compute_dtype(b.dtype), copy=False))


class _Binary(Op):
    """A two-input element-wise op; ``fn`` computes it, ``to_bool`` marks comparisons."""

    fn: ClassVar[Callable[[np.ndarray, np.ndarray], Any]]
    to_bool: ClassVar[bool] = False

    def _legacy_align(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Opsets < 7: with ``broadcast=1`` and ``axis``, B's dims line up with A's from ``axis`` on."""
        axis = self.attr("axis", None)
        if not self.attr("broadcast", 0) or axis is None:
            return b  # same shapes, or suffix matching: NumPy broadcasting does that
        axis = axis % a.ndim if a.ndim else 0
        return b.reshape(b.shape + (1,) * (a.ndim - axis - b.ndim))

    def compute(self, a: np.ndarray, b: np.ndarray) -> Any:
        return type(self).fn(a, b)

    def run(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.version < 7:
            b = self._legacy_align(a, b)
        with np.errstate(all="ignore"):
            out = self.compute(a, b)
        return np.asarray(out, dtype=bool) if self.to_bool else np.asarray(out).astype(a.dtype, copy=False)


def _define_binary(name: str, fn: Callable[[np.ndarray, np.ndarray], Any], versions: tuple[int, ...],
                   *, to_bool: bool = False) -> type[Op]:
    cls = type(name, (_Binary,), {"fn": staticmethod(fn), "to_bool": to_bool,
                                  "__doc__": f"ONNX {name}, element-wise with broadcasting."})
    return register(name, versions)(cls)


for _name, _fn, _versions in (
    ("Add", np.add, (1, 6, 7, 13, 14)),
    ("Sub", np.subtract, (1, 6, 7, 13, 14)),
    ("Mul", np.multiply, (1, 6, 7, 13, 14)),
    ("Div", _trunc_divide, (1, 6, 7, 13, 14)),
    ("Pow", _power, (1, 7, 12, 13, 15)),
    ("BitwiseAnd", np.bitwise_and, (18,)),
    ("BitwiseOr", np.bitwise_or, (18,)),
    ("BitwiseXor", np.bitwise_xor, (18,)),
):
    _define_binary(_name, _fn, _versions)

for _name, _fn, _versions in (
    ("Equal", np.equal, (1, 7, 11, 13, 19)),
    ("Less", np.less, (1, 7, 9, 13)),
    ("LessOrEqual", np.less_equal, (12, 16)),
    ("Greater", np.greater, (1, 7, 9, 13)),
    ("GreaterOrEqual", np.greater_equal, (12, 16)),
    ("And", np.logical_and, (1, 7)),
    ("Or", np.logical_or, (1, 7)),
    ("Xor", np.logical_xor, (1, 7)),
):
    _define_binary(_name, _fn, _versions, to_bool=True)


@register("Mod", versions=(10, 13, 28))
class Mod(_Binary):
    """fmod=0: remainder with the divisor's sign (Python %); fmod=1: with the dividend's sign (C fmod)."""

    def compute(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (np.fmod if self.attr("fmod", 0) else np.mod)(a, b)


@register("BitShift", versions=(11, 28))
class BitShift(_Binary):
    def check(self) -> None:
        if self.attr("direction") not in ("LEFT", "RIGHT"):
            self.unsupported(f"direction={self.attr('direction')!r}")

    def compute(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        shift = np.left_shift if self.attr("direction") == "LEFT" else np.right_shift
        return shift(a, b.astype(a.dtype, copy=False))


# --------------------------------------------------------------------------------------------
# Variadic ops, Where, Clip, Identity
# --------------------------------------------------------------------------------------------
class _Variadic(Op):
    """Folds its inputs with ``fn`` (broadcasting); Mean then divides by their count."""

    fn: ClassVar[Callable[[np.ndarray, np.ndarray], np.ndarray]]
    mean: ClassVar[bool] = False

    def run(self, *xs: np.ndarray) -> np.ndarray:
        dtype = xs[0].dtype
        with np.errstate(all="ignore"):
            out = functools.reduce(type(self).fn, xs)
            if self.mean:
                out = np.divide(out, np.asarray(len(xs), dtype))
        return np.asarray(out).astype(dtype, copy=False)


for _name, _fn, _versions in (
    ("Sum", np.add, (1, 6, 8, 13)),
    ("Mean", np.add, (1, 6, 8, 13)),
    ("Max", np.maximum, (1, 6, 8, 12, 13)),
    ("Min", np.minimum, (1, 6, 8, 12, 13)),
):
    register(_name, _versions)(type(_name, (_Variadic,), {
        "fn": staticmethod(_fn), "mean": _name == "Mean",
        "__doc__": f"ONNX {_name} of any number of inputs, with broadcasting."}))


@register("Where", versions=(9, 16))
class Where(Op):
    def run(self, cond: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.asarray(np.where(cond.astype(bool, copy=False), x, y)).astype(x.dtype, copy=False)


@register("Clip", versions=(1, 6, 11, 12, 13))
class Clip(Op):
    """Bounds are attributes before opset 11, optional inputs since; either may be absent."""

    def run(self, x: np.ndarray, lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> np.ndarray:
        return self.run_inplace(np.array(x, copy=True), lo, hi)

    def run_inplace(self, x: np.ndarray, lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> np.ndarray:
        if self.version < 11:
            lo, hi = self.attr("min", None), self.attr("max", None)
        with np.errstate(over="ignore"):  # e.g. a float32-lowest bound on a float16 tensor
            if lo is not None:
                np.maximum(x, np.asarray(lo).astype(x.dtype), out=x)
            if hi is not None:  # applied last: min > max gives max everywhere, as ONNX specifies
                np.minimum(x, np.asarray(hi).astype(x.dtype), out=x)
        return x


@register("Identity", versions=(1, 13, 14, 16, 19, 21, 23, 24, 25))
class Identity(Op):
    def run(self, x: Any) -> Any:
        return x  # also passes sequences and optionals through unchanged


# --------------------------------------------------------------------------------------------
# Cast, CastLike
# --------------------------------------------------------------------------------------------
def _from_strings(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Parse numeric strings ("1e-5", "INF", "-inf", "NaN" included: float() accepts them all)."""
    text = np.asarray([s.decode() if isinstance(s, bytes) else str(s) for s in x.ravel()], dtype=np.str_)
    if dtype.kind in "iu":
        try:  # exact for integers beyond float64's 53 bits; "2.5" falls back to truncation
            return text.astype(dtype).reshape(x.shape)
        except ValueError:
            pass
    values = text.astype(np.float64).reshape(x.shape)
    return values != 0 if dtype == np.bool_ else cast_array(values, dtype)


def _to_e8m0(x: np.ndarray, saturate: bool, round_mode: str) -> np.ndarray:
    """Cast to float8e8m0 (a bare power-of-two exponent, bias 127, 0xFF = NaN)."""
    v = np.abs(x.astype(np.float64))  # negative inputs are undefined behaviour: use the magnitude
    mantissa, exponent = np.frexp(v)  # v = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - 1  # floor(log2 v): the "down" rounding
    if round_mode == "up":
        exponent = exponent + (mantissa != 0.5)
    elif round_mode == "nearest":  # ties (mantissa 0.75) round up
        exponent = exponent + (mantissa >= 0.75)
    biased = exponent.astype(np.int64) + 127
    if saturate:  # 0 and tiny values become the smallest power, inf and huge ones the largest
        biased = np.where(v == 0, 0, np.where(np.isinf(v), 254, np.clip(biased, 0, 254)))
        nan = np.isnan(v)
    else:
        nan = ~np.isfinite(v) | (v == 0) | (biased < 0) | (biased > 254)
    bits = np.where(nan, 255, biased).astype(np.uint8)
    return bits.view(_E8M0)


def cast_array(x: np.ndarray, dtype: np.dtype, *, saturate: bool = True, round_mode: str = "up") -> np.ndarray:
    """Cast ``x`` to ``dtype`` with ONNX Cast semantics (float8 saturation, e8m0 rounding, strings)."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if dtype == object:  # numbers to strings: plain decimal representations
        return x.astype(np.str_).astype(object)
    if x.dtype == object:
        return _from_strings(x, dtype)
    with np.errstate(all="ignore"):
        if dtype == _E8M0:
            return _to_e8m0(x, saturate, round_mode)
        if saturate and dtype in _SATURABLE:
            src = x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)
            limit = float(ml_dtypes.finfo(dtype).max)
            return np.clip(src, -limit, limit).astype(dtype)  # NaN stays NaN, ±inf becomes ±max
        return x.astype(dtype)


class _CastBase(Op):
    def check(self) -> None:
        if self.attr("round_mode", "up") not in ("up", "down", "nearest"):
            self.unsupported(f"round_mode={self.attr('round_mode')!r}")

    def cast(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return cast_array(x, dtype, saturate=bool(self.attr("saturate", 1)), round_mode=self.attr("round_mode", "up"))


@register("Cast", versions=(1, 6, 9, 13, 19, 21, 23, 24, 25, 28))
class Cast(_CastBase):
    def check(self) -> None:
        super().check()
        to = self.attr("to")
        try:  # opset 1 names the type ("FLOAT"), later opsets give the TensorProto enum value
            code = TensorProto.DataType.Value(to.upper()) if isinstance(to, str) else int(to)
            self.dtype = onnx_to_numpy(code)
        except (ValueError, ModelLoadError):
            self.unsupported(f"to={to!r}")

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.cast(x, self.dtype)


@register("CastLike", versions=(15, 19, 21, 23, 24, 25))
class CastLike(_CastBase):
    def run(self, x: np.ndarray, like: np.ndarray) -> np.ndarray:
        return self.cast(x, like.dtype)
