"""Element-wise kernels: IsInf, Where, Clip, Identity, Cast, and the numerics element-wise ops share.

The unary, binary and variadic element-wise ops (math, activations, arithmetic, comparisons,
logic, bitwise, Sum/Mean/Max/Min) are generated from the tables of `.pointwise`; this module
holds what they share: `compute_dtype`, `float_kernel`, `erf`. Every kernel
returns the dtype ONNX specifies: results are cast back wherever NumPy would promote, and narrow
floats (float16, bfloat16…) are evaluated in float32, which NumPy computes faster and more accurately.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


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
    """Wrap ``fn(x, ...)``: evaluate narrow floats in float32 and return x's dtype (the cast back
    also turns NumPy scalars, from 0-d inputs, into arrays)."""

    @functools.wraps(fn)
    def kernel(x: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        y = fn(x.astype(compute_dtype(x.dtype), copy=False), *args, **kwargs)
        return np.asarray(y).astype(x.dtype, copy=False)

    return kernel


# --------------------------------------------------------------------------------------------
# The error function (the unary ops themselves are generated from the table in .pointwise)
# --------------------------------------------------------------------------------------------
# erf(x) = x·P(x²)/Q(x²) on |x| <= 3.92 (beyond, erf rounds to ±1 in float32): a (5, 5)
# rational fitted for relative error (max 3.6e-7, 6 ulp, over all float32; exact to 1e-8 for tiny x).
# 24 vectorised passes over float32 memory, 3x faster than SciPy's erf on float32 (which computes
# in double precision element by element) and 1.7x faster than A&S 7.1.26 with a Taylor patch.
_ERF_CLAMP = 3.92
_ERF_P = (1.1283791569898718, 0.18577824174788404, 0.05222976650947401, 0.0035919333750284495,
          0.0002853718973293063, 2.1443608542853606e-06)  # z⁰ … z⁵
_ERF_Q = (1.0, 0.4979747102451101, 0.11228065536922728, 0.014618679120029301, 0.0011285402202237129,
          3.909094190376094e-05)


def erf_float32(x: np.ndarray) -> np.ndarray:
    """erf of a float32 array, computed in float32 (GELU's hot spot): the rational above.
    NaN stays NaN, ±inf gives ±1, -0.0 gives -0.0."""
    f32 = np.float32
    a = np.clip(x, f32(-_ERF_CLAMP), f32(_ERF_CLAMP))
    z = np.square(a)
    p = z * f32(_ERF_P[5])
    p += f32(_ERF_P[4])
    q = z * f32(_ERF_Q[5])
    q += f32(_ERF_Q[4])
    for k in (3, 2, 1, 0):
        p *= z
        p += f32(_ERF_P[k])
        q *= z
        q += f32(_ERF_Q[k])
    p *= a
    np.divide(p, q, out=p)
    return np.clip(p, f32(-1), f32(1), out=p)  # the fit overshoots 1 by an ulp near the clamp


def _erf_float64(x: np.ndarray) -> np.ndarray:
    """erf in float64 without SciPy: Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7)."""
    a = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-a * a))


@functools.cache
def _scipy_erf() -> Callable[[np.ndarray], np.ndarray] | None:
    """SciPy's erf, exact to double precision, or None without SciPy (optional, not a
    dependency). Imported at the first float64 erf: SciPy costs every process 13 MB and 70 ms
    at import, and float32 models never call it."""
    try:
        from scipy.special import erf as scipy_erf
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return scipy_erf


def erf(x: np.ndarray) -> np.ndarray:
    """Element-wise error function: float32 (and narrower floats, which come as float32) in
    float32 by `erf_float32`; float64 exactly with SciPy, else to 1.5e-7 absolute."""
    if x.dtype == np.float32:
        return erf_float32(x)
    exact = _scipy_erf()
    return exact(x) if exact is not None else _erf_float64(x)


@register("IsInf", versions=(10, 20))
class IsInf(Op):
    def run(self, x: np.ndarray) -> np.ndarray:
        pos, neg = self.attr("detect_positive"), self.attr("detect_negative")
        return np.isinf(x) & (((x > 0) & bool(pos)) | ((x < 0) & bool(neg)))


# --------------------------------------------------------------------------------------------
# Where, Clip, Identity (binary and variadic ops are generated from the table in .pointwise)
# --------------------------------------------------------------------------------------------
@register("Where", versions=(9, 16))
class Where(Op):
    def run(self, cond: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.asarray(np.where(cond.astype(bool, copy=False), x, y)).astype(x.dtype, copy=False)


def clip_bounds(op: Op, lo: Any = None, hi: Any = None) -> tuple[Any, Any]:
    """Clip's bounds as host scalars, None where absent: the ``min``/``max`` attributes before
    opset 11, the optional inputs ``lo``/``hi`` since. Shared by the CPU op and the device kernels."""
    if op.version < 11:
        return op.attr("min", None), op.attr("max", None)  # absent: no bound (not the schema's ±FLT_MAX)
    return (None if lo is None else np.asarray(lo).reshape(-1)[0],
            None if hi is None else np.asarray(hi).reshape(-1)[0])


@register("Clip", versions=(1, 6, 11, 12, 13))
class Clip(Op):
    """Bounds are attributes before opset 11, optional inputs since; either may be absent."""

    def run(self, x: np.ndarray, lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> np.ndarray:
        return self.run_inplace(np.array(x, copy=True), lo, hi)

    def run_inplace(self, x: np.ndarray, lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> np.ndarray:
        lo, hi = clip_bounds(self, lo, hi)
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


#: The float types every integer (and bool) converts to without overflow.
_WIDE_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


def cast_array(x: np.ndarray, dtype: np.dtype, *, saturate: bool = True, round_mode: str = "up") -> np.ndarray:
    """Cast ``x`` to ``dtype`` with ONNX Cast semantics (float8 saturation, e8m0 rounding, strings)."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if x.dtype.kind in "biu" and dtype in _WIDE_FLOATS:  # (a mask's ints to float: nothing to saturate,
        return x.astype(dtype)                         # round or warn of; a Cast 1.8 -> 0.8 µs)
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
