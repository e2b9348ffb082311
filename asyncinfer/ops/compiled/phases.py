"""Stride 2 across a row as two unit-stride ones: a row split into its even and odd columns.

A window loop at stride 2 reads every other input column: strided loads, which LLVM does not
vectorise. Split once into its two *phases*, the row gives every tap a contiguous run: the input
column ``2·ow + shift`` is element ``ow + q`` of phase ``shift % 2`` (`phase_tap`). Used by the
depthwise conv and max pool loops (`split_even_odd`, a row into two arrays), and by a stride-2
stem's padded copy (`split_pairs_at`, a row at an offset into two places of one array, a vector
of pairs at a time). The window loops keep LLVM's scalar loop: their rows are short and already
in L1, and the shuffled form measured 3-12% slower there; a 224-wide image row split by shuffles
took a third of the time.
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


@inline
def split_even_odd(src: np.ndarray, even: np.ndarray, odd: np.ndarray) -> None:
    """``even[q] = src[2q]`` and ``odd[q] = src[2q + 1]`` (``even`` one longer on odd widths)."""
    width = src.shape[0]
    for q in range(width // 2):
        even[_U(q)] = src[_U(2 * q)]
        odd[_U(q)] = src[_U(2 * q + 1)]
    if width % 2:
        even[_U(width // 2)] = src[_U(width - 1)]


@intrinsic
def _split_pairs(typingctx: Any, target: Any, even: Any, odd: Any, source: Any, at: Any) -> Any:
    """``target[even + i] = source[at + 2i]`` and ``target[odd + i] = source[at + 2i + 1]`` for
    the ``i`` < one vector's lanes: two vector loads, two shuffles, two stores (LLVM's own loop
    moved the values one at a time)."""
    if not (isinstance(target, types.Array) and isinstance(source, types.Array) and target.dtype == source.dtype
            and target.ndim == source.ndim == 1 and target.layout == source.layout == "C"):
        return None
    signature = types.void(target, even, odd, source, at)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        target_arr, source_arr = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 3))
        even_, odd_, at_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 4))
        element = context.get_value_type(sig.args[0].dtype)
        size = context.get_abi_sizeof(element)
        lanes = VECTOR_BYTES // size
        vector, picks = ir.VectorType(element, lanes), ir.VectorType(ir.IntType(32), lanes)

        def pointer(array: Any, index: Any) -> Any:
            return builder.bitcast(builder.gep(array.data, [index]), vector.as_pointer())
        low = builder.load(pointer(source_arr, at_), align=size)
        high = builder.load(pointer(source_arr, builder.add(at_, ir.Constant(ir.IntType(64), lanes))), align=size)
        for first, place in ((0, even_), (1, odd_)):
            picked = builder.shuffle_vector(low, high, ir.Constant(picks, [2 * i + first for i in range(lanes)]))
            builder.store(picked, pointer(target_arr, place), align=size)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _lanes_of(typingctx: Any, array: Any) -> Any:
    """The values of ``array``'s type one vector holds, a constant of the compiled code (read from
    the array at run time, it cost the split a third more time)."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        size = context.get_abi_sizeof(context.get_value_type(sig.args[0].dtype))
        return ir.Constant(ir.IntType(64), VECTOR_BYTES // size)

    return types.int64(array), codegen


@inline
def split_pairs_at(source: np.ndarray, at: int, width: int, target: np.ndarray, even: int, odd: int) -> None:
    """``target[even + q] = source[at + 2q]`` and ``target[odd + q] = source[at + 2q + 1]`` for a
    row of ``width`` values (flat arrays; the even phase one longer on odd widths), a vector of
    pairs at a time (`_split_pairs`), then the rest one pair at a time."""
    pairs = width // 2
    lanes = _lanes_of(source)
    vectored = pairs // lanes * lanes
    for q in range(0, vectored, lanes):
        _split_pairs(target, even + q, odd + q, source, at + 2 * q)
    for q in range(vectored, pairs):
        target[_U(even + q)] = source[_U(at + 2 * q)]
        target[_U(odd + q)] = source[_U(at + 2 * q + 1)]
    if width % 2:
        target[_U(even + pairs)] = source[_U(at + width - 1)]


@inline
def phase_tap(shift: int, width: int, out_width: int) -> tuple[int, int, int, int]:
    """For the tap reading input column ``2·ow + shift`` of a row ``width`` wide: ``(parity, q,
    lo, hi)``, its phase, the offset into it, and the outputs ``lo <= ow < hi`` it reaches inside
    the row (the phase holds ``(width + 1 - parity) // 2`` columns)."""
    parity = shift % 2
    lo = 0 if shift >= 0 else (1 - shift) // 2
    hi = min(out_width, (width - 1 - shift) // 2 + 1)
    return parity, (shift - parity) // 2, lo, hi
