"""The ``com.microsoft`` quantized ops: the QOperator ops ``onnxruntime.quantization`` writes
(QLinearAdd, QLinearMul, QLinearGlobalAveragePool, QLinearAveragePool, QLinearConcat,
QLinearSigmoid, QLinearLeakyRelu, QLinearSoftmax, QGemm, and QLinearConv, which ORT's NHWC
transformer writes with ``channels_last``), the quantized matmuls ORT's optimizer
fuses (DynamicQuantizeMatMul, MatMulIntegerToFloat), the quantized BERT fusions (QAttention,
QEmbedLayerNormalization) and weight-only ``MatMulNBits``.

Two kinds of arithmetic, each written once:

- **Integer matmuls** (QGemm, DynamicQuantizeMatMul, MatMulIntegerToFloat, QLinearConv) reuse the ONNX domain's
  exact int32 accumulation (`asyncinfer.ops.quantize`) and its requantization, as ORT defines it:
  ``round_half_even(float32(acc) * multiplier) + zero_point`` with the multiplier computed in
  float32, then saturation; float outputs are ``float32(acc) * scale (+ bias)``.
- **Everything else** follows the definition "dequantize, compute, quantize": the dequantized
  values ``(x - zero_point) * scale`` are exact in float64, the op is computed in float64, and the
  result ``v / y_scale`` is rounded half to even, offset by the zero point and saturated. Where an
  op is a ratio (the pools, Concat) numerator and denominator are exact and divided once, so the
  rounding is that of the exact value. 8-bit unary ops (Sigmoid, LeakyRelu) build the 256-entry
  table of that computation and index it.

Where ORT's CPU kernels compute differently the results may differ from ORT by one quantization
step; the kernels follow the definition. Known differences: QLinearSoftmax in ORT uses
``floor(1 / y_scale)`` as the output scale and integer-truncated exponentials; its int8 path does
not saturate at 127; and without an ``axis`` attribute ORT normalises along the last axis even
for ``opset`` < 13, where the definition (and the float Softmax it replaces) flattens at axis 1. QAttention and QEmbedLayerNormalization dequantize their inputs and run the
float ``com.microsoft`` Attention / EmbedLayerNormalization kernels, so those semantics live in one
place. MatMulNBits ignores ``accuracy_level`` (ORT may quantize ``A`` to int8 for levels 4 and
up); it always dequantizes the weights and multiplies in float32.
"""
from __future__ import annotations

import functools

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ...model.ir import Layer
from ..base import Op
from ..windows import spatial_attrs
from ..pool import AveragePool, _window_counts
from ..quantize import DynamicQuantizeLinear, QLinearConv, _int_matmul, _requantize, integer_operand, to_quantized
from ..registry import create, register
from ..schema import declare_defaults
from ..shape import normalize_axis, op_error
from ..softmax import _softmax
from . import MS_DOMAIN

_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))


# -- shared helpers ------------------------------------------------------------------------------------
def _scalar(op: Op, p: np.ndarray, what: str) -> np.ndarray:
    """A per-tensor parameter as a 0-d array; anything but one element is an error naming ``what``."""
    p = np.asarray(p)
    if p.size != 1:
        raise op_error(op, f"{what} must be a scalar (per-tensor), got shape {p.shape}")
    return p.reshape(())


def _eight_bit(op: Op, x: np.ndarray, what: str) -> None:
    if x.dtype not in _EIGHT_BIT:
        raise op_error(op, f"{what} must be uint8 or int8, got {x.dtype}")


def _zero_point(op: Op, zp: np.ndarray | None, dtype: np.dtype, what: str) -> np.ndarray:
    """A per-tensor zero point of ``dtype`` (0 when omitted)."""
    if zp is None:
        return np.zeros((), dtype)
    zp = _scalar(op, zp, what)
    if zp.dtype != dtype:
        raise op_error(op, f"{what} has type {zp.dtype}, expected {np.dtype(dtype)}")
    return zp


def _real(x: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> np.ndarray:
    """Dequantized values in float64, exact: an 8-bit difference times a float32 scale."""
    return (x.astype(np.int64) - np.int64(zp)).astype(np.float64) * np.float64(scale)


def _ratio(num: np.ndarray, den: np.ndarray | float, y_zp: np.ndarray) -> np.ndarray:
    """``saturate(round_half_even(num / den) + y_zp)`` in float64, in y_zp's type: with an exact
    numerator and denominator, the one rounding of the exact quotient."""
    with np.errstate(all="ignore"):
        return to_quantized(np.asarray(num, np.float64) / den, y_zp, y_zp.dtype)


def _quantize(v: np.ndarray, y_scale: np.ndarray, y_zp: np.ndarray) -> np.ndarray:
    """``saturate(round_half_even(v / y_scale) + y_zp)`` with ``v`` in float64."""
    return _ratio(v, np.float64(y_scale), y_zp)


def _per_column(op: Op, p: np.ndarray | None, n: int, what: str) -> np.ndarray | None:
    """A per-tensor (one value) or per-column (``n`` values, along the last axis) parameter."""
    if p is None:
        return None
    p = np.asarray(p)
    if p.size == 1:
        return p.reshape(())
    if p.ndim == 1 and p.shape[0] == n:
        return p
    raise op_error(op, f"{what} must be a scalar or a 1-D tensor of {n} values (one per column), got shape {p.shape}")


def _nested(op: Op, op_type: str, version: int, inputs: list[str], attrs: dict[str, Any],
            domain: str = "") -> Op:
    """The registered kernel of ``op_type`` for a layer that ``op`` runs inside itself (created once,
    at worker creation, so an unsupported attribute is refused there)."""
    layer = Layer(name=f"{op.layer.name}/{op_type}", op_type=op_type, inputs=inputs,
                  outputs=list(op.layer.outputs), attrs=attrs, domain=domain, version=version)
    return create(layer, op.limits)


def _table(op: Op, x: np.ndarray, fn: Callable[[np.ndarray], np.ndarray], x_scale: np.ndarray, x_zp: np.ndarray | None, y_scale: np.ndarray,
           y_zp: np.ndarray | None) -> np.ndarray:
    """``quantize(fn(dequantize(x)))`` for an 8-bit ``x`` through a 256-entry table of every code."""
    _eight_bit(op, x, "X")
    x_scale, y_scale = _scalar(op, x_scale, "X_scale"), _scalar(op, y_scale, "Y_scale")
    x_zp = _zero_point(op, x_zp, x.dtype, "X_zero_point")
    y_zp = _zero_point(op, y_zp, x.dtype, "Y_zero_point")
    codes = np.arange(256, dtype=np.uint8).view(x.dtype)  # every value, indexed by its byte
    with np.errstate(all="ignore"):
        table = _quantize(fn(_real(codes, x_scale, x_zp)), y_scale, y_zp)
    return table[x.view(np.uint8)]


# -- element-wise binary ------------------------------------------------------------------------------
class _QLinearBinary(Op):
    """``C = quantize(f(dequantize(A), dequantize(B)))`` with NumPy broadcasting."""

    def combine(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def run(self, a: np.ndarray, a_scale: np.ndarray, a_zp: np.ndarray | None, b: np.ndarray,
            b_scale: np.ndarray, b_zp: np.ndarray | None, c_scale: np.ndarray,
            c_zp: np.ndarray | None = None) -> np.ndarray:
        _eight_bit(self, a, "A")
        if b.dtype != a.dtype:
            raise op_error(self, f"A and B must have the same type, got {a.dtype} and {b.dtype}")
        try:
            np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            raise op_error(self, f"shapes {a.shape} and {b.shape} do not broadcast") from None
        c_zp = _zero_point(self, c_zp, a.dtype, "C_zero_point")
        real_a = _real(a, _scalar(self, a_scale, "A_scale"), _zero_point(self, a_zp, a.dtype, "A_zero_point"))
        real_b = _real(b, _scalar(self, b_scale, "B_scale"), _zero_point(self, b_zp, a.dtype, "B_zero_point"))
        return _quantize(self.combine(real_a, real_b), _scalar(self, c_scale, "C_scale"), c_zp)


@register("QLinearAdd", versions=(1,), domain=MS_DOMAIN)
class QLinearAdd(_QLinearBinary):
    """``C = (A_scale (A - A_zp) + B_scale (B - B_zp)) / C_scale + C_zp``."""

    def combine(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b


@register("QLinearMul", versions=(1,), domain=MS_DOMAIN)
class QLinearMul(_QLinearBinary):
    """``C = A_scale B_scale (A - A_zp)(B - B_zp) / C_scale + C_zp``."""

    def combine(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a * b


# -- element-wise unary -------------------------------------------------------------------------------
@register("QLinearSigmoid", versions=(1,), domain=MS_DOMAIN)
class QLinearSigmoid(Op):
    """``Y = quantize(sigmoid(dequantize(X)))``."""

    def run(self, x: np.ndarray, x_scale: np.ndarray, x_zp: np.ndarray | None, y_scale: np.ndarray,
            y_zp: np.ndarray | None = None) -> np.ndarray:
        return _table(self, x, lambda v: 1.0 / (1.0 + np.exp(-v)), x_scale, x_zp, y_scale, y_zp)


@register("QLinearLeakyRelu", versions=(1,), domain=MS_DOMAIN)
class QLinearLeakyRelu(Op):
    """``Y = quantize(alpha * X if X < 0 else X)`` on the dequantized X."""

    def run(self, x: np.ndarray, x_scale: np.ndarray, x_zp: np.ndarray | None, y_scale: np.ndarray,
            y_zp: np.ndarray | None = None) -> np.ndarray:
        alpha = np.float64(np.float32(self.attr("alpha")))  # a float attribute is float32 in ONNX
        return _table(self, x, lambda v: np.where(v < 0, alpha * v, v), x_scale, x_zp, y_scale, y_zp)


@register("QLinearSoftmax", versions=(1,), domain=MS_DOMAIN)
class QLinearSoftmax(Op):
    """``Y = quantize(softmax(dequantize(X)))``. The ``opset`` attribute selects the Softmax
    semantics: before 13 the input is flattened to 2-D at ``axis`` (default 1) and each row is
    normalised; from 13 on, ``axis`` alone (default -1). The input zero point cancels out."""

    def check(self) -> None:
        self.opset = int(self.attr("opset"))
        # The axis default depends on the opset attribute, as Softmax's own did; ORT's kernel means
        # the same but its schema's default (-1) always wins (the module docstring says more).
        self.axis = int(self.attr("axis", 1 if self.opset < 13 else -1))

    def run(self, x: np.ndarray, x_scale: np.ndarray, x_zp: np.ndarray | None, y_scale: np.ndarray,
            y_zp: np.ndarray | None = None) -> np.ndarray:
        _eight_bit(self, x, "X")
        x_zp = _zero_point(self, x_zp, x.dtype, "x_zero_point")
        y_zp = _zero_point(self, y_zp, x.dtype, "y_zero_point")
        if x.ndim < 1:
            raise op_error(self, "X must have rank >= 1")
        axis = normalize_axis(self, self.axis, x.ndim)
        if x.size == 0:
            return np.empty(x.shape, x.dtype)
        real = _real(x, _scalar(self, x_scale, "X_scale"), x_zp)
        if self.opset < 13:
            rows = real.reshape(math.prod(x.shape[:axis]), -1)
            probs = _softmax(np, rows, 1).reshape(x.shape)
        else:
            probs = _softmax(np, real, axis)
        return _quantize(probs, _scalar(self, y_scale, "y_scale"), y_zp)


# -- pools and concat ---------------------------------------------------------------------------------
def _channels_last(op: Op) -> bool:
    value = int(op.attr("channels_last"))
    if value not in (0, 1):
        op.unsupported(f"channels_last={value}")
    return bool(value)


@register("QLinearGlobalAveragePool", versions=(1,), domain=MS_DOMAIN)
class QLinearGlobalAveragePool(Op):
    """Mean over the spatial axes of the dequantized input, quantized: (N, C, 1, …) or, with
    ``channels_last``, (N, 1, …, C)."""

    def check(self) -> None:
        self.nhwc = _channels_last(self)

    def run(self, x: np.ndarray, x_scale: np.ndarray, x_zp: np.ndarray, y_scale: np.ndarray,
            y_zp: np.ndarray) -> np.ndarray:
        _eight_bit(self, x, "X")
        if x.ndim < 3:
            raise op_error(self, f"X must have rank >= 3 (N, C, spatial...), got shape {x.shape}")
        x_zp = _zero_point(self, x_zp, x.dtype, "x_zero_point")
        y_zp = _zero_point(self, y_zp, x.dtype, "y_zero_point")
        axes = tuple(range(1, x.ndim - 1)) if self.nhwc else tuple(range(2, x.ndim))
        count = math.prod(x.shape[a] for a in axes)
        if count == 0:
            raise op_error(self, f"cannot average over empty spatial axes of shape {x.shape}")
        total = x.sum(axis=axes, keepdims=True, dtype=np.int64) - np.int64(count) * np.int64(x_zp)
        x_scale, y_scale = _scalar(self, x_scale, "x_scale"), _scalar(self, y_scale, "y_scale")
        return _ratio(total * np.float64(x_scale), np.float64(count) * np.float64(y_scale), y_zp)


@register("QLinearAveragePool", versions=(1,), domain=MS_DOMAIN)
class QLinearAveragePool(AveragePool):
    """AveragePool (kernel_shape, strides, pads, auto_pad, ceil_mode, count_include_pad as in
    ONNX) of the dequantized input, quantized; ``channels_last`` takes (N, spatial…, C)."""

    def check(self) -> None:
        super().check()
        self.nhwc = _channels_last(self)

    def run(self, x: np.ndarray, x_scale: np.ndarray, x_zp: np.ndarray | None, y_scale: np.ndarray,
            y_zp: np.ndarray | None = None) -> np.ndarray:
        _eight_bit(self, x, "X")
        if x.ndim < 3:
            raise op_error(self, f"X must have rank >= 3 (N, C, spatial...), got shape {x.shape}")
        x_zp = _zero_point(self, x_zp, x.dtype, "x_zero_point")
        y_zp = _zero_point(self, y_zp, x.dtype, "y_zero_point")
        if self.nhwc:
            x = np.moveaxis(x, -1, 1)
        shifted = x.astype(np.float64) - np.float64(x_zp)  # integers: window sums are exact
        total, begin, end, out = self.separable_reduce(shifted, np.add, 0)
        if total.size:
            kernel = [int(k) for k in self.attr("kernel_shape")]
            strides, dilations, _ = spatial_attrs(self, x.ndim - 2, kernel)
            counts = _window_counts(x.shape[2:], kernel, strides, dilations, begin, end, out,
                                    bool(self.attr("count_include_pad")))
            count = np.float64(math.prod(kernel)) if counts is None else counts
            x_scale, y_scale = _scalar(self, x_scale, "x_scale"), _scalar(self, y_scale, "y_scale")
            y = _ratio(total * np.float64(x_scale), count * np.float64(y_scale), y_zp)
        else:
            y = total.astype(x.dtype)
        return np.ascontiguousarray(np.moveaxis(y, 1, -1)) if self.nhwc else y


@register("QLinearConv", versions=(1,), domain=MS_DOMAIN)
class MsQLinearConv(QLinearConv):
    """ONNX's QLinearConv (the same kernel: exact int32 accumulation, then requantization) with
    ORT's ``channels_last``: X and Y are (N, spatial…, C) while W stays (M, C/group, kernel…), the
    layout ORT's NHWC transformer writes."""

    def check(self) -> None:
        super().check()
        self.nhwc = _channels_last(self)

    def run(self, x: np.ndarray, *rest: np.ndarray | None) -> np.ndarray:
        if not self.nhwc:
            return super().run(x, *rest)
        if x.ndim < 3:
            raise op_error(self, f"X must have rank >= 3 (N, spatial..., C), got shape {x.shape}")
        y = super().run(np.moveaxis(x, -1, 1), *rest)
        return np.ascontiguousarray(np.moveaxis(y, 1, -1))


@register("QLinearConcat", versions=(1,), domain=MS_DOMAIN)
class QLinearConcat(Op):
    """Concatenation of (tensor, scale, zero point) triples, each requantized to (Y_scale,
    Y_zero_point); a tensor already in the output's parameters is copied as it is."""

    def run(self, y_scale: np.ndarray, y_zp: np.ndarray, *triples: np.ndarray | None) -> np.ndarray:
        if not triples or len(triples) % 3:
            raise op_error(self, f"expected (tensor, scale, zero point) triples after Y_scale and Y_zero_point, "
                                 f"got {len(triples)} inputs")
        y_zp = _scalar(self, y_zp, "Y_zero_point")
        if y_zp.dtype not in _EIGHT_BIT:
            raise op_error(self, f"Y_zero_point must be uint8 or int8, got {y_zp.dtype}")
        y_scale = _scalar(self, y_scale, "Y_scale")
        parts = []
        for i in range(0, len(triples), 3):
            x, scale, zp = triples[i:i + 3]
            if x is None or scale is None or zp is None:
                raise op_error(self, f"input triple {i // 3} is incomplete")
            if x.dtype != y_zp.dtype:
                raise op_error(self, f"input {i // 3} has type {x.dtype}, expected {y_zp.dtype}")
            scale, zp = _scalar(self, scale, f"scale of input {i // 3}"), _zero_point(
                self, zp, x.dtype, f"zero point of input {i // 3}")
            if scale == y_scale and zp == y_zp:
                parts.append(x)
            else:
                parts.append(_ratio((x.astype(np.int64) - np.int64(zp)) * np.float64(scale), np.float64(y_scale), y_zp))
        rank = parts[0].ndim
        if any(p.ndim != rank for p in parts):
            raise op_error(self, f"inputs have different ranks: {[p.shape for p in parts]}")
        axis = normalize_axis(self, int(self.attr("axis")), rank)
        try:
            return np.concatenate(parts, axis=axis)
        except ValueError:
            raise op_error(self, f"shapes {[p.shape for p in parts]} cannot be concatenated on axis {axis}") from None


# -- integer matmuls ----------------------------------------------------------------------------------
def _matmul_operands(op: Op, a: np.ndarray, b: np.ndarray) -> None:
    """A and B as MatMul takes them: 8-bit, rank >= 1, inner dimensions equal."""
    _eight_bit(op, a, "A")
    _eight_bit(op, b, "B")
    if a.ndim < 1 or b.ndim < 1 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
        raise op_error(op, f"A {a.shape} and B {b.shape} cannot be multiplied")


def _scaled_output(acc: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, n: int, op: Op,
                   dtype: np.dtype = np.dtype(np.float32)) -> np.ndarray:
    """``float32(acc) * scale (+ bias)`` in ``dtype``: the float output of an integer matmul."""
    y = acc.astype(np.float32) * scale.astype(np.float32)
    if bias is not None:
        if bias.shape not in ((n,), (1,), ()):
            raise op_error(op, f"bias must have shape ({n},), got {bias.shape}")
        y += bias.astype(np.float32)
    return y.astype(dtype, copy=False)


@register("QGemm", versions=(1,), domain=MS_DOMAIN)
class QGemm(Op):
    """``Y = alpha * a_scale * b_scale * ((A' - a_zp)(B' - b_zp) + C)`` with ``A'``/``B'`` optionally
    transposed; C (int32) is added to the int32 accumulator; quantized with (y_scale, y_zp) when
    they are given, else float32."""

    multithreaded = True  # GEMM in BLAS

    def run(self, a: np.ndarray, a_scale: np.ndarray, a_zp: np.ndarray, b: np.ndarray, b_scale: np.ndarray,
            b_zp: np.ndarray | None = None, c: np.ndarray | None = None, y_scale: np.ndarray | None = None,
            y_zp: np.ndarray | None = None) -> np.ndarray:
        if a.ndim != 2 or b.ndim != 2:
            raise op_error(self, f"A and B must be 2-D, got {a.shape} and {b.shape}")
        given_b = {3: b, 5: b_zp}
        a = a.T if self.attr("transA") else a
        b = b.T if self.attr("transB") else b
        _matmul_operands(self, a, b)
        m, n = a.shape[0], b.shape[1]
        a_scale = _scalar(self, a_scale, "a_scale").astype(np.float32)
        a_zp = _zero_point(self, a_zp, a.dtype, "a_zero_point")
        b_scale = _per_column(self, b_scale, n, "b_scale").astype(np.float32)
        b_zp = _per_column(self, b_zp, n, "b_zero_point")
        acc = _int_matmul(a, a_zp, b, b_zp, self.derived("b", given_b, lambda: integer_operand(b, b_zp)))
        if c is not None:
            if c.dtype != np.int32:
                raise op_error(self, f"C must be int32, got {c.dtype}")
            try:
                acc += np.broadcast_to(c, (m, n))  # wraps like the int32 accumulator
            except ValueError:
                raise op_error(self, f"C of shape {c.shape} does not broadcast to ({m}, {n})") from None
        scale = np.float32(self.attr("alpha")) * a_scale * b_scale
        if y_scale is None:
            if y_zp is not None:
                raise op_error(self, "y_zero_point is given without y_scale")
            return _scaled_output(acc, scale, None, n, self)
        if y_zp is None:
            raise op_error(self, "y_scale is given without y_zero_point")
        y_zp = _scalar(self, y_zp, "y_zero_point")
        if y_zp.dtype not in _EIGHT_BIT:
            raise op_error(self, f"y_zero_point must be uint8 or int8, got {y_zp.dtype}")
        return _requantize(acc, scale / _scalar(self, y_scale, "y_scale").astype(np.float32), y_zp)


@register("MatMulIntegerToFloat", versions=(1,), domain=MS_DOMAIN)
class MatMulIntegerToFloat(Op):
    """``Y = float((A - a_zp) @ (B - b_zp)) * a_scale * b_scale + bias``; A's parameters per
    tensor, B's per tensor or per column. Y has the scales' type (float32 or float16)."""

    multithreaded = True  # GEMM in BLAS

    def run(self, a: np.ndarray, b: np.ndarray, a_scale: np.ndarray, b_scale: np.ndarray,
            a_zp: np.ndarray | None = None, b_zp: np.ndarray | None = None,
            bias: np.ndarray | None = None) -> np.ndarray:
        _matmul_operands(self, a, b)
        given_b = {1: b, 5: b_zp}
        n = b.shape[-1]
        a_scale = _scalar(self, a_scale, "a_scale")
        a_zp = _zero_point(self, a_zp, a.dtype, "a_zero_point")
        b_scale = _per_column(self, b_scale, n, "b_scale")
        b_zp = _per_column(self, b_zp, n, "b_zero_point")
        acc = _int_matmul(a, a_zp, b, b_zp, self.derived("b", given_b, lambda: integer_operand(b, b_zp)))
        return _scaled_output(acc, a_scale.astype(np.float32) * b_scale.astype(np.float32), bias, n, self,
                              a_scale.dtype)


@register("DynamicQuantizeMatMul", versions=(1,), domain=MS_DOMAIN)
class DynamicQuantizeMatMul(Op):
    """``A`` quantized to uint8 as DynamicQuantizeLinear does, then MatMulIntegerToFloat with
    ``B`` (8-bit, per tensor or per column) and the optional bias."""

    multithreaded = True  # GEMM in BLAS

    def check(self) -> None:
        self.quantize_a = DynamicQuantizeLinear(
            Layer(name=f"{self.layer.name}/DynamicQuantizeLinear", op_type="DynamicQuantizeLinear",
                  inputs=self.layer.inputs[:1], outputs=["a_q", "a_scale", "a_zp"], version=11), self.limits)

    def run(self, a: np.ndarray, b: np.ndarray, b_scale: np.ndarray, b_zp: np.ndarray | None = None,
            bias: np.ndarray | None = None) -> np.ndarray:
        if a.dtype != np.float32:
            raise op_error(self, f"A must be float32, got {a.dtype}")
        _eight_bit(self, b, "B")
        if a.ndim < 1 or b.ndim < 1 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise op_error(self, f"A {a.shape} and B {b.shape} cannot be multiplied")
        given_b = {1: b, 3: b_zp}
        n = b.shape[-1]
        b_scale = _per_column(self, b_scale, n, "b_scale")
        b_zp = _per_column(self, b_zp, n, "b_zero_point")
        a_q, a_scale, a_zp = self.quantize_a(a)
        acc = _int_matmul(a_q, a_zp, b, b_zp, self.derived("b", given_b, lambda: integer_operand(b, b_zp)))
        return _scaled_output(acc, a_scale.astype(np.float32) * b_scale.astype(np.float32), bias, n, self)


# -- quantized BERT fusions ---------------------------------------------------------------------------
@register("QAttention", versions=(1,), domain=MS_DOMAIN)
class QAttention(Op):
    """com.microsoft Attention on the dequantized input ``(input - input_zp) * input_scale`` and
    weights ``(weight - weight_zp) * weight_scale`` (per tensor or per column): the float kernel
    does the projection, masking, past/present and heads, so they are defined once."""

    multithreaded = True  # GEMM in BLAS

    def check(self) -> None:
        inputs = [self.layer.inputs[i] if i < len(self.layer.inputs) else "" for i in (0, 1, 2, 5, 8)]
        self.attention = _nested(self, "Attention", self.version, inputs, dict(self.attrs), MS_DOMAIN)

    def run(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, input_scale: np.ndarray,
            weight_scale: np.ndarray, mask_index: np.ndarray | None = None, input_zp: np.ndarray | None = None,
            weight_zp: np.ndarray | None = None, past: np.ndarray | None = None) -> tuple[np.ndarray | None, ...]:
        _eight_bit(self, x, "input")
        _eight_bit(self, weight, "weight")
        if weight.ndim != 2:
            raise op_error(self, f"weight must be 2-D (input_hidden_size, 3 * hidden_size), got {weight.shape}")
        n = weight.shape[1]
        dtype = np.dtype(np.float32) if bias.dtype != np.float16 else np.dtype(np.float16)
        real_x = _real(x, _scalar(self, input_scale, "input_scale"),
                       _zero_point(self, input_zp, x.dtype, "input_zero_point")).astype(dtype)
        w_scale = _per_column(self, weight_scale, n, "weight_scale").astype(np.float64)
        w_zp = _per_column(self, weight_zp, n, "weight_zero_point")

        def real_w() -> np.ndarray:
            shifted = weight.astype(np.int64) - (0 if w_zp is None else w_zp.astype(np.int64))
            return (shifted * w_scale).astype(dtype)
        weights = self.derived(f"weight {dtype}", {1: weight, 4: weight_scale, 7: weight_zp}, real_w)
        return self.attention(real_x, weights, bias, mask_index, past)


@register("QEmbedLayerNormalization", versions=(1,), domain=MS_DOMAIN)
class QEmbedLayerNormalization(Op):
    """com.microsoft EmbedLayerNormalization on the dequantized (per tensor) embeddings, gamma and
    beta. ``mask_index_out`` counts the ones of each mask row; zeros when there is no mask."""

    _TABLES = ("word_embedding", "position_embedding", "segment_embedding", "gamma", "beta")

    def check(self) -> None:
        names = list(self.layer.inputs) + [""] * (18 - len(self.layer.inputs))
        self.embed = _nested(self, "EmbedLayerNormalization", self.version, names[:8],
                             {"epsilon": self.attr("epsilon")}, MS_DOMAIN)

    def run(self, input_ids: np.ndarray, segment_ids: np.ndarray | None, *rest: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray]:
        rest = rest + (None,) * (16 - len(rest))
        word, position, segment, gamma, beta, mask = rest[:6]
        scales, zero_points = rest[6:11], rest[11:16]
        quantized = (word, position, segment, gamma, beta)
        has_segment = [segment_ids is not None, segment is not None, scales[2] is not None, zero_points[2] is not None]
        if any(has_segment) and not all(has_segment):
            raise op_error(self, "segment_ids, segment_embedding and its scale and zero point must all be given "
                                 "or all be omitted")
        tables: list[np.ndarray | None] = []
        for i, (name, q, scale, zp) in enumerate(zip(self._TABLES, quantized, scales, zero_points)):
            if q is None:
                if name != "segment_embedding":
                    raise op_error(self, f"{name} is missing")
                tables.append(None)
                continue
            _eight_bit(self, q, name)
            if scale is None or zp is None:
                raise op_error(self, f"{name} needs a scale and a zero point")
            real = functools.partial(self._table, name, q, scale, zp)
            # inputs 2-6 are the tables, 8-12 their scales, 13-17 their zero points
            tables.append(self.derived(name, {2 + i: q, 8 + i: scale, 13 + i: zp}, real))
        outputs = self.embed(input_ids, segment_ids, *tables, mask)
        return outputs[0], outputs[1]

    def _table(self, name: str, q: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> np.ndarray:
        """A dequantized float32 table."""
        return _real(q, _scalar(self, scale, f"{name} scale"),
                     _zero_point(self, zp, q.dtype, f"{name} zero point")).astype(np.float32)


# -- weight-only quantization -------------------------------------------------------------------------
def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ``bits``-wide values packed little end first in each byte of the last axis."""
    if bits == 8:
        return packed
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    values = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return values.reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


@register("MatMulNBits", versions=(1,), domain=MS_DOMAIN)
class MatMulNBits(Op):
    """``Y = A @ dequantize(B).T + bias`` with B an (N, K) weight quantized to ``bits`` (2, 4 or 8)
    in blocks of ``block_size`` along K: ``(q - zero_point) * scale`` per block, zero points packed
    uint8, float, or 2**(bits-1) when absent; ``g_idx`` maps each k to its block (act-order
    quantization). ``accuracy_level`` is ignored: A stays float and the product is float32."""

    multithreaded = True  # GEMM in BLAS

    def check(self) -> None:
        self.k, self.n = int(self.attr("K")), int(self.attr("N"))
        self.bits, self.block = int(self.attr("bits")), int(self.attr("block_size"))
        if self.bits not in (2, 4, 8):
            self.unsupported(f"bits={self.bits} (2, 4 and 8 are)")
        if self.block < 16 or self.block & (self.block - 1):
            self.unsupported(f"block_size={self.block} (a power of two >= 16 is required)")
        if self.k < 1 or self.n < 1:
            self.unsupported(f"K={self.k}, N={self.n}")
        if int(self.attr("weight_prepacked")):
            self.unsupported(f"weight_prepacked={self.attr('weight_prepacked')} (an EP-specific layout)")
        self.blocks = -(-self.k // self.block)

    def weight(self, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
               g_idx: np.ndarray | None) -> np.ndarray:
        """The dequantized (N, K) weight in float32."""
        n, k, blocks = self.n, self.k, self.blocks
        blob = self.block * self.bits // 8
        if b.dtype != np.uint8 or b.size != n * blocks * blob:
            raise op_error(self, f"B must be uint8 of shape ({n}, {blocks}, {blob}), got {b.dtype} {b.shape}")
        q = _unpack(b.reshape(n, blocks * blob), self.bits)[:, :k]
        if scales.size != n * blocks:
            raise op_error(self, f"scales must have shape ({n}, {blocks}), got {scales.shape}")
        scales = scales.reshape(n, blocks).astype(np.float32)
        if zero_points is None:
            zp = np.full((n, blocks), 1 << (self.bits - 1), np.float32)
        elif zero_points.dtype == np.uint8:
            per_row = -(-blocks * self.bits // 8)
            if zero_points.size != n * per_row:
                raise op_error(self, f"packed zero_points must have shape ({n}, {per_row}), got {zero_points.shape}")
            zp = _unpack(zero_points.reshape(n, per_row), self.bits)[:, :blocks].astype(np.float32)
        elif zero_points.dtype.kind == "f" or zero_points.dtype.name == "bfloat16":
            if zero_points.size != n * blocks:
                raise op_error(self, f"float zero_points must have shape ({n}, {blocks}), got {zero_points.shape}")
            zp = zero_points.reshape(n, blocks).astype(np.float32)
        else:
            raise op_error(self, f"zero_points must be uint8 or float, got {zero_points.dtype}")
        if g_idx is None:
            group = np.arange(k) // self.block
        else:
            if g_idx.size != k or g_idx.dtype.kind not in "iu":
                raise op_error(self, f"g_idx must hold {k} integers, got {g_idx.dtype} {g_idx.shape}")
            group = g_idx.reshape(k).astype(np.int64)
            if group.size and (group.min() < 0 or group.max() >= blocks):
                raise op_error(self, f"g_idx values must be in [0, {blocks})")
        if g_idx is None and k % self.block == 0:  # per block, without gathering a (N, K) index
            shifted = q.reshape(n, blocks, self.block).astype(np.float32) - zp[:, :, None]
            return (shifted * scales[:, :, None]).reshape(n, k)
        return (q.astype(np.float32) - zp[:, group]) * scales[:, group]

    def run(self, a: np.ndarray, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None = None,
            g_idx: np.ndarray | None = None, bias: np.ndarray | None = None) -> np.ndarray:
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise op_error(self, f"A must be a float tensor, got {a.dtype}")
        if a.ndim < 1 or a.shape[-1] != self.k:
            raise op_error(self, f"A must have K={self.k} as its last dimension, got shape {a.shape}")
        w = self.derived("weight", {1: b, 2: scales, 3: zero_points, 4: g_idx},
                         lambda: self.weight(b, scales, zero_points, g_idx))
        y = np.matmul(a.astype(np.float32, copy=False), w.T)
        if bias is not None:
            if bias.size != self.n:
                raise op_error(self, f"bias must have shape ({self.n},), got {bias.shape}")
            y += bias.reshape(self.n).astype(np.float32)
        return y.astype(a.dtype, copy=False)


# -- attribute defaults (ORT's operator schemas; onnx ships none for this domain) ---------------------
for _op_type, _defaults in {
    "QLinearLeakyRelu": {"alpha": 0.01},
    "QLinearGlobalAveragePool": {"channels_last": 0},
    "QLinearAveragePool": {"auto_pad": "NOTSET", "ceil_mode": 0, "channels_last": 0, "count_include_pad": 0},
    "QLinearConv": {"auto_pad": "NOTSET", "group": 1, "channels_last": 0},
    "QGemm": {"alpha": 1.0, "transA": 0, "transB": 0},
    "QAttention": {"unidirectional": 0},
    "QEmbedLayerNormalization": {"epsilon": 1e-12},
    "MatMulNBits": {"bits": 4, "accuracy_level": 0, "weight_prepacked": 0},
}.items():
    declare_defaults(MS_DOMAIN, _op_type, _defaults)
