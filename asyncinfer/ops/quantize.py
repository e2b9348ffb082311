"""Quantization kernels: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, the integer and
QLinear matmuls and convs, and BitCast.

Integer products are computed in floating point so that BLAS does the work: a dot product of K
(zero-point shifted) 8-bit values is an exact float32 integer while K times the largest product
stays below 2**24, whatever the order BLAS sums in. Matmuls cut K into chunks that short (at least
258 terms; 1028 for the 7-bit weights of ``reduce_range``), multiply each in float32 and add the
exact chunk sums in int64; convs multiply in float32 where that bound holds for the whole window
and in float64 otherwise, exact far beyond any real K. The exact sums are then wrapped to int32,
as ONNX lets accumulators overflow only there. Weights that are model constants are shifted and
converted once, when first used, and kept (`Op.derived`): float32 copies of int8 weights, four
times their bytes, rather than a conversion every run.
Requantization follows ONNX Runtime: ``round_half_even(acc * (a_scale * b_scale / y_scale)) + zp``
in float32, then saturation to the output type.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..dtypes import onnx_to_numpy
from ..errors import ModelLoadError
from .base import Op
from .conv import Conv
from .elementwise import cast_array
from .linalg import matmul
from .registry import register
from .shape import normalize_axis, op_error

_QUANTIZE_VERSIONS = (10, 13, 19, 21, 23, 24, 25, 28)
_FLOATS = frozenset(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))
# Quantized float types: float8 obeys ``saturate``; float4/float6 have no inf, so they always saturate.
_FLOAT8 = frozenset(np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
                                          ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz))
_ALWAYS_SATURATED = frozenset(np.dtype(t) for t in (ml_dtypes.float4_e2m1fn, ml_dtypes.float6_e2m3fn,
                                                    ml_dtypes.float6_e3m2fn))
_FLOAT32_EXACT_INTEGERS = 2 ** 24  # every integer up to this is a float32


# -- shared helpers ----------------------------------------------------------------------------------
def _int_range(dtype: np.dtype) -> tuple[int, int] | None:
    """``(min, max)`` of an integer type (int4/int2 through ml_dtypes), None for float types."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return int(info.min), int(info.max)
    try:
        info = ml_dtypes.iinfo(dtype)
    except (TypeError, ValueError):
        return None
    return int(info.min), int(info.max)


def _wide(x: np.ndarray) -> np.ndarray:
    """``x`` in a type with exact arithmetic on its values: int64 for integers, float32 or wider for floats."""
    if _int_range(x.dtype) is not None:
        return x.astype(np.int64)
    return x.astype(np.float64 if x.dtype == np.float64 else np.float32)


def to_quantized(v: np.ndarray, zero_point: np.ndarray | float, dtype: np.dtype, saturate: bool = True) -> np.ndarray:
    """``saturate(round(v) + zero_point)`` in ``dtype``: integers round half to even before the zero
    point is added (adding an odd zero point first would flip ties), floats round in the cast."""
    dtype = np.dtype(dtype)
    limits = _int_range(dtype)
    v = np.asarray(v)
    work = np.float64 if v.dtype == np.float64 else np.float32
    with np.errstate(all="ignore"):
        if limits is not None:
            q = np.rint(v).astype(work, copy=False) + np.asarray(zero_point).astype(work)
            return np.clip(q, *limits).astype(dtype)
        q = v.astype(work, copy=False) + np.asarray(zero_point).astype(work)
        if dtype in _ALWAYS_SATURATED:
            limit = float(ml_dtypes.finfo(dtype).max)
            return np.clip(q, -limit, limit).astype(dtype)
        return cast_array(q, dtype, saturate=saturate)


def _attr_dtype(op: Op, name: str) -> np.dtype | None:
    """The element type named by an integer attribute (0 or absent: None); unknown types are refused."""
    code = int(op.attr(name, 0))
    if not code:
        return None
    try:
        return onnx_to_numpy(code)
    except ModelLoadError:
        op.unsupported(f"{name}={code}")
    return None


def _expand_param(op: Op, p: np.ndarray, shape: tuple[int, ...], axis: int, block_size: int) -> np.ndarray:
    """A scale or zero point shaped to broadcast against an input of ``shape``: per tensor (one
    value), per axis (1-D along ``axis``) or blocked (each value repeated ``block_size`` times).
    ``axis`` is only checked when used: per-tensor parameters of a 1-D input keep the default axis 1."""
    if p.size == 1 and block_size <= 0:
        return p.reshape(())
    axis = normalize_axis(op, axis, len(shape))
    if block_size > 0:
        blocks = -(-shape[axis] // block_size)
        if p.shape != shape[:axis] + (blocks,) + shape[axis + 1:]:
            raise op_error(op, f"parameter shape {p.shape} does not match input shape {shape} with "
                               f"block_size={block_size} on axis {axis}")
        return np.repeat(p, block_size, axis=axis)[(slice(None),) * axis + (slice(0, shape[axis]),)]
    if p.ndim == 1 and p.shape[0] == shape[axis]:
        return p.reshape((1,) * axis + (-1,) + (1,) * (len(shape) - axis - 1))
    raise op_error(op, f"parameter of shape {p.shape} is neither per-tensor nor per-axis for input {shape} "
                       f"(axis {axis})")


class _Granular(Op):
    """Per-tensor / per-axis / blocked parameter handling shared by QuantizeLinear and DequantizeLinear."""

    def check(self) -> None:
        if int(self.attr("block_size", 0)) < 0:
            self.unsupported(f"block_size={self.attr('block_size')}")

    def params(self, x: np.ndarray, *params: np.ndarray | None) -> list[np.ndarray | None]:
        axis, block = int(self.attr("axis", 1)), int(self.attr("block_size", 0))
        return [None if p is None else _expand_param(self, p, x.shape, axis, block) for p in params]


@register("QuantizeLinear", versions=_QUANTIZE_VERSIONS)
class QuantizeLinear(_Granular):
    """``y = saturate(round_half_even(x / y_scale) + y_zero_point)``; float targets round in the cast."""

    def check(self) -> None:
        super().check()
        self.output_dtype = _attr_dtype(self, "output_dtype")
        self.precision = _attr_dtype(self, "precision")
        dtype = self.output_dtype
        if dtype is not None and _int_range(dtype) is None and dtype not in _FLOAT8 | _ALWAYS_SATURATED:
            self.unsupported(f"output_dtype={self.output_dtype.name}")

    def run(self, x: np.ndarray, y_scale: np.ndarray, y_zero_point: np.ndarray | None = None) -> np.ndarray:
        dtype = self.output_dtype or (y_zero_point.dtype if y_zero_point is not None else np.dtype(np.uint8))
        scale, zp = self.params(x, y_scale, y_zero_point)
        # Opset 23 made the scale's type (or ``precision``) the division's precision; before, it was
        # unspecified and runtimes divide in float32.
        precision = self.precision or (scale.dtype if self.version >= 23 else np.dtype(np.float32))
        if precision not in _FLOATS:  # integer or e8m0 scales: divide in a float type that holds them
            precision = np.dtype(np.float64 if precision.kind in "iu" else np.float32)
        with np.errstate(all="ignore"):
            v = np.divide(x.astype(precision, copy=False), scale.astype(precision, copy=False))
        return to_quantized(v, 0 if zp is None else zp, dtype, bool(self.attr("saturate", 1)))


@register("DequantizeLinear", versions=_QUANTIZE_VERSIONS)
class DequantizeLinear(_Granular):
    """``y = (x - x_zero_point) * x_scale``, multiplied in the output type (output_dtype, else the scale's)."""

    def check(self) -> None:
        super().check()
        self.output_dtype = _attr_dtype(self, "output_dtype")
        if self.output_dtype is not None and self.output_dtype not in _FLOATS:
            self.unsupported(f"output_dtype={self.output_dtype.name}")

    def run(self, x: np.ndarray, x_scale: np.ndarray, x_zero_point: np.ndarray | None = None) -> np.ndarray:
        dtype = self.output_dtype or (x_scale.dtype if x_scale.dtype in _FLOATS else np.dtype(np.float32))
        scale, zp = self.params(x, x_scale, x_zero_point)
        diff = _wide(x) if zp is None else _wide(x) - _wide(zp)
        with np.errstate(all="ignore"):
            return np.multiply(diff.astype(dtype), scale.astype(dtype))


@register("DynamicQuantizeLinear", versions=(11,))
class DynamicQuantizeLinear(Op):
    """uint8 quantization with scale and zero point from the data's range (extended to include 0)."""

    def run(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo = np.minimum.reduce(x, axis=None, initial=0.0).astype(np.float32)
        hi = np.maximum.reduce(x, axis=None, initial=0.0).astype(np.float32)
        scale = np.float32((hi - lo) / np.float32(255))
        if scale == 0:  # all zeros: every value, and the zero point, quantize to 0
            return np.zeros(x.shape, np.uint8), np.array(scale), np.array(0, np.uint8)
        zp = np.rint(np.clip(-lo / scale, 0, 255)).astype(np.uint8)
        with np.errstate(all="ignore"):
            y = to_quantized(x.astype(np.float32, copy=False) / scale, zp, np.uint8)
        return y, np.array(scale), np.array(zp)


# -- integer matmul / conv ---------------------------------------------------------------------------
def _wrap_int32(acc: np.ndarray) -> np.ndarray:
    """Exact integer-valued float sums → int32, wrapping around as a 32-bit accumulator would."""
    return acc.astype(np.int64).astype(np.int32)


def _row_param(p: np.ndarray | None) -> np.ndarray | None:
    """A per-row parameter of the left matmul operand: a 1-D vector applies along the rows (M, 1)."""
    return p.reshape(-1, 1) if p is not None and p.ndim == 1 and p.size > 1 else p


@dataclass(frozen=True)
class IntegerOperand:
    """An 8-bit matmul operand minus its zero point, as float32 for BLAS, and its largest magnitude."""

    values: np.ndarray
    bound: float


def integer_operand(x: np.ndarray, zero_point: np.ndarray | None) -> IntegerOperand:
    values = x.astype(np.float32)
    if zero_point is not None:
        values -= zero_point.astype(np.float32)
    return IntegerOperand(values, float(np.abs(values).max(initial=0.0)))


def _int_matmul(a: np.ndarray, a_zp: np.ndarray | None, b: np.ndarray, b_zp: np.ndarray | None,
                shifted_b: IntegerOperand | None = None) -> np.ndarray:
    """``(a - a_zp) @ (b - b_zp)`` accumulated exactly, wrapped to int32 (a_zp per row, b_zp per
    column); ``shifted_b``: ``integer_operand(b, b_zp)`` when the caller keeps it."""
    left = integer_operand(a, _row_param(a_zp))
    right = shifted_b if shifted_b is not None else integer_operand(b, b_zp)
    k = a.shape[-1]
    largest = left.bound * right.bound
    chunk = k if largest == 0 else int(_FLOAT32_EXACT_INTEGERS // largest)
    if chunk >= k:
        return _wrap_int32(matmul(left.values, right.values))
    acc: np.ndarray | None = None  # the exact sum of the chunks' exact sums
    for k0 in range(0, k, chunk):
        rows = slice(k0, k0 + chunk)
        part = matmul(left.values[..., rows], right.values[rows] if b.ndim == 1 else right.values[..., rows, :])
        acc = part.astype(np.int64) if acc is None else acc + part.astype(np.int64)
    return _wrap_int32(acc)


def _requantize(acc: np.ndarray, multiplier: np.ndarray, y_zp: np.ndarray) -> np.ndarray:
    """Scale int32 accumulators by ``multiplier`` (= in_scale * w_scale / y_scale) into y_zp's type."""
    with np.errstate(all="ignore"):
        return to_quantized(acc.astype(np.float32) * multiplier.astype(np.float32), y_zp, y_zp.dtype)


@register("MatMulInteger", versions=(10,))
class MatMulInteger(Op):
    multithreaded = True  # GEMM in BLAS

    def run(self, a: np.ndarray, b: np.ndarray, a_zero_point: np.ndarray | None = None,
            b_zero_point: np.ndarray | None = None) -> np.ndarray:
        shifted_b = self.derived("b", {1: b, 3: b_zero_point}, lambda: integer_operand(b, b_zero_point))
        return _int_matmul(a, a_zero_point, b, b_zero_point, shifted_b)


@register("QLinearMatMul", versions=(10, 21))
class QLinearMatMul(Op):
    """Quantized matmul. 8-bit integers: exact int32 accumulation then requantization; float8
    operands (opset 21): dequantize, float32 matmul, quantize with saturation."""

    multithreaded = True  # GEMM in BLAS

    def run(self, a: np.ndarray, a_scale: np.ndarray, a_zero_point: np.ndarray, b: np.ndarray, b_scale: np.ndarray,
            b_zero_point: np.ndarray, y_scale: np.ndarray, y_zero_point: np.ndarray) -> np.ndarray:
        f32 = np.float32
        a_scale = _row_param(a_scale).astype(f32)
        b_scale = b_scale.astype(f32)
        if _int_range(a.dtype) is not None and _int_range(b.dtype) is not None:
            shifted_b = self.derived("b", {3: b, 5: b_zero_point}, lambda: integer_operand(b, b_zero_point))
            acc = _int_matmul(a, a_zero_point, b, b_zero_point, shifted_b)
            return _requantize(acc, a_scale * b_scale / y_scale.astype(f32), y_zero_point)
        real_a = (_wide(a) - _wide(_row_param(a_zero_point))).astype(f32) * a_scale
        real_b = (_wide(b) - _wide(b_zero_point)).astype(f32) * b_scale
        with np.errstate(all="ignore"):
            return to_quantized(np.matmul(real_a, real_b) / y_scale.astype(f32), y_zero_point, y_zero_point.dtype)


class _IntegerConv(Conv):
    """The float Conv kernel on zero-point shifted operands, accumulated exactly into int32."""

    def accumulate(self, x: np.ndarray, x_zp: np.ndarray | None, w: np.ndarray, w_zp: np.ndarray | None,
                   w_inputs: tuple[int, int]) -> np.ndarray:
        """The int32 accumulators; ``w_inputs``: the input indices of ``w`` and its zero point."""
        if x_zp is not None and x_zp.size != 1:
            raise op_error(self, f"x zero point must be a scalar, got shape {x_zp.shape}")
        terms = math.prod(w.shape[1:])
        given_w = dict(zip(w_inputs, (w, w_zp)))

        def shifted_w() -> IntegerOperand:
            per_channel = (w.shape[0],) + (1,) * (w.ndim - 1)  # a 1-D w parameter is per output channel
            return integer_operand(w, None if w_zp is None else w_zp.reshape(per_channel if w_zp.size > 1 else ()))
        weights = self.derived("w", given_w, shifted_w)
        data = integer_operand(x, x_zp)
        if terms * data.bound * weights.bound < _FLOAT32_EXACT_INTEGERS:  # every sum an exact float32
            return _wrap_int32(super().run(data.values, weights.values))
        wide = self.derived("w64", given_w, lambda: weights.values.astype(np.float64))
        return _wrap_int32(super().run(data.values.astype(np.float64), wide))


@register("ConvInteger", versions=(10,))
class ConvInteger(_IntegerConv):
    def run(self, x: np.ndarray, w: np.ndarray, x_zero_point: np.ndarray | None = None,
            w_zero_point: np.ndarray | None = None) -> np.ndarray:
        return self.accumulate(x, x_zero_point, w, w_zero_point, (1, 3))


@register("QLinearConv", versions=(10,))
class QLinearConv(_IntegerConv):
    def run(self, x: np.ndarray, x_scale: np.ndarray, x_zero_point: np.ndarray, w: np.ndarray,
            w_scale: np.ndarray, w_zero_point: np.ndarray, y_scale: np.ndarray, y_zero_point: np.ndarray,
            b: np.ndarray | None = None) -> np.ndarray:
        acc = self.accumulate(x, x_zero_point, w, w_zero_point, (3, 5))
        if b is not None:
            acc += b.reshape((-1,) + (1,) * (acc.ndim - 2)).astype(np.int32)  # wraps like the accumulator
        channel = (1, -1) + (1,) * (acc.ndim - 2)
        w_scale = w_scale.astype(np.float32).reshape(channel if w_scale.size > 1 else ())
        multiplier = x_scale.astype(np.float32) * w_scale / y_scale.astype(np.float32)
        return _requantize(acc, multiplier, y_zero_point)


# -- BitCast -------------------------------------------------------------------------------------------
def _bit_width(dtype: np.dtype) -> int:
    """Bits of one element as ONNX counts them (int4/float4 are 4 bits though stored in a byte)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "V":
        try:
            return int(ml_dtypes.iinfo(dtype).bits)
        except (TypeError, ValueError):
            return int(ml_dtypes.finfo(dtype).bits)
    return dtype.itemsize * 8


@register("BitCast", versions=(26,))
class BitCast(Op):
    """Reinterpret the bits of each element (same bit width, little endian) as the type ``to``."""

    def check(self) -> None:
        try:
            self.dtype = onnx_to_numpy(int(self.attr("to")))
        except ModelLoadError:
            self.unsupported(f"to={self.attr('to')}")
        if self.dtype == object:
            self.unsupported("to=STRING")

    def run(self, x: np.ndarray) -> np.ndarray:
        bits = _bit_width(x.dtype)
        if bits != _bit_width(self.dtype) or x.dtype == object:
            raise op_error(self, f"cannot bitcast {x.dtype} ({bits} bits) to {self.dtype} "
                                 f"({_bit_width(self.dtype)} bits)")
        if bits < 8:  # sub-byte types sit in the low bits of a byte each
            return (x.view(np.uint8) & np.uint8((1 << bits) - 1)).view(self.dtype)
        return x.view(self.dtype)  # same item size: a view works whatever the layout
