"""Stride 2 across a row as two unit-stride ones: a row split into its even and odd columns.

A window loop at stride 2 reads every other input column: strided loads, which LLVM does not
vectorise. Split once into its two *phases*, the row gives every tap a contiguous run: the input
column ``2·ow + shift`` is element ``ow + q`` of phase ``shift % 2`` (`phase_tap`). Used by the
depthwise conv and max pool loops.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import inline
from .panels import VECTOR_BYTES

_U = np.uint64


@intrinsic
def _split_vector(typingctx: Any, src: Any, even: Any, odd: Any, q: Any) -> Any:
    """``even[q + i] = src[2(q + i)]``, ``odd[q + i] = src[2(q + i) + 1]`` for the ``i`` < one
    vector's lanes (`VECTOR_BYTES`): two vector loads, two shuffles that pick the even and the odd
    lanes of the pair, two vector stores. C-contiguous 1-D arrays of one type."""
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == src.dtype
               for a in (src, even, odd)):
        return None
    signature = types.void(src, even, odd, q)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        src_arr, even_arr, odd_arr = (context.make_array(sig.args[i])(context, builder, args[i]) for i in range(3))
        first = context.cast(builder, args[3], sig.args[3], types.int64)
        element = context.get_value_type(sig.args[0].dtype)
        size = context.get_abi_sizeof(element)
        lanes = VECTOR_BYTES // size
        vector = ir.VectorType(element, lanes)
        picks = ir.VectorType(ir.IntType(32), lanes)

        def vector_at(data: Any, index: Any) -> Any:
            return builder.bitcast(builder.gep(data, [index]), vector.as_pointer())
        pair = builder.mul(first, ir.Constant(ir.IntType(64), 2))
        low = builder.load(vector_at(src_arr.data, pair), align=size)
        high = builder.load(vector_at(src_arr.data, builder.add(pair, ir.Constant(ir.IntType(64), lanes))),
                            align=size)
        for parity, target in ((0, even_arr), (1, odd_arr)):
            lanes_of = builder.shuffle_vector(low, high, ir.Constant(picks, [2 * i + parity for i in range(lanes)]))
            builder.store(lanes_of, vector_at(target.data, first), align=size)
        return context.get_dummy_value()

    return signature, codegen


@inline
def split_even_odd(src: np.ndarray, even: np.ndarray, odd: np.ndarray) -> None:
    """``even[q] = src[2q]`` and ``odd[q] = src[2q + 1]`` (``even`` one longer on odd widths):
    whole vectors of each phase by shuffles (`_split_vector`: a strided loop is one value at a
    time, which LLVM does not vectorise), the rest value by value. C-contiguous 1-D arrays."""
    width = src.shape[0]
    lanes = VECTOR_BYTES // src.itemsize
    whole = width // (2 * lanes) * lanes
    for q in range(0, whole, lanes):
        _split_vector(src, even, odd, q)
    for q in range(whole, width // 2):
        even[_U(q)] = src[_U(2 * q)]
        odd[_U(q)] = src[_U(2 * q + 1)]
    if width % 2:
        even[_U(width // 2)] = src[_U(width - 1)]


@inline
def phase_tap(shift: int, width: int, out_width: int) -> tuple[int, int, int, int]:
    """For the tap reading input column ``2·ow + shift`` of a row ``width`` wide: ``(parity, q,
    lo, hi)``, its phase, the offset into it, and the outputs ``lo <= ow < hi`` it reaches inside
    the row (the phase holds ``(width + 1 - parity) // 2`` columns)."""
    parity = shift % 2
    lo = 0 if shift >= 0 else (1 - shift) // 2
    hi = min(out_width, (width - 1 - shift) // 2 + 1)
    return parity, (shift - parity) // 2, lo, hi
