"""The tiled 2-D conv (asyncinfer/ops/conv_gemm.py) and the epilogue that stores its blocks
(asyncinfer/ops/epilogue.py, compiled/epilogue.py).

Checked against onnx's reference implementation across the ways a conv is cut up (blocks of
positions, bands of output channels, groups, threads, exact and flat im2col), and fused
activations against the standalone activation ops bit for bit.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from asyncinfer import ops
from asyncinfer.concurrency import parallel
from asyncinfer.model.ir import Layer
from asyncinfer.ops import conv_direct, conv_gemm, conv_pointwise
from asyncinfer.ops.epilogue import Epilogue

from .op_testing import EPILOGUE_ACTIVATIONS, activation_op, make_op, randn, reference_run, spin_team_bound

_POOL = ThreadPoolExecutor(2, thread_name_prefix="test-conv-gemm")


@pytest.fixture(autouse=True)
def _one_by_one_on_the_tiled_conv(monkeypatch):
    """Float32 1x1 convs run on `conv_pointwise` (tests/ops/test_conv_pointwise.py): here they stay
    on the tiled conv's pointwise path, which float64 and padded 1x1 convs still take."""
    monkeypatch.setattr(conv_pointwise, "MIN_POSITIONS", 1 << 40)


@pytest.fixture(autouse=True)
def _deep_convs_on_the_tiled_conv(monkeypatch):
    """Deep float32 convs run on the direct panel kernel (tests/ops/test_conv_direct.py): here they
    stay on the tiled conv, which float64 and grouped convs still take."""
    monkeypatch.setattr(conv_direct, "PANEL_MIN_DEPTH", 1 << 40)

# name: (x shape, output channels, kernel, attrs)
CASES = {
    "3x3_pad": ((1, 5, 11, 13), 7, (3, 3), dict(pads=[1, 1, 1, 1])),
    "3x3_stride2_asym": ((2, 4, 12, 11), 6, (3, 3), dict(strides=[2, 2], pads=[1, 0, 2, 1])),
    "7x7_stride2_stem": ((1, 3, 23, 21), 8, (7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3])),
    "dilated": ((1, 4, 13, 12), 5, (3, 3), dict(dilations=[2, 3], pads=[2, 3, 2, 3])),
    "1x1_direct": ((2, 6, 9, 10), 70, (1, 1), {}),
    "1x1_strided": ((1, 6, 9, 10), 8, (1, 1), dict(strides=[2, 3])),
    "1x1_one_position": ((2, 3, 5, 6), 4, (1, 1), dict(strides=[5, 6])),  # strides dropped: one output
    "grouped": ((1, 8, 9, 9), 12, (3, 3), dict(group=4, pads=[1, 1, 1, 1])),
    "small_map_many_channels": ((1, 40, 3, 3), 96, (3, 3), dict(pads=[1, 1, 1, 1])),
    "rect_kernel_no_pads": ((1, 3, 10, 14), 4, (2, 5), {}),
    "1d": ((2, 5, 40), 6, (5,), dict(strides=[2], pads=[2, 1])),
}


def _run_case(name: str, rng, bias: bool = True) -> tuple[np.ndarray, np.ndarray]:
    shape, m, kernel, attrs = CASES[name]
    group = attrs.get("group", 1)
    x = randn(rng, *shape)
    w = randn(rng, m, shape[1] // group, *kernel)
    inputs = [x, w] + ([randn(rng, m)] if bias else [])
    attrs = dict(attrs, kernel_shape=list(kernel))
    got = make_op("Conv", attrs, n_inputs=len(inputs))(*inputs)[0]
    return got, reference_run("Conv", inputs, attrs)[0]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cut", ["whole", "blocks", "threads"])
def test_matches_reference_however_it_is_cut(name, cut, rng, monkeypatch):
    """One block; many narrow blocks; and blocks or bands shared out between two threads."""
    if cut != "whole":
        monkeypatch.setattr(conv_gemm, "BLOCK_BYTES", 1)  # every block MIN_WIDTH wide
        monkeypatch.setattr(conv_gemm, "MIN_WIDTH", 16)
        monkeypatch.setattr(conv_gemm, "MIN_BAND_ROWS", 8)
    if cut == "threads":
        monkeypatch.setattr(conv_gemm, "SPLIT_MIN_MACS", 0)
        with parallel.pool_bound(_POOL.submit, 2):
            got, want = _run_case(name, rng)
    else:
        got, want = _run_case(name, rng)
    assert got.shape == want.shape and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("helpers", [1, 2])
def test_matches_reference_shared_with_the_spin_team(name, helpers, rng, monkeypatch):
    """The compiled conv (`compiled.conv_blocks`, sgemm from compiled code) with this thread and
    the team's helpers taking a part each: images, positions, or bands of channels (small maps),
    over exact, flat or no im2col, in narrow blocks."""
    from asyncinfer.ops import linalg

    monkeypatch.setattr(conv_gemm, "TEAM_MIN_MACS", 0)
    monkeypatch.setattr(linalg, "TEAM_MIN_MACS", 0)  # a 1x1 conv's GEMM
    monkeypatch.setattr(conv_gemm, "BLOCK_BYTES", 1)
    monkeypatch.setattr(conv_gemm, "MIN_WIDTH", 4)  # (3x3 maps: positions for two, bands for three)
    monkeypatch.setattr(conv_gemm, "MIN_BAND_ROWS", 4)
    with spin_team_bound(helpers) as runs:
        got, want = _run_case(name, rng, bias=name != "dilated")
    assert got.shape == want.shape and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # a batch of 1x1 convs is one batched matmul (pool threads split it); one position of four
    # channels makes fewer than three parts
    alone = name == "1x1_direct" or (name, helpers) == ("1x1_one_position", 2)
    assert runs.shared == (0 if alone else 1)


@pytest.mark.parametrize("name", ["3x3_stride2_asym", "dilated", "small_map_many_channels"])
def test_with_the_team_busy_every_part_runs_here(name, rng, monkeypatch):
    """Another caller holds the team: the parts cut for it (bands over prebuilt columns too) run
    one after another on this thread, and the result is the reference's."""
    monkeypatch.setattr(conv_gemm, "TEAM_MIN_MACS", 0)
    monkeypatch.setattr(conv_gemm, "MIN_WIDTH", 4)
    monkeypatch.setattr(conv_gemm, "MIN_BAND_ROWS", 4)
    with spin_team_bound(2) as runs, runs.busy():
        got, want = _run_case(name, rng)
    assert runs.shared == 0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_small_maps_split_output_channels_into_bands(rng, monkeypatch):
    """Too few positions to share out (a 3x3 map): bands of output channels run on the threads."""
    monkeypatch.setattr(conv_gemm, "SPLIT_MIN_MACS", 0)
    bands = []
    real = conv_gemm.Epilogue.store

    def spy(self, block, bias, out, v0, row_width, out_width):
        bands.append(block.shape[0])
        real(self, block, bias, out, v0, row_width, out_width)

    monkeypatch.setattr(conv_gemm.Epilogue, "store", spy)
    with parallel.pool_bound(_POOL.submit, 2):
        got, want = _run_case("small_map_many_channels", rng)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert len(bands) > 1 and sum(bands) == 96


@pytest.mark.parametrize("activation", sorted(EPILOGUE_ACTIVATIONS))
@pytest.mark.parametrize("name", ["3x3_pad", "dilated", "3x3_stride2_asym", "1x1_direct"])
def test_fused_activation_gives_the_bits_of_the_standalone_op(activation, name, rng):
    """Bias and activation applied as the blocks are stored equal the conv followed by the
    activation op, bit for bit, NaN and infinities included."""
    shape, m, kernel, attrs = CASES[name]
    x = randn(rng, *shape) * 3
    x.flat[::17] = np.nan
    x.flat[5::29] = np.inf
    w = randn(rng, m, shape[1], *kernel)
    b = randn(rng, m)
    conv = make_op("Conv", dict(attrs, kernel_shape=list(kernel)), n_inputs=3)
    act, extras = activation_op(activation)
    assert Epilogue.of([(act, extras)], np.dtype(np.float32)) is not None
    with np.errstate(all="ignore"):  # as on the pool's threads: NaN and inf are values in ONNX
        fused = conv(x, w, b, activations=[(act, extras)])[0]
        separate = act(conv(x, w, b)[0], *extras)[0]
    np.testing.assert_array_equal(fused, separate)
    assert np.isnan(fused).any()  # the NaN inputs reached the output through the epilogue


def test_activations_without_an_epilogue_still_apply(rng):
    """A chain of two, an activation the epilogue lacks, a float64 conv: applied after the conv."""
    x, w, b = randn(rng, 1, 3, 8, 8), randn(rng, 4, 3, 3, 3), randn(rng, 4)
    conv = make_op("Conv", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]), n_inputs=3)
    tanh = ops.create(Layer("t", "Tanh", ["y"], ["z"], version=13))
    relu, _ = activation_op("Relu")
    chain = [(tanh, []), (relu, [])]
    assert Epilogue.of(chain, np.dtype(np.float32)) is None
    np.testing.assert_array_equal(conv(x, w, b, activations=chain)[0],
                                  relu(tanh(conv(x, w, b)[0])[0])[0])
    x64, w64, b64 = (a.astype(np.float64) for a in (x, w, b))
    assert Epilogue.of([(relu, [])], np.dtype(np.float64)) is None
    got = conv(x64, w64, b64, activations=[(relu, [])])[0]
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, np.maximum(conv(x64, w64, b64)[0], 0))


def test_float16_conv_with_fused_activation_rounds_once(rng):
    """Narrow floats: multiplied, biased and activated in float32, rounded once to float16."""
    x, w, b = (randn(rng, *s).astype(np.float16) for s in ((1, 4, 9, 9), (6, 4, 3, 3), (6,)))
    conv = make_op("Conv", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]), n_inputs=3)
    act, extras = activation_op("HardSwish")
    got = conv(x, w, b, activations=[(act, extras)])[0]
    assert got.dtype == np.float16
    y32 = reference_run("Conv", [x.astype(np.float32), w.astype(np.float32), b.astype(np.float32)],
                        dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]))[0]
    want = (y32 * np.clip(y32 / 6 + 0.5, 0, 1)).astype(np.float16)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


def test_a_worker_hands_the_fused_activation_to_the_conv(rng, monkeypatch):
    """Through the optimizer (Conv + HardSwish fused) and the CPU backend: the conv's epilogue
    applies the activation, and the result is the reference's."""
    from onnx import TensorProto, helper, numpy_helper

    import asyncinfer as ai
    from asyncinfer.ops.compiled import epilogue as compiled

    x, w, b = randn(rng, 1, 3, 10, 10), randn(rng, 8, 3, 3, 3), randn(rng, 8)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("HardSwish", ["c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 10, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    kinds = []
    real = compiled.store_rows
    monkeypatch.setattr(compiled, "store_rows", lambda *a: kinds.append(a[6]) or real(*a))
    blocks = conv_gemm.conv_blocks  # (the compiled conv: its epilogue is argument 18)
    monkeypatch.setattr(conv_gemm, "conv_blocks", lambda *a: kinds.append(a[18]) or blocks(*a))
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        got = worker.run_blocking({"x": x})["y"]
    want = reference_run("Conv", [x, w, b], dict(pads=[1, 1, 1, 1]))[0]
    np.testing.assert_allclose(got, want * np.clip(want / 6 + 0.5, 0, 1), rtol=1e-5, atol=1e-5)
    assert kinds and set(kinds) == {compiled.HARD_SWISH}


@pytest.mark.parametrize("x_shape, w_shape, b_shape, message", [
    ((1, 2, 4, 4), (3, 1, 3, 3), (3,), "do not fit"),            # channels: 2 given, weights for 1
    ((1, 4, 4, 4), (3, 2, 3, 3), None, "do not fit"),            # group 2 needs M a multiple of 2
    ((1, 2, 4, 4), (3, 2, 3, 3), (4,), "bias of shape"),         # a bias per output channel
])
def test_operands_that_do_not_fit_are_a_clear_error(x_shape, w_shape, b_shape, message):
    from asyncinfer.errors import ExecutionError

    group = 2 if x_shape[1] == 4 else 1
    op = make_op("Conv", dict(group=group), n_inputs=3)
    args = [np.ones(x_shape, np.float32), np.ones(w_shape, np.float32)]
    args.append(None if b_shape is None else np.ones(b_shape, np.float32))
    with pytest.raises(ExecutionError, match=message):
        op(*args)


def test_one_layer_fed_alternating_shapes_keeps_each_geometry(rng):
    """A Conv layer remembers the window geometry per operand shape: a layer whose input size
    changes from run to run (dynamic axes, SAME padding) must use the geometry of each."""
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")
    op = make_op("Conv", attrs, n_inputs=3)
    w, b = randn(rng, 8, 3, 3, 3), randn(rng, 8)
    for size in (9, 16, 9, 7, 16):
        x = randn(rng, 1, 3, size, size + 1)
        want = reference_run("Conv", [x, w, b], attrs)[0]
        got = op(x, w, b)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", [None, "Relu", "HardSigmoid", "Clip"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_repeated_pointwise_conv_takes_the_short_way_with_the_same_bits(activation, bias, rng):
    """A Conv remembers its last one-image float32 1x1 case (`Conv._shortcut`: squeeze-and-
    excitation convs on 1x1 maps): the same operands and activations again take one GEMM, then
    bias and activation in place, with the bits of the full way; a new shape takes the full way
    first (and is remembered in turn: two images, a GEMM each, by `conv_gemm.conv2d`)."""
    op = make_op("Conv", {"kernel_shape": [1, 1]}, n_inputs=3)
    w, b = randn(rng, 24, 16, 1, 1), randn(rng, 24) if bias else None
    acts = [] if activation is None else [activation_op(activation)]
    for shape, short in [((1, 16, 1, 1), False), ((1, 16, 1, 1), True), ((1, 16, 3, 3), False),
                         ((1, 16, 3, 3), True), ((2, 16, 3, 3), False), ((2, 16, 3, 3), True),
                         ((1, 16, 3, 3), False)]:
        x = randn(rng, *shape) * 3
        x.flat[::7] = np.nan
        remembered = op._known
        with np.errstate(all="ignore"):
            got = op(x, w, b, activations=acts)[0]
            full = make_op("Conv", {"kernel_shape": [1, 1]}, n_inputs=3)(x, w, b, activations=acts)[0]
        assert (remembered is not None and remembered[0] == shape) is short
        np.testing.assert_array_equal(got, full)
        assert got.shape == (shape[0], 24) + shape[2:]
    other = randn(rng, 24, 16, 1, 1)  # new weights: the full way, and remembered in turn
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(op(x, other, b, activations=acts)[0],
                                      make_op("Conv", {"kernel_shape": [1, 1]}, n_inputs=3)(x, other, b,
                                                                                            activations=acts)[0])
    assert op._known[2] is other


SMALL_CASES = {  # name: (x shape, w shape, attrs): with a short way (`Conv._shortcut`)
    "1d_pad": ((1, 12, 9), (8, 12, 3), dict(pads=[1, 1])),
    "1d_stride_dilated": ((2, 6, 20), (5, 6, 3), dict(strides=[2], dilations=[2], pads=[0, 1])),
    "1d_pointwise": ((1, 16, 1), (1, 16, 1), {}),
    "1d_long_window": ((1, 1, 80), (10, 1, 32), dict(strides=[16])),
    "2d_groups": ((1, 8, 6, 7), (6, 4, 3, 3), dict(group=2, pads=[1, 0, 1, 2])),
    "2d_stride": ((1, 5, 9, 9), (7, 5, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "2d_1x1_stride2": ((2, 9, 5, 5), (6, 9, 1, 1), dict(strides=[2, 2])),
    # depthwise, whatever its size: its loop as planned once
    "2d_depthwise": ((1, 24, 9, 9), (24, 1, 3, 3), dict(group=24, pads=[1, 1, 1, 1])),
    "2d_depthwise_5x5_stride2": ((2, 20, 11, 11), (20, 1, 5, 5), dict(group=20, strides=[2, 2], pads=[2, 2, 2, 2])),
    "2d_depthwise_multiplier": ((1, 4, 8, 8), (8, 1, 3, 3), dict(group=4, pads=[1, 1, 1, 1])),
    "2d_depthwise_wide": ((1, 16, 6, 60), (16, 1, 3, 3), dict(group=16, pads=[1, 1, 1, 1])),
    "1d_depthwise": ((1, 8, 30), (8, 1, 5), dict(group=8, pads=[2, 2])),
}


@pytest.mark.parametrize("activation", [None, "Relu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(SMALL_CASES))
def test_a_repeated_small_conv_takes_the_short_way_with_the_bits_of_the_full_way(name, bias, activation, rng):
    """A small float32 conv run again with the same weights, bias and activations (a model's
    constants) takes `conv_gemm.small_conv`'s one compiled call, a depthwise one its planned loop
    (`Conv._shortcut`), with the bits of the full way and the definition's values; a new input
    shape takes the full way first."""
    x_shape, w_shape, attrs = SMALL_CASES[name]
    attrs = dict(attrs, kernel_shape=list(w_shape[2:]))
    op = make_op("Conv", attrs, n_inputs=3)
    w, b = randn(rng, *w_shape), randn(rng, w_shape[0]) if bias else None
    acts = [] if activation is None else [activation_op(activation)]
    other = x_shape[:-1] + (x_shape[-1] + 3,)
    for shape in (x_shape, x_shape, other, other):
        x = randn(rng, *shape)
        before = op._known
        got = op(x, w, b, activations=acts)[0]
        short = before is not None and before[0] == shape
        full = make_op("Conv", attrs, n_inputs=3)(x, w, b, activations=acts)[0]
        np.testing.assert_array_equal(got, full)
        expected = reference_run("Conv", [x, w] + ([b] if bias else []), attrs)[0]
        if activation:
            expected = np.maximum(expected, 0)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert short, "the last run, a case seen before, took the full way"
    assert op._known is not None and op._known[0] == other


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((1, 64, 24, 24), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1])),  # Winograd
    ((1, 8, 40, 40), (16, 8, 3, 3), dict(pads=[1, 1, 1, 1])),  # large enough for the spinning helpers
    ((2, 16, 12, 12), (24, 16, 1, 1), {}),  # two images, 1x1: one GEMM per image
])
def test_larger_convs_take_the_full_ways_kernel_straight_away(x_shape, w_shape, attrs, rng):
    """Past the small cases, the short way calls the kernel the full way ends in (Winograd, the
    tiled conv) with the same operands: the same bits."""
    attrs = dict(attrs, kernel_shape=list(w_shape[2:]))
    op = make_op("Conv", attrs, n_inputs=3)
    w, b = randn(rng, *w_shape), randn(rng, w_shape[0])
    op.bind_constants({1: w, 2: b})  # as a plan does: Winograd's transform is kept for constant weights
    for _ in range(3):
        x = randn(rng, *x_shape)
        np.testing.assert_array_equal(op(x, w, b)[0], make_op("Conv", attrs, n_inputs=3)(x, w, b)[0])
    assert op._known is not None and op._known[0] == x_shape


def test_float64_convs_have_no_short_way(rng):
    op = make_op("Conv", {"kernel_shape": [3]}, n_inputs=2)
    x, w = randn(rng, 1, 4, 9).astype(np.float64), randn(rng, 5, 4, 3).astype(np.float64)
    for _ in range(2):
        op(x, w)
    assert op._known is None and op._plain is not None and op._plain[0] == x.shape
