"""Compiled inner loops (numba) for kernels NumPy cannot run in one pass over memory.

NumPy runs a depthwise conv or a pooling window as one whole-array pass per kernel tap (9 passes
for 3x3, 25 for 5x5), each streaming the whole map through memory. Here such loops are written
once, plainly, and compiled by numba to machine code whose inner loop is a SIMD multiply-add over
a row held in L1.

- Every function is compiled with `kernel`: ``nogil`` (the CPU pool's threads run them side by
  side, as they run BLAS), no parallel runtime of numba's own (work is split by the pool, see
  ``conv_kernels.run_tasks``: one threading policy), ``error_model="numpy"`` (no Python
  exceptions inside loops), and ``cache=True``: compiled once per signature on first call, then
  loaded from numba's on-disk cache by later processes (about 1 s per kernel the first time).
  numba checks a cached function against its own file only, so a kernel calling kernels of
  other files (a `panels` block inside `few_rows.few_rows_matmul`, itself inside a
  `team_parts` runner) would keep running their old code after they changed: importing this
  package drops every cached kernel when any kernel source differs from the last import's
  (`cache_stamp`). A kernel loaded from the cache keeps its LLVM IR as bitcode, not as numba's
  parsed module (`cached_ir`: 36 MB for a serve loop that ran every kind of part), and loads without numba's target
  refreshed (0.4-0.7 s of a process's first run).
- Kernels have no default arguments (`kernel` refuses them): numba's dispatcher types a call that
  leaves one out on its slow path (`_compile_for_args`), about 80 µs a call against 1 µs: a
  depthwise conv's blocks of channels each paid it (MobileNetV3-small's 576ch@7 5x5 on one core:
  119 µs, 35 without).
- Kernels take C-contiguous arrays of one float dtype (float32 or float64; narrower floats are
  computed in float32 by the ops, as everywhere else) and write into an output the caller made.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import numba

from . import cache_stamp, cached_ir

F = TypeVar("F", bound=Callable[..., Any])

cache_stamp.refresh()  # (before any kernel loads from the cache: they load on their first call)
cached_ir.keep_bitcode_unparsed()


def _no_defaults(fn: Callable[..., Any]) -> None:
    """Refuse a kernel with default arguments (see the module docstring: a call that leaves one
    out takes numba's slow dispatch, about 80 µs)."""
    defaults = [p.name for p in inspect.signature(fn).parameters.values() if p.default is not p.empty]
    if defaults:
        raise TypeError(f"compiled kernel {fn.__qualname__} has default arguments {defaults}: numba's dispatcher "
                        "types a call that leaves one out on its slow path (about 80 µs a call); pass every argument")


def kernel(fn: F | None = None, *, contract: bool = True) -> Any:
    """Compile ``fn`` as an asyncinfer inner loop (see the module docstring for the options).

    ``contract`` lets LLVM fuse a multiply and an add into one FMA (one rounding instead of two);
    ``@kernel(contract=False)`` keeps every operation IEEE-rounded, for kernels that must give the
    very bits of a NumPy evaluation of the same formula."""
    def compile_(f: F) -> F:
        _no_defaults(f)
        return numba.njit(cache=True, nogil=True, error_model="numpy",
                          fastmath={"contract"} if contract else False)(f)
    return compile_(fn) if fn is not None else compile_


def reduction(fn: F) -> F:
    """Compile ``fn``, a helper that only reduces (sums, maxima along a row), letting LLVM reorder
    its additions (``reassoc``) so that the chain of dependent adds becomes SIMD partial sums: 5-10x
    faster. Results may differ from a sequential sum by rounding alone (NaN and inf propagate as
    before). Never for code that computes anything else: an ``exp``'s range reduction, reordered,
    loses its precision."""
    _no_defaults(fn)
    return numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract", "reassoc"})(fn)


def inline(fn: F) -> F:
    """Compile ``fn``, a scalar helper of kernels, to be inlined into each caller (numba's IR
    inlining: LLVM then vectorises the caller's loop through it instead of calling per element).
    Python code that needs the same formula calls ``fn.py_func``: a helper called from Python is
    compiled for that call, uncached, in every process (0.4 s of a first run)."""
    return numba.njit(inline="always", error_model="numpy", fastmath={"contract"})(fn)
