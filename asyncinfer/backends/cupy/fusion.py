"""One CUDA kernel for a layer's element-wise epilogue: ``act_n(... act_1(x + b))`` (CUDA only).

Conv, Gemm, Add and Sum layers carrying fused activations (``Conv+Relu``, ``Sum+Relu``...) would
otherwise make one memory pass for the bias or the addition and one per activation. Here the
whole chain becomes a single CuPy ``ElementwiseKernel``, generated from the activations' C
statements and compiled once per distinct chain. Only float32 chains of the activations below are
fused; anything else (or a chain whose kernel fails to build) returns None, and the caller runs
the array-API path, which computes the same values.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...ops.base import Op
from .kernels.activations import clip_bounds

log = logging.getLogger("asyncinfer.gpu_compute")


def _literal(value: Any) -> str:
    """A C float literal of ``value`` rounded to float32."""
    return f"{float(np.float32(value))!r}f"


def _statement(op: Op, extras: Sequence[Any]) -> str | None:
    """The C statement applying one activation to ``float v`` (NaN propagates as in the NumPy
    kernels: comparisons with NaN are false, so NaN is kept), or None if it has none."""
    kind = op.op_type
    if kind == "Relu":
        return "v = v < 0.f ? 0.f : v;"
    if kind == "LeakyRelu":
        return f"v = v >= 0.f ? v : {_literal(op.attr('alpha', 0.01))} * v;"
    if kind == "Sigmoid":
        return "v = 1.f / (1.f + expf(-v));"
    if kind == "Tanh":
        return "v = tanhf(v);"
    if kind == "Clip":
        code = []
        lo, hi = clip_bounds(op, extras)
        for bound, test in ((lo, "<"), (hi, ">")):
            if bound is None:
                continue
            value = float(np.float32(bound))
            if math.isnan(value):
                return None
            if math.isinf(value):
                if (value < 0) == (test == "<"):  # max(v, -inf) or min(v, inf): nothing to do
                    continue
                return None
            code.append(f"v = v {test} {_literal(value)} ? {_literal(value)} : v;")
        return " ".join(code)
    return None


def chain_code(activations: Sequence[tuple[Op, Sequence[Any]]]) -> str | None:
    """The C statements of an activation chain, or None when one of them has no C form."""
    parts = [_statement(op, extras) for op, extras in activations]
    return None if any(p is None for p in parts) else " ".join(parts)  # type: ignore[arg-type]


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
            code = ("float v = x + b; " if b is not None else "float v = x; ") + body + " y = v;"
            kernel = self._cupy.ElementwiseKernel("T x, T b" if b is not None else "T x", "T y", code,
                                                  f"asyncinfer_epilogue_{len(self._kernels)}")
            self._kernels[key] = kernel
        args = (x, b) if b is not None else (x,)
        try:
            return kernel(*args, out) if out is not None else kernel(*args)
        except Exception:  # noqa: BLE001 - e.g. a compile error: never again for this chain
            log.exception("gpu_compute: the fused epilogue %r failed; using separate kernels", body)
            self._broken.add(key)
            return None
