"""BLAS's single-precision GEMM called from compiled code, so that a GEMM can be a part of a
compiled kernel: a spinning helper (`concurrency/spin_team.py`) runs it without Python.

NumPy's matmul is Python-level: a kernel that interleaves GEMMs with compiled loops (the tiled
conv's im2col, GEMM and epilogue per block) must return to Python between them, and its parts
can only be shared out to pool threads that wake in 100-300 µs on a small VM. Here the
``cblas_sgemm`` of the OpenBLAS that NumPy itself loaded is looked up once (its address, found
through threadpoolctl, which the CPU backend already uses to pin BLAS to one thread per call) and
called through that address from compiled code: `sgemm`. The address is an argument, not a
constant baked into the machine code, so kernels calling it stay in numba's on-disk cache.

NumPy's wheels bundle OpenBLAS with 64-bit integers and a ``scipy_`` prefix
(``scipy_cblas_sgemm64_``); other builds export ``cblas_sgemm64_`` or plain 32-bit
``cblas_sgemm``. Where none is found (NumPy on Apple's Accelerate, MKL builds) `SGEMM` is 0 and
callers keep their NumPy path. The binding checks itself on first use against NumPy's matmul
(`available`): a library exporting the name with another calling convention disables it rather
than giving wrong results.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...concurrency.spin_team import ARGS, address_as_pointer
from . import kernel

#: The kind of a spin-team part that is one `sgemm` (`gemm_part`).
PART_KIND = 3

# CBLAS enums: row-major storage, no transposition, transposition
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
# (symbol, 64-bit integers) in the order tried
_SYMBOLS = (("scipy_cblas_sgemm64_", True), ("cblas_sgemm64_", True), ("scipy_cblas_sgemm", False),
            ("cblas_sgemm", False))


def _find() -> tuple[int, bool]:
    """(address of cblas_sgemm in NumPy's OpenBLAS, whether its integers are 64-bit); (0, False)
    when there is none."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return 0, False
    for lib in threadpool_info():
        if lib.get("internal_api") != "openblas" or not lib.get("filepath"):
            continue
        try:
            handle = ctypes.CDLL(lib["filepath"])
        except OSError:
            continue
        for name, ilp64 in _SYMBOLS:
            fn = getattr(handle, name, None)
            if fn is not None:
                return int(ctypes.cast(fn, ctypes.c_void_p).value or 0), ilp64
    return 0, False


SGEMM, ILP64 = _find()


def _call(int_type: ir.IntType) -> Any:
    """codegen of ``cblas_sgemm(RowMajor, NoTrans, trans_b, m, n, k, 1, a, lda, b, ldb, 0, c, ldc)``
    through the address in the first argument, with BLAS integers of ``int_type``."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fn, trans_b, m, n, k, a, lda, b, ldb, c, ldc = args
        f32, i32 = ir.FloatType(), ir.IntType(32)
        ptr = f32.as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, int_type, int_type, int_type, f32, ptr, int_type, ptr,
                                               int_type, f32, ptr, int_type])
        callee = builder.inttoptr(fn, fnty.as_pointer())

        def blas_int(v: Any) -> Any:
            return v if int_type.width == 64 else builder.trunc(v, int_type)

        builder.call(callee, [ir.Constant(i32, _ROW_MAJOR), ir.Constant(i32, _NO_TRANS), builder.trunc(trans_b, i32),
                              blas_int(m), blas_int(n), blas_int(k), ir.Constant(f32, 1.0),
                              builder.inttoptr(a, ptr), blas_int(lda), builder.inttoptr(b, ptr), blas_int(ldb),
                              ir.Constant(f32, 0.0), builder.inttoptr(c, ptr), blas_int(ldc)])
        return context.get_dummy_value()
    return codegen


_ARGS = (types.int64,) * 11


@intrinsic
def _sgemm64(typingctx: Any, fn: Any, trans_b: Any, m: Any, n: Any, k: Any, a: Any, lda: Any, b: Any, ldb: Any,
             c: Any, ldc: Any) -> Any:
    return types.void(*_ARGS), _call(ir.IntType(64))


@intrinsic
def _sgemm32(typingctx: Any, fn: Any, trans_b: Any, m: Any, n: Any, k: Any, a: Any, lda: Any, b: Any, ldb: Any,
             c: Any, ldc: Any) -> Any:
    return types.void(*_ARGS), _call(ir.IntType(32))


@numba.njit(inline="always")
def sgemm(fn: int, ilp64: bool, m: int, n: int, k: int, a: int, lda: int, b: int, ldb: int, c: int, ldc: int) -> None:
    """``C = A @ B`` (float32, row-major, ``C`` overwritten) with the BLAS at address ``fn``
    (`SGEMM`, `ILP64`): ``A`` is m×k at address ``a`` with row stride ``lda`` (elements), ``B``
    k×n at ``b`` (``ldb``), ``C`` m×n at ``c`` (``ldc``). Compiled code only."""
    if ilp64:
        _sgemm64(fn, _NO_TRANS, m, n, k, a, lda, b, ldb, c, ldc)
    else:
        _sgemm32(fn, _NO_TRANS, m, n, k, a, lda, b, ldb, c, ldc)


@numba.njit(inline="always")
def sgemm_bt(fn: int, ilp64: bool, m: int, n: int, k: int, a: int, lda: int, b: int, ldb: int, c: int,
             ldc: int) -> None:
    """``C = A @ Bᵀ``, as `sgemm` but ``B`` given as its n×k transpose at ``b`` (row stride
    ``ldb``): attention's scores, each query row against each key row read in place."""
    if ilp64:
        _sgemm64(fn, _TRANS, m, n, k, a, lda, b, ldb, c, ldc)
    else:
        _sgemm32(fn, _TRANS, m, n, k, a, lda, b, ldb, c, ldc)


def gemm_arguments(m: int, n: int, k: int, a: int, lda: int, b: int, ldb: int, c: int, ldc: int,
                   bias: int = 0) -> list[int]:
    """The integers of a part that is one `sgemm` (addresses and strides as there; for
    `SpinTeam.try_run`; the caller keeps the arrays alive until it is done), then ``C += bias``
    row by row when ``bias`` is the address of ``n`` float32 values (0: none)."""
    return [PART_KIND, m, n, k, a, lda, b, ldb, c, ldc, SGEMM, int(ILP64), bias]


@numba.njit(inline="always")
def add_row(m: int, n: int, c: int, ldc: int, bias: int) -> None:
    """``C[i, :n] += bias`` for the m rows of ``C`` at ``c`` (row stride ``ldc``), ``bias`` the
    address of n float32 values: the band the GEMM just wrote, while it is in cache (the float32
    additions NumPy's ``y += bias`` makes, so the same bits)."""
    rows = numba.carray(address_as_pointer(c, np.float32), (m, ldc))  # (the last row's tail past n: never read)
    row = numba.carray(address_as_pointer(bias, np.float32), n)
    for i in range(m):
        y = rows[i]  # (a row view: LLVM vectorises this loop, 5x NumPy's broadcast add, not the flat index)
        for j in range(n):
            y[j] = y[j] + row[j]


@kernel
def add_bias(y: np.ndarray, bias: np.ndarray) -> None:
    """``y += bias`` for a 2-D float32 ``y`` with contiguous rows and a contiguous row ``bias`` of
    its width (`add_row` from Python: 2 µs where NumPy's broadcast add takes 10 on 128 x 512)."""
    m, n = y.shape
    if m > 0 and n > 0:
        add_row(m, n, y.ctypes.data, y.strides[0] // 4, bias.ctypes.data)


@numba.njit(inline="always")
def gemm_part(control: np.ndarray) -> None:
    """Run the `sgemm` posted in a spin team's ``control`` row (`gemm_arguments`), then its bias
    row if any: the helper's side."""
    at = ARGS
    m, n, c, ldc = control[at], control[at + 1], control[at + 7], control[at + 8]
    sgemm(control[at + 9], control[at + 10] != 0, m, n, control[at + 2], control[at + 3],
          control[at + 4], control[at + 5], control[at + 6], c, ldc)
    if control[at + 11] != 0 and m > 0 and n > 0:
        add_row(m, n, c, ldc, control[at + 11])


@kernel
def gemm(a: np.ndarray, b: np.ndarray, c: np.ndarray, fn: int, ilp64: bool) -> None:
    """``c = a @ b`` by `sgemm` (2-D float32 arrays whose rows are contiguous, any row strides),
    from Python: the calling thread's share of a GEMM split with a spin team."""
    m, k = a.shape
    sgemm(fn, ilp64, m, b.shape[1], k, a.ctypes.data, a.strides[0] // 4, b.ctypes.data, b.strides[0] // 4,
          c.ctypes.data, c.strides[0] // 4)


@kernel
def gemm_bias(a: np.ndarray, b: np.ndarray, c: np.ndarray, bias: np.ndarray, fn: int, ilp64: bool) -> None:
    """`gemm`, then ``c += bias`` row by row (``bias``: contiguous float32, c's width)."""
    m, k = a.shape
    n = b.shape[1]
    sgemm(fn, ilp64, m, n, k, a.ctypes.data, a.strides[0] // 4, b.ctypes.data, b.strides[0] // 4,
          c.ctypes.data, c.strides[0] // 4)
    if m > 0 and n > 0:
        add_row(m, n, c.ctypes.data, c.strides[0] // 4, bias.ctypes.data)


@kernel
def _matmul(fn: int, ilp64: bool, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    m, k = a.shape
    sgemm(fn, ilp64, m, b.shape[1], k, a.ctypes.data, k, b.ctypes.data, b.shape[1], c.ctypes.data, c.shape[1])


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether `sgemm` may be called: the symbol was found and a product through it equals
    NumPy's (checked once per process)."""
    if not SGEMM:
        return False
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 13)).astype(np.float32)
    b = rng.standard_normal((13, 5)).astype(np.float32)
    c = np.full((7, 5), np.nan, np.float32)
    try:
        _matmul(SGEMM, ILP64, a, b, c)
    except Exception:  # noqa: BLE001 - an unusable binding is no binding
        return False
    return bool(np.allclose(c, a @ b, rtol=1e-5, atol=1e-5))
