"""Linear algebra ops: MatMul, Gemm and Einsum (all land in BLAS, which releases the GIL)."""
from __future__ import annotations

import numpy as np

from .base import Op
from .elementwise import compute_dtype
from .registry import register


@register("MatMul", versions=(1, 9, 13))
class MatMul(Op):
    multithreaded = True  # GEMM in BLAS: already uses every core

    def run(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return narrow_float_matmul(a, b)


def narrow_float_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b``; bfloat16/float8 operands (which NumPy would silently promote) are multiplied in
    float32 and the result rounded back to the operands' type, as ONNX requires."""
    work = compute_dtype(a.dtype)
    if work == a.dtype:
        return np.matmul(a, b)
    return np.matmul(a.astype(work), b.astype(work)).astype(a.dtype)


@register("Gemm", versions=(1, 6, 7, 9, 11, 13))
class Gemm(Op):
    """``alpha * A' @ B' + beta * C`` with optional transposes and a broadcast (optional) C."""
    multithreaded = True  # GEMM in BLAS: already uses every core

    def run(self, a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None) -> np.ndarray:
        if int(self.attr("transA")):
            a = a.T
        if int(self.attr("transB")):
            b = b.T
        alpha, beta = float(self.attr("alpha")), float(self.attr("beta"))
        out_dtype = a.dtype
        work = compute_dtype(a.dtype)
        y = np.matmul(a.astype(work, copy=False), b.astype(work, copy=False))
        dt = y.dtype.type
        if alpha != 1.0:
            y *= dt(alpha)
        if c is not None and beta != 0.0:
            c = c.astype(work, copy=False)
            if beta == 1.0:
                y += c
            else:
                y += dt(beta) * c
        return y.astype(out_dtype, copy=False)


@register("Einsum", versions=(12, 28))
class Einsum(Op):
    """``np.einsum`` with path optimisation; the implicit form is made explicit with ONNX's ordering."""
    multithreaded = True  # GEMM in BLAS: already uses every core

    def check(self) -> None:
        eq = str(self.attr("equation")).replace(" ", "")
        lhs = eq.split("->")[0]
        if eq.count("->") > 1 or not all(ch.isalpha() or ch in ",." for ch in lhs.replace("...", "")):
            self.unsupported(f"equation {eq!r}")
        self.equation = _explicit(eq)

    def run(self, *inputs: np.ndarray) -> np.ndarray:
        dtype = np.result_type(*inputs)
        if dtype.kind == "V" or dtype.name == "bfloat16":  # NumPy cannot einsum ml_dtypes types
            out = np.einsum(self.equation, *[x.astype(np.float32) for x in inputs], optimize=True)
            return np.asarray(out).astype(dtype)
        return np.asarray(np.einsum(self.equation, *inputs, optimize=True)).astype(dtype, copy=False)


def _explicit(eq: str) -> str:
    """``eq`` with an explicit output: letters used exactly once, sorted by ASCII, after any ellipsis."""
    if "->" in eq:
        return eq
    letters = eq.replace("...", "").replace(",", "")
    once = sorted(ch for ch in set(letters) if letters.count(ch) == 1)
    return eq + "->" + ("..." if "..." in eq else "") + "".join(once)
