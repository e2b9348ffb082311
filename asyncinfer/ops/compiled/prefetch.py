"""Software prefetches, for streams the hardware prefetchers serve too late or not at all.

A store to a line that is not in the cache first reads the line (for ownership); in a model's
run a kernel's output has left the cache since the run before, and each such miss holds the
stores up. `prefetch_lines_for_write` asks for the lines of a span ahead of its stores, with the
intent to write, so they arrive while the kernel computes (`compiled.direct`: a stem's 16 to 64
output planes written a row at a time). `prefetch_lines_for_read` does the same for a span to be
read (`compiled.few_rows`: a GEMV's one stream of weights, whose hardware prefetch reaches too
short a way ahead to cover the memory's latency).
"""
from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Bytes of a cache line.
LINE = 64


def _prefetcher(write: int) -> Any:
    """An intrinsic ``(array, start, count)`` prefetching the cache lines of
    ``array.flat[start:start + count]`` (a C-contiguous array; a prefetch never faults, so a span
    past the array's end is harmless), for writing or for reading."""

    @intrinsic
    def prefetch_lines(typingctx: Any, array: Any, start: Any, count: Any) -> Any:
        signature = types.void(array, start, count)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            i32, i64 = ir.IntType(32), ir.IntType(64)
            byte_ptr = ir.IntType(8).as_pointer()
            data = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, byte_ptr)
            size = context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype))
            start_, count_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2))
            first = builder.gep(data, [builder.mul(start_, ir.Constant(i64, size))])
            nbytes = builder.mul(count_, ir.Constant(i64, size))
            prefetch = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
                ir.VoidType(), [byte_ptr, i32, i32, i32]))
            lines = builder.udiv(builder.add(nbytes, ir.Constant(i64, LINE - 1)), ir.Constant(i64, LINE))
            with cgutils.for_range(builder, lines) as loop:
                at = builder.gep(first, [builder.mul(loop.index, ir.Constant(i64, LINE))])
                builder.call(prefetch, [at, ir.Constant(i32, write), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return signature, codegen

    return prefetch_lines


#: ``prefetch_lines_for_write(array, start, count)``: the lines of ``array.flat[start:start +
#: count]`` asked for with the intent to write (see the module docstring).
prefetch_lines_for_write = _prefetcher(1)
#: ``prefetch_lines_for_read(array, start, count)``: the same, to be read.
prefetch_lines_for_read = _prefetcher(0)
