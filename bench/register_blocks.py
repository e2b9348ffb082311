"""Register blocks of a direct 3x3 conv's inner loop, on one core: which shape of block sums fastest.

A direct conv's register block holds R output positions x V vectors of output channels (16
float32 lanes a vector with AVX-512) and, per tap, loads V vectors of weights and broadcasts R
input values: R·V multiply-adds for V + R loads. `compiled.direct_panels` uses R = 8, V = 2, each
position with its own start (a block may cross the end of an output row). This script times, on
ResNet's 3x3 64 -> 64 at 56x56 (the sums only: no padding copy, no finishing, no transposed
store):

- ``starts RxV``: the kernel's own block (`direct_panels._tap_block`), R positions' starts each;
- ``row RxV``: a prototype whose R positions are consecutive on one output row (stride 1), read
  from one origin pointer, so the block needs no register per position.

GFLOP/s counts every lane of a panel (8x3's 48-channel panels cover the 64 channels as 96). On
the 2-vCPU Xeon (AVX-512) of 2026-12-04, three runs: starts 8x2 160-178 GFLOP/s, starts 12x2
96-113 (out of registers: 12 starts + 24 sums), row 8x2 146-161, row 12x2 172-188, row 14x2
186-199, row 8x3 170-198, row 6x4 158-186; ONNX Runtime's whole conv ran at 189. Not a test: a
measurement to choose the next block shape (docs/benchmarks.md, forty-seventh session).

    python3 bench/register_blocks.py [--repeats 25]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from asyncinfer.ops.compiled.direct_panels import WIDTH, _tap_block
from asyncinfer.ops.compiled.panels import BlockIR, VECTOR_BYTES
from asyncinfer.ops.compiled.pointwise import finishing

CHANNELS, SIZE = 64, 56  # ResNet-18's 3x3 64 -> 64 at 56x56, stride 1, padded to 58x58
PADDED = SIZE + 2


def row_block(rows: int, vectors: int) -> Any:
    """An intrinsic ``block(image, offsets, base, taps, panels, p, y)``: ``y[r, :] = Σ_t
    image[base + offsets[t] + r] · panels[p, t, :]`` for ``r < rows``, the sums in registers."""

    @intrinsic
    def block(typingctx: Any, image: Any, offsets: Any, base: Any, taps: Any, panels: Any, p: Any, y: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            image_arr, offsets_arr, panel_arr, y_arr = (context.make_array(sig.args[i])(context, builder, args[i])
                                                        for i in (0, 1, 4, 6))
            base_, taps_, p_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3, 5))
            code = BlockIR(context, builder, sig.args[0].dtype)
            size, vector, at, const = code.size, code.vector, code.at, code.const
            i32 = ir.IntType(32)
            undefined = ir.Constant(vector, ir.Undefined)
            broadcast = ir.Constant(ir.VectorType(i32, vector.count), [0] * vector.count)
            panel_stride, row_stride = (builder.extract_value(panel_arr.strides, i) for i in (0, 1))
            panel = at(panel_arr.data, builder.mul(p_, panel_stride))
            origin = at(image_arr.data, builder.mul(base_, const(size)))
            zero = ir.Constant(vector, [0.0] * vector.count)
            sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(vectors)] for _ in range(rows)]
            with cgutils.for_range(builder, taps_) as loop:
                tap = at(origin, builder.mul(builder.load(builder.gep(offsets_arr.data, [loop.index])), const(size)))
                row = at(panel, builder.mul(loop.index, row_stride))
                columns = [builder.load(builder.bitcast(at(row, const(v * VECTOR_BYTES)), vector.as_pointer()),
                                        align=size) for v in range(vectors)]
                for r in range(rows):
                    value = builder.load(builder.bitcast(at(tap, const(r * size)), vector.element.as_pointer()),
                                         align=size)
                    spread = builder.shuffle_vector(builder.insert_element(undefined, value, ir.Constant(i32, 0)),
                                                    undefined, broadcast)
                    for v, column in enumerate(columns):
                        product = builder.fmul(spread, column, flags=("contract",))
                        builder.store(builder.fadd(builder.load(sums[r][v]), product, flags=("contract",)),
                                      sums[r][v])
            y_stride = builder.extract_value(y_arr.strides, 0)
            for r in range(rows):
                for v in range(vectors):
                    target = at(y_arr.data, builder.add(builder.mul(const(r), y_stride), const(v * VECTOR_BYTES)))
                    builder.store(builder.load(sums[r][v]), builder.bitcast(target, vector.as_pointer()), align=size)
            return context.get_dummy_value()

        return types.void(image, offsets, base, taps, panels, p, y), codegen

    return block


def row_sweep(rows: int, vectors: int) -> Callable[..., None]:
    """Every panel over every output row, ``rows`` positions a block (whole blocks of a row only)."""
    block = row_block(rows, vectors)

    @numba.njit
    def sweep(image: np.ndarray, offsets: np.ndarray, panels: np.ndarray, y: np.ndarray) -> None:
        for p in range(panels.shape[0]):
            for oy in range(SIZE):
                for j in range(SIZE // rows):
                    block(image, offsets, oy * PADDED + j * rows, offsets.shape[0], panels, p, y)

    return sweep


def starts_sweep(rows: int) -> Callable[..., None]:
    """The kernel's own block (`direct_panels._tap_block`) over the map's positions end to end."""
    block = _tap_block(rows)
    finish = finishing(0)

    @numba.njit
    def sweep(image: np.ndarray, offsets: np.ndarray, panels: np.ndarray, y: np.ndarray) -> None:
        starts = np.empty(rows, np.int64)
        bias = np.zeros(panels.shape[0] * panels.shape[2], np.float32)
        for p in range(panels.shape[0]):
            for v in range(0, SIZE * SIZE // rows * rows, rows):
                for r in range(rows):
                    starts[r] = (v + r) // SIZE * PADDED + (v + r) % SIZE
                block(image, offsets, 0, starts, offsets.shape[0], panels, p, y, finish, bias, np.float32(0),
                      np.float32(0))

    return sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    image = rng.standard_normal(CHANNELS * PADDED * PADDED + 64).astype(np.float32)
    offsets = np.array([c * PADDED * PADDED + ky * PADDED + kx
                        for c in range(CHANNELS) for ky in range(3) for kx in range(3)], np.int64)
    lanes = VECTOR_BYTES // 4
    cases = [(f"starts {r}x{WIDTH // lanes}", starts_sweep(r), r, WIDTH // lanes) for r in (8, 12)]
    cases += [(f"row {r}x{v}", row_sweep(r, v), r, v) for r, v in ((8, 2), (12, 2), (14, 2), (8, 3), (6, 4))]
    for name, sweep, rows, vectors in cases:
        width = vectors * lanes
        panels = rng.standard_normal((-(-CHANNELS // width), offsets.size, width)).astype(np.float32)
        y = np.empty((rows, width), np.float32)
        sweep(image, offsets, panels, y)  # compile
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            sweep(image, offsets, panels, y)
            times.append(time.perf_counter() - start)
        positions = SIZE * SIZE // rows * rows if name.startswith("starts") else SIZE * (SIZE // rows) * rows
        flops = 2 * positions * panels.shape[0] * width * offsets.size
        median = statistics.median(times)
        print(f"{name:12s} {median * 1e6:8.0f} µs {flops / median / 1e9:7.1f} GFLOP/s")


if __name__ == "__main__":
    main()
