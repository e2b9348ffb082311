"""What a channel-blocked layout would buy ResNet's 1x1 convs: a prototype against the kernel and ORT.

asyncinfer keeps every map in NCHW. Its 1x1 conv on a map (`compiled.pointwise.small_map_conv`)
sums a block of 14 positions x 32 output channels in registers, broadcasting each position's
input value of a channel, a step per input channel: each step reads one row of the block from
another channel plane (12.5 KB apart at 56x56: as many streams as input channels), and the
finished block is stored transposed (8x8 shuffles) into 32 channel planes. ONNX Runtime reorders
a CNN's maps into NCHWc once (channels in blocks of 16, each position's 16 values on one cache
line) and runs its convs there: a step then reads 14 values 64 bytes apart within one block's
stream, and a finished block is 28 whole vectors stored as they are.

This script times, on one core and with the operands in cache, the 1x1 convs of ResNet-50
(Conv + Relu, random weights):

- ``asyncinfer``: the layer as a model of one Conv + Relu runs it (`worker.profile()`);
- ``ORT``: ONNX Runtime's Conv kernel time on the same model (its reorders are nodes of their
  own, not counted: in a model they run once at its ends);
- ``blocked``: a prototype block over NCHW16c input and output (`blocked_block`): the same 14 x 2
  vectors of sums, the weights in panels of 32 output channels, no bands, no prefetches, a Relu.
  Its result is checked against NumPy's before it is timed.

On the 2-vCPU Xeon (AVX-512) of 2026-12-04 (the fifty-first session), one run, µs asyncinfer /
ORT / blocked: 256 -> 64 at 56x56 800 / 527 / 535, 64 -> 256 at 56x56 765 / 521 / 526, 256 -> 128
at 56x56 1415 / 992 / 1131, 512 -> 128 at 28x28 681 / 508 / 557, 128 -> 512 at 28x28 659 / 496 /
465, 1024 -> 256 at 14x14 564 / 507 / 545, 2048 -> 512 at 7x7 632 / 560 / 664. The blocked layout
takes away the penalty of large maps: 182-221 GFLOP/s at 56x56 and 28x28, where the NCHW kernel
makes 129-156 (182 at 14x14). Not a test: a measurement to choose the next step
(docs/benchmarks.md, fifty-first session).

    python3 bench/blocked_layout.py [--repeats 50]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout's asyncinfer and bench importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numba
import numpy as np
import onnx
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from onnx import TensorProto, helper, numpy_helper

from asyncinfer.ops.compiled.panels import BlockIR
from bench.conv_layers import ort_conv_times, our_conv_times

#: Positions a block (its rows) and output channels a panel (two vectors of 16).
ROWS, PANEL = 14, 32
#: Channels of one block of the layout: one cache line of float32.
CHANNEL_BLOCK = 16
#: ResNet-50's 1x1 convs: (input channels, output channels, map side).
SHAPES = ((256, 64, 56), (64, 256, 56), (256, 128, 56), (512, 128, 28), (128, 512, 28), (1024, 256, 14),
          (2048, 512, 7))


@intrinsic
def blocked_block(typingctx: Any, x: Any, w: Any, y: Any, p: Any, first: Any, positions: Any) -> Any:
    """``block(x, w, y, p, first, positions)``: output channels ``32·p`` to ``32·p + 31`` at
    positions ``first`` to ``first + 13`` of ``y`` (M/16, HW, 16) = Relu of ``x`` (C/16, HW, 16)
    times ``w`` (M/32, C, 32), summed over C in registers (one broadcast of a position's input value
    and two FMAs a row a step), stored as 28 vectors."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        x_arr, w_arr, y_arr = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 2))
        p_, first_, positions_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (3, 4, 5))
        code = BlockIR(context, builder, sig.args[0].dtype)
        size, at, const = code.size, code.at, code.const
        # a vector is a block of 16 channels whatever the CPU's width (LLVM splits it for AVX2, NEON)
        vector = ir.VectorType(ir.FloatType(), CHANNEL_BLOCK)
        i32 = ir.IntType(32)
        line = const(CHANNEL_BLOCK * size)
        plane = builder.mul(positions_, line)  # one block of channels of the whole map
        row_stride = builder.extract_value(w_arr.strides, 1)
        panel = at(w_arr.data, builder.mul(p_, builder.extract_value(w_arr.strides, 0)))
        zero = ir.Constant(vector, [0.0] * vector.count)
        undefined = ir.Constant(vector, ir.Undefined)
        broadcast = ir.Constant(ir.VectorType(i32, vector.count), [0] * vector.count)
        sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(ROWS)]
        origin = at(x_arr.data, builder.mul(first_, line))
        with cgutils.for_range(builder, builder.extract_value(x_arr.shape, 0)) as block:
            values = at(origin, builder.mul(block.index, plane))
            weights = at(panel, builder.mul(builder.mul(block.index, const(CHANNEL_BLOCK)), row_stride))
            with cgutils.for_range(builder, const(CHANNEL_BLOCK)) as channel:
                row = at(weights, builder.mul(channel.index, row_stride))
                columns = [builder.load(builder.bitcast(at(row, builder.mul(const(v), line)), vector.as_pointer()),
                                        align=size) for v in range(2)]
                step = at(values, builder.mul(channel.index, const(size)))
                for r in range(ROWS):
                    value = builder.load(builder.bitcast(at(step, builder.mul(const(r), line)),
                                                         vector.element.as_pointer()), align=size)
                    spread = builder.shuffle_vector(builder.insert_element(undefined, value, ir.Constant(i32, 0)),
                                                    undefined, broadcast)
                    for v in range(2):
                        product = builder.fmul(spread, columns[v], flags=("contract",))
                        builder.store(builder.fadd(builder.load(sums[r][v]), product, flags=("contract",)),
                                      sums[r][v])
        for r in range(ROWS):
            for v in range(2):
                out_block = builder.add(builder.mul(p_, const(2)), const(v))
                target = at(y_arr.data, builder.add(builder.mul(out_block, plane),
                                                    builder.mul(builder.add(first_, const(r)), line)))
                value = builder.load(sums[r][v])
                value = builder.select(builder.fcmp_ordered(">", value, zero), value, zero)
                builder.store(value, builder.bitcast(target, vector.as_pointer()), align=size)
        return context.get_dummy_value()

    return types.void(x, w, y, p, first, positions), codegen


@numba.njit(nogil=True)
def blocked_conv(x: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:
    """Every panel over every block of positions (the last overlapping the one before)."""
    positions = x.shape[1]
    for p in range(w.shape[0]):
        for first in range(0, positions, ROWS):
            blocked_block(x, w, y, p, min(first, positions - ROWS), positions)


def one_conv(c: int, m: int, side: int, rng: np.random.Generator) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """A model of one 1x1 Conv + Relu, its weight (M, C) and an input (1, C, side, side)."""
    w = (rng.standard_normal((m, c)) / np.sqrt(c)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["t"], kernel_shape=[1, 1]), helper.make_node("Relu", ["t"], ["y"])],
        "one_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, side, side])],
        [numpy_helper.from_array(w.reshape(m, c, 1, 1), "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return proto, w, rng.standard_normal((1, c, side, side)).astype(np.float32)


def time_blocked(w: np.ndarray, x: np.ndarray, repeats: int) -> float:
    """The prototype's median µs on ``x`` reordered to NCHW16c, its result checked first."""
    m, c = w.shape
    positions = x.shape[2] * x.shape[3]
    flat = x.reshape(c, positions)
    blocked = np.ascontiguousarray(flat.reshape(c // CHANNEL_BLOCK, CHANNEL_BLOCK, positions).transpose(0, 2, 1))
    panels = np.ascontiguousarray(w.T.reshape(c, m // PANEL, PANEL).transpose(1, 0, 2))
    y = np.empty((m // CHANNEL_BLOCK, positions, CHANNEL_BLOCK), np.float32)
    blocked_conv(blocked, panels, y)
    result = y.transpose(0, 2, 1).reshape(m, positions)
    np.testing.assert_allclose(result, np.maximum(w @ flat, 0), rtol=1e-4, atol=1e-4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        blocked_conv(blocked, panels, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'1x1 conv':>22s} {'asyncinfer µs':>14s} {'ORT µs':>8s} {'blocked µs':>11s}   GFLOP/s (each)")
    for c, m, side in SHAPES:
        proto, w, x = one_conv(c, m, side, rng)
        ours = our_conv_times(proto, {"x": x}, 1, args.repeats)[0]["us"]
        theirs = ort_conv_times(proto, {"x": x}, 1, args.repeats)[0]
        blocked = time_blocked(w, x, args.repeats)
        flops = 2 * c * m * side * side / 1e3
        print(f"{c:>5d} -> {m:<4d} at {side:>2d}x{side:<2d} {ours:14.0f} {theirs:8.0f} {blocked:11.0f}   "
              f"{flops / ours:5.0f} {flops / theirs:5.0f} {flops / blocked:5.0f}")


if __name__ == "__main__":
    main()
