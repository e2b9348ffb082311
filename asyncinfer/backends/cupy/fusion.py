"""One CUDA kernel for a layer's element-wise epilogue: ``act_n(... act_1(x + b))`` (CUDA only).

Conv, Gemm, Add and Sum layers carrying fused activations (``Conv+Relu``, ``Sum+Relu``...) would
otherwise make one memory pass for the bias or the addition and one per activation. Here the
whole chain becomes a single CuPy ``ElementwiseKernel``, compiled once per distinct chain. Its C
is generated, not written: each activation's device expression from the element-wise table
(`asyncinfer.ops.pointwise`), spelled in CUDA by `to_cuda`, over
`CUDA_PRELUDE`, which defines every function of the expression dialect. So every fusable
activation of the table fuses, and Clip too. Only float32 chains are fused; anything else (or a
chain whose kernel fails to build) returns None, and the caller runs the array-API path, which
computes the same values.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...ops.base import Op
from ...ops.pointwise import ACTIVATIONS, clip_template, fill, float_literal, rename, to_cuda
from .kernels.activations import clip_bounds

log = logging.getLogger("asyncinfer.gpu_compute")

#: The expression dialect (``asyncinfer.ops.pointwise.DIALECT``) as CUDA device functions on float,
#: each named ``ai_<name>``. NaN propagates as in the NumPy functions: comparisons with NaN are
#: false, so ``ai_relu``, ``ai_max``, ``ai_clamp``... keep a NaN input NaN (``fmaxf`` would not).
CUDA_PRELUDE = r"""
#ifndef ASYNCINFER_PRELUDE
#define ASYNCINFER_PRELUDE
#define AI_F __device__ __forceinline__ float
AI_F ai_abs(float x) { return fabsf(x); }
AI_F ai_sign(float x) { return x > 0.f ? 1.f : (x < 0.f ? -1.f : x); }
AI_F ai_floor(float x) { return floorf(x); }
AI_F ai_ceil(float x) { return ceilf(x); }
AI_F ai_roundEven(float x) { return rintf(x); }
AI_F ai_sqrt(float x) { return sqrtf(x); }
AI_F ai_exp(float x) { return expf(x); }
AI_F ai_expm1(float x) { return expm1f(x); }
AI_F ai_log(float x) { return logf(x); }
AI_F ai_sin(float x) { return sinf(x); }
AI_F ai_cos(float x) { return cosf(x); }
AI_F ai_tan(float x) { return tanf(x); }
AI_F ai_asin(float x) { return asinf(x); }
AI_F ai_acos(float x) { return acosf(x); }
AI_F ai_atan(float x) { return atanf(x); }
AI_F ai_sinh_(float x) { return sinhf(x); }
AI_F ai_cosh_(float x) { return coshf(x); }
AI_F ai_asinh(float x) { return asinhf(x); }
AI_F ai_acosh(float x) { return acoshf(x); }
AI_F ai_atanh(float x) { return atanhf(x); }
AI_F ai_tanh_(float x) { return tanhf(x); }
AI_F ai_erf_(float x) { return erff(x); }
AI_F ai_softplus(float x) { return x > 0.f ? x + log1pf(expf(-x)) : log1pf(expf(x)); }
AI_F ai_relu(float x) { return x < 0.f ? 0.f : x; }
AI_F ai_is_nan(float x) { return x != x ? 1.f : 0.f; }
AI_F ai_min(float a, float b) { return (a < b || a != a) ? a : b; }
AI_F ai_max(float a, float b) { return (a > b || a != a) ? a : b; }
AI_F ai_lt(float a, float b) { return a < b ? 1.f : 0.f; }
AI_F ai_le(float a, float b) { return a <= b ? 1.f : 0.f; }
AI_F ai_gt(float a, float b) { return a > b ? 1.f : 0.f; }
AI_F ai_ge(float a, float b) { return a >= b ? 1.f : 0.f; }
AI_F ai_eq(float a, float b) { return a == b ? 1.f : 0.f; }
AI_F ai_pow_(float a, float b) { return powf(a, b); }  // C's pow: negative bases, integral exponents as ONNX
AI_F ai_clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
AI_F ai_pick(float c, float a, float b) { return c != 0.f ? a : b; }
#endif
"""


#: A CUDA C float literal of a value rounded to float32 (inf and NaN through their bits).
cuda_float = functools.partial(float_literal, nan="__int_as_float(0x7fc00000)", inf="__int_as_float(0x7f800000)",
                               neg_inf="(-__int_as_float(0x7f800000))", suffix="f")


def activation_expression(op: Op, extras: Sequence[Any]) -> str | None:
    """The CUDA C expression over ``x`` of one fused activation, or None if it has none."""
    if op.op_type == "Clip":
        template, values = clip_template(*clip_bounds(op, extras))
        return fill(to_cuda(template), values, cuda_float)
    entry = ACTIVATIONS.get(op.op_type)
    if entry is None or not entry.on_device or op.domain not in ("", "ai.onnx"):
        return None
    return entry.device_expression(op, cuda_float, to_cuda)


def chain_code(activations: Sequence[tuple[Op, Sequence[Any]]]) -> str | None:
    """The C statements applying an activation chain to ``float v``, or None when one of them
    has no C form."""
    parts = [activation_expression(op, extras) for op, extras in activations]
    if any(p is None for p in parts):
        return None
    return " ".join(f"v = {rename(p, 'x', 'v')};" for p in parts)  # type: ignore[arg-type]


def epilogue_source(body: str, bias: bool) -> tuple[str, str, str]:
    """The ``ElementwiseKernel`` parameters and operation of a fused epilogue running ``body``
    (from `chain_code`) on ``x + b`` (``bias``) or ``x``; `CUDA_PRELUDE` is its preamble."""
    code = ("float v = x + b; " if bias else "float v = x; ") + body + " y = v;"
    return ("T x, T b" if bias else "T x"), "T y", code


class FusedEpilogue:
    """``fuse(x, b, activations, out)``: ``activations(x + b)`` (b may be None) in one kernel,
    written to ``out`` (may be ``x`` itself) or a new array; None when the chain cannot be fused."""

    def __init__(self, cupy: Any):
        self._cupy = cupy
        self._kernels: dict[tuple[bool, str], Any] = {}
        self._broken: set[tuple[bool, str]] = set()

    def __call__(self, x: Any, b: Any, activations: Sequence[tuple[Op, Sequence[Any]]], out: Any = None) -> Any:
        f32 = np.dtype(np.float32)
        if x.dtype != f32 or (b is not None and b.dtype != f32) or (out is not None and out.dtype != f32):
            return None
        body = chain_code(activations)
        key = (b is not None, body or "")
        if body is None or key in self._broken:
            return None
        kernel = self._kernels.get(key)
        if kernel is None:
            in_params, out_params, code = epilogue_source(body, b is not None)
            name = f"asyncinfer_epilogue_{len(self._kernels)}"
            kernel = self._cupy.ElementwiseKernel(in_params, out_params, code, name, preamble=CUDA_PRELUDE)
            self._kernels[key] = kernel
        args = (x, b) if b is not None else (x,)
        try:
            return kernel(*args, out) if out is not None else kernel(*args)
        except Exception:  # noqa: BLE001 - e.g. a compile error: never again for this chain
            log.exception("gpu_compute: the fused epilogue %r failed; using separate kernels", body)
            self._broken.add(key)
            return None
