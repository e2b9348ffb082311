"""One-pass float32 activations, in place: Sigmoid, Swish, HardSigmoid, HardSwish, Gelu.

As NumPy ufunc chains these take 3-6 passes over the tensor (Swish: scale, negate, exp, add,
reciprocal, multiply); fused after a conv or GEMM they cost as much as the GEMM itself. Here each
is one loop that LLVM vectorises.

``exp`` has no vectorised form in numba without Intel's SVML, so `_exp` is written out: the usual
range reduction ``x = n·ln2 + r`` (|r| ≤ ln2/2, ln2 split in two so ``n·ln2_hi`` is exact), a
degree-6 Taylor polynomial for ``e^r`` (truncation error below 2e-7 relative) and ``2^n`` built
from its exponent bits (as two factors, so all of [-126, 128] is reachable). Results are within
3 ulp of ``exp`` and Sigmoid/Swish within 4 (tests/ops/test_compiled_activations.py checks
against float64 on a dense grid); results below 1e-38 flush to zero.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..elementwise import _ERF_CLAMP, _ERF_P, _ERF_Q
from . import inline, kernel

_F = np.float32
_LOG2E = _F(1.4426950408889634)
_LN2_HI = _F(0.693145751953125)      # ln 2 to 16 bits: n·_LN2_HI is exact for |n| < 2^8
_LN2_LO = _F(1.4286068203094173e-06)  # ln 2 - _LN2_HI
_EXP_MAX = _F(88.72283)               # e^x overflows float32 above this
_EXP_MIN = _F(-87.33654)              # and is subnormal (flushed to 0 here) below this
_INF = _F(np.inf)


@intrinsic
def _float_from_bits(typingctx, bits):  # type: ignore[no-untyped-def]
    """The float32 whose bit pattern is the int32 ``bits`` (an LLVM bitcast: vectorises)."""
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _fma(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """float32 ``a·b + c`` rounded once (LLVM's fma: vectorises). Kernels here are compiled
    without implicit contraction and fuse exactly where this is written, so every kernel that
    inlines a helper computes the same bits (a fused epilogue equals the standalone op)."""
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@inline
def _exp(x: float) -> float:
    """float32 ``e^x`` (module docstring); ``inf`` above the float32 range, 0 where the result
    would be subnormal, NaN for NaN."""
    if x != x:
        return x
    if x > _EXP_MAX:
        return _INF  # a float32: a float64 constant here would make every caller compute in float64
    if x < _EXP_MIN:
        return _F(0.0)
    n = np.floor(_fma(x, _LOG2E, _F(0.5)))
    r = _fma(-n, _LN2_LO, _fma(-n, _LN2_HI, x))
    p = _F(1.0 / 720.0)
    p = _fma(p, r, _F(1.0 / 120.0))
    p = _fma(p, r, _F(1.0 / 24.0))
    p = _fma(p, r, _F(1.0 / 6.0))
    p = _fma(p, r, _F(0.5))
    p = _fma(p, r, _F(1.0))
    p = _fma(p, r, _F(1.0))
    # 2^n as 2^a·2^b with a = n//2: n spans [-126, 128] and 128 is past the largest float32
    # exponent (127), -126 the smallest normal one
    k = np.int32(n)
    a = k >> 1
    return p * _float_from_bits((a + 127) << 23) * _float_from_bits((k - a + 127) << 23)


def exp_vector(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """LLVM IR of `_exp` on a vector of float32 ``x``, operation for operation (the same FMAs,
    floor, exponent bits and products, the same answers for NaN and past the range): the bits of
    the scalar form in every lane, for the register blocks' epilogue (`panels._Finisher`)."""
    vector = x.type
    lanes = vector.count
    ints = ir.VectorType(ir.IntType(32), lanes)

    def const(value: float) -> ir.Constant:
        return ir.Constant(vector, [float(_F(value))] * lanes)

    def intrinsic(name: str, count: int) -> ir.Function:
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * count),
                                              f"llvm.{name}.v{lanes}f32")

    fma, floor = intrinsic("fma", 3), intrinsic("floor", 1)
    n = builder.call(floor, [builder.call(fma, [x, const(_LOG2E), const(0.5)])])
    minus_n = builder.fneg(n)
    r = builder.call(fma, [minus_n, const(_LN2_LO), builder.call(fma, [minus_n, const(_LN2_HI), x])])
    p = const(1.0 / 720.0)
    for term in (1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = builder.call(fma, [p, r, const(term)])
    k = builder.fptosi(n, ints)
    a = builder.ashr(k, ir.Constant(ints, [1] * lanes))

    def power(e: ir.Value) -> ir.Value:  # 2^e from its exponent bits
        return builder.bitcast(builder.shl(builder.add(e, ir.Constant(ints, [127] * lanes)),
                                           ir.Constant(ints, [23] * lanes)), vector)
    y = builder.fmul(builder.fmul(p, power(a)), power(builder.sub(k, a)))
    y = builder.select(builder.fcmp_ordered("<", x, const(_EXP_MIN)), const(0.0), y)
    y = builder.select(builder.fcmp_ordered(">", x, const(_EXP_MAX)), const(np.inf), y)
    return builder.select(builder.fcmp_unordered("uno", x, x), x, y)


# Scalar forms, inlined into the array kernels below and into the GEMM epilogue
# (`compiled.epilogue`), so a fused activation gives the very bits of the standalone one.
@inline
def sigmoid1(v: float) -> float:
    """``1 / (1 + e^-v)`` (NaN stays NaN)."""
    one = _F(1.0)
    return one / (one + _exp(-v))


@inline
def swish1(v: float, a: float) -> float:
    """``v / (1 + e^(-a·v))``."""
    return v / (_F(1.0) + _exp(-a * v))


@inline
def tanh1(v: float) -> float:
    """float32 ``tanh(v)``: ``1 - 2/(e^(2|v|) + 1)`` with v's sign, and for |v| < 1/8, where that
    form cancels, its odd Taylor series to v⁹ (truncation below 1e-9 relative there); within
    7e-7 relative of ``np.tanh`` everywhere, ±1 at the ends, NaN for NaN."""
    a = abs(v)
    one = _F(1.0)
    # 1 - 2/(e + 1) in float64, rounded once: in float32 the subtraction's cancellation near
    # |v| = 1/8 passes 7e-7 relative
    t = _F(1.0 - 2.0 / (np.float64(_exp(_F(2.0) * a)) + 1.0))
    t = -t if v < 0 else t
    z = v * v
    s = v * (one + z * (_F(-1.0 / 3.0) + z * (_F(2.0 / 15.0) + z * (_F(-17.0 / 315.0) + z * _F(62.0 / 2835.0)))))
    return s if a < _F(0.125) else t


@inline
def hard_sigmoid1(v: float, a: float, b: float) -> float:
    """``clamp(a·v + b, 0, 1)`` (NaN stays NaN)."""
    g = _fma(a, v, b)
    return _F(0.0) if g < 0 else (_F(1.0) if g > 1 else g)


@inline
def hard_swish1(v: float) -> float:
    """``v · clamp(v/6 + 1/2, 0, 1)`` (NaN stays NaN)."""
    g = _fma(v, _F(1.0 / 6.0), _F(0.5))
    # a product even where the gate clamps, as the definition: -inf·0 is NaN, v<-3 gives -0
    return v * (_F(0.0) if g < 0 else (_F(1.0) if g > 1 else g))


@kernel(contract=False)
def sigmoid(x: np.ndarray) -> None:
    """``x ← 1 / (1 + e^-x)``, ``x`` a flat float32 array (NaN stays NaN)."""
    for i in range(x.size):
        x[i] = sigmoid1(x[i])


@kernel(contract=False)
def swish(x: np.ndarray, alpha: float) -> None:
    """``x ← x / (1 + e^(-alpha·x))``, ``x`` a flat float32 array."""
    a = _F(alpha)
    for i in range(x.size):
        x[i] = swish1(x[i], a)


@kernel(contract=False)
def hard_sigmoid(x: np.ndarray, alpha: float, beta: float) -> None:
    """``x ← clamp(alpha·x + beta, 0, 1)``, ``x`` a flat float32 array (NaN stays NaN)."""
    a, b = _F(alpha), _F(beta)
    for i in range(x.size):
        x[i] = hard_sigmoid1(x[i], a, b)


@kernel(contract=False)
def hard_swish(x: np.ndarray) -> None:
    """``x ← x · clamp(x/6 + 1/2, 0, 1)``, ``x`` a flat float32 array (NaN stays NaN)."""
    for i in range(x.size):
        x[i] = hard_swish1(x[i])


_ERF_C = _F(_ERF_CLAMP)
_P0, _P1, _P2, _P3, _P4, _P5 = (_F(c) for c in _ERF_P)
_Q1, _Q2, _Q3, _Q4, _Q5 = (_F(c) for c in _ERF_Q[1:])
_INV_SQRT2 = _F(0.7071067811865476)
_SQRT_2_OVER_PI = _F(0.7978845608028654)


@inline
def gelu1(v: float) -> float:
    """``v · ((1 + erf(v/√2)) · 1/2)``: erf by the (5, 5) rational of
    `asyncinfer.ops.elementwise.erf_float32`, each operation in the same order and rounding as
    that NumPy form where the caller contracts nothing into an FMA, so both give the same bits."""
    one, half = _F(1.0), _F(0.5)
    a = v * _INV_SQRT2
    a = _ERF_C if a > _ERF_C else (-_ERF_C if a < -_ERF_C else a)  # NaN passes
    z = a * a
    p = ((((_P5 * z + _P4) * z + _P3) * z + _P2) * z + _P1) * z + _P0
    q = ((((_Q5 * z + _Q4) * z + _Q3) * z + _Q2) * z + _Q1) * z + one
    e = a * p / q
    e = one if e > one else (-one if e < -one else e)  # the fit overshoots 1 by an ulp
    return v * ((one + e) * half)


@inline
def gelu_tanh1(v: float) -> float:
    """``v/2 · (1 + tanh(√(2/π)·(v + 0.044715·v³)))`` as ``v · sigmoid(2y)`` (`gelu_tanh`)."""
    y = _SQRT_2_OVER_PI * (v + _F(0.044715) * v * v * v)
    return v / (_F(1.0) + _exp(_F(-2.0) * y))


@kernel(contract=False)
def gelu(x: np.ndarray) -> None:
    """``x ← x · ((1 + erf(x/√2)) · 1/2)``, ``x`` a flat float32 array (`gelu1`: the bits of the
    NumPy form, in one pass instead of 24)."""
    for i in range(x.size):
        x[i] = gelu1(x[i])


@kernel(contract=False)
def gelu_tanh(x: np.ndarray) -> None:
    """``x ← x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))``, ``x`` a flat float32 array, as
    ``x · sigmoid(2y)`` (the same function: 1 + tanh(y) = 2·sigmoid(2y)), which needs no tanh and
    does not cancel where tanh nears -1."""
    for i in range(x.size):
        x[i] = gelu_tanh1(x[i])
