"""1x1 convs on the panel GEMM (asyncinfer/ops/conv_pointwise.py, compiled/pointwise.py, the
register blocks of compiled/panels.py).

Checked against onnx's reference implementation across the ways the kernel cuts its work
(partial last panel, leftover channel rows of 4, 2 and 1, depth in several blocks, channels in
several blocks, strides, several images) and the ways a plan shares it (images, panels of
positions, bands of channels, on one and two helpers, the team busy); fused activations against
the standalone ops bit for bit; and the bits the same however the work is split.
"""
from __future__ import annotations

import contextlib
import dataclasses
import types

import numpy as np
import pytest

from asyncinfer.ops import conv, conv_pointwise
from asyncinfer.ops.compiled import pointwise
from asyncinfer.ops.epilogue import NO_ACTIVATION, Epilogue

from .op_testing import (EPILOGUE_ACTIVATIONS, activation_op, assert_fused_activation_bits, make_op, randn, reference_run,
                         spin_team_bound)

_WIDTH = pointwise.panel_width(np.float32)
# name: (x shape, output channels, strides, group)
CASES = {
    "partial_panel": ((1, 5, 7, 9), 60, (1, 1), 1),        # 63 positions: one whole panel and a partial one
    "leftover_rows": ((1, 6, 10, 20), 15, (1, 1), 1),      # 15 channels: blocks of 8 (or 4), 4, 2, 1
    "deep": ((1, 300, 8, 16), 50, (1, 1), 1),              # depth in three blocks (DEPTH 128)
    "many_channels": ((1, 4, 5, 8), 1100, (1, 1), 1),      # channels in three blocks (CHANNELS 512)
    # from PACK_MIN_CHANNELS output channels a unit-stride conv packs its panels (two whole, one partial)
    "packed_unit_stride": ((1, 20, 8, 9), pointwise.PACK_MIN_CHANNELS + 3, (1, 1), 1),
    "strided": ((1, 7, 25, 37), 60, (2, 3), 1),
    "images": ((3, 6, 10, 10), 20, (1, 1), 1),
    "wide_map": ((1, 16, 40, 41), 24, (1, 1), 1),          # 1640 positions: panels to share out
    # an output over CACHED_OUTPUT_BYTES: blocks of channels through bands of panels
    "large_output": ((1, 8, 64, 72), 40, (1, 1), 1),
    "grouped": ((1, 12, 7, 9), 54, (1, 1), 3),             # bands of channels across the groups' edges
    "grouped_wide": ((2, 8, 20, 21), 36, (2, 1), 4),       # ShuffleNet's grouped 1x1s, strided, two images
    # three panels of channels: `small_map_conv` shares blocks of positions (MobileNetV3's 96 at 7x7)
    "three_panels": ((1, 24, 7, 7), 2 * _WIDTH + 1, (1, 1), 1),
    "three_panels_strided": ((1, 24, 13, 13), 2 * _WIDTH + 1, (2, 2), 1),
    # maps under 16 positions (SSDlite's extra layers and heads): one position, and a 3x3 map
    "one_position": ((1, 40, 1, 1), 70, (1, 1), 1),
    "three_by_three": ((2, 33, 3, 3), 2 * _WIDTH, (1, 1), 1),
    # `small_map_conv`'s input over SMALL_MAP_WHOLE_BYTES: positions in bands through every panel
    # (1023 = 4 bands and a rest), each band's last wide block overlapping the one before
    "banded": ((1, 272, 33, 31), 2 * _WIDTH + 5, (1, 1), 1),
    "banded_strided": ((1, 264, 66, 62), 40, (2, 2), 1),
}


@pytest.fixture(autouse=True, params=["panels", "small_map"])
def kernel(request, monkeypatch):
    """Every case on both kernels: `pointwise_conv` (positions in panels) on maps of any size,
    whatever panel padding they waste, and `small_map_conv` (channels in panels) at any depth."""
    monkeypatch.setattr(conv_pointwise, "MAX_WASTE", 1e9)
    monkeypatch.setattr(conv_pointwise, "MIN_POSITIONS", 1)
    small = request.param == "small_map"
    monkeypatch.setattr(conv_pointwise, "SMALL_MAP_DEPTH", 1 if small else 1 << 40)
    monkeypatch.setattr(conv_pointwise, "SMALL_MAP_WASTE_DEPTH", 1 if small else 1 << 40)
    monkeypatch.setattr(conv_pointwise, "SMALL_MAP", 1 << 40)
    return request.param


def _operands(name: str, rng):
    shape, m, strides, group = CASES[name]
    return (randn(rng, *shape), randn(rng, m, shape[1] // group, 1, 1), randn(rng, m),
            dict(kernel_shape=[1, 1], strides=list(strides), group=group))


def _plan(x, w, b, attrs, epilogue=NO_ACTIVATION):
    strides = tuple(attrs["strides"])
    out = tuple((size - 1) // s + 1 for size, s in zip(x.shape[2:], strides))
    return conv_pointwise.pointwise_plan(x.shape, w, b, attrs["group"], strides, out, epilogue)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_alone(name, kernel, rng, monkeypatch):
    x, w, b, attrs = _operands(name, rng)
    planned = []
    real = conv_pointwise.pointwise_plan
    monkeypatch.setattr(conv, "pointwise_plan", lambda *a, **k: planned.append(1) or real(*a, **k))
    got = make_op("Conv", attrs, n_inputs=3)(x, w, b)[0]
    assert planned  # (the full way took the panel GEMM)
    assert _plan(x, w, b, attrs).small_map == (kernel == "small_map")
    want = reference_run("Conv", [x, w, b], attrs)[0]
    assert got.shape == want.shape and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("helpers", [1, 2])
def test_shared_with_the_spin_team_gives_the_same_bits(name, helpers, kernel, rng, monkeypatch):
    """This thread and each helper take a part (images, whole panels, or bands of channels): the
    reference's result, and the very bits of the conv run whole on one thread."""
    monkeypatch.setattr(conv_pointwise, "TEAM_MIN_MACS", 0)
    x, w, b, attrs = _operands(name, rng)
    alone = conv_pointwise.run_pointwise(_plan(x, w, b, attrs), x)
    with spin_team_bound(helpers) as runs:
        plan = _plan(x, w, b, attrs)
        shared = conv_pointwise.run_pointwise(plan, x)
    # (a single panel of channels is one part: small_map_conv on 15 or 20 channels)
    assert runs.shared == (len(plan.parts) > 1) and (len(plan.parts) > 1 or kernel == "small_map")
    np.testing.assert_array_equal(shared, alone)
    np.testing.assert_allclose(shared, reference_run("Conv", [x, w, b], attrs)[0], rtol=1e-4, atol=1e-4)


def _shuffle(y: np.ndarray, group: int) -> np.ndarray:
    """ShuffleNet's channel shuffle of ``y`` (N, M, H, W) as its layers write it."""
    n, m, h, w = y.shape
    return y.reshape(n, group, m // group, h, w).transpose(0, 2, 1, 3, 4).reshape(n, m, h, w)


@pytest.mark.parametrize("name", ["grouped", "grouped_wide"])
@pytest.mark.parametrize("helpers", [0, 1, 2])
def test_a_shuffled_plan_stores_each_channel_in_its_shuffled_place(name, helpers, kernel, rng, monkeypatch):
    """``shuffled``: the plain conv's very bits, channel ``g·M/G + j`` stored at ``j·G + g`` (what
    `ShuffledConv` relies on), run alone or shared with the spin team."""
    monkeypatch.setattr(conv_pointwise, "TEAM_MIN_MACS", 0)
    x, w, b, attrs = _operands(name, rng)
    plain = conv_pointwise.run_pointwise(_plan(x, w, b, attrs), x)
    strides, out = tuple(attrs["strides"]), plain.shape[2:]
    with spin_team_bound(helpers) if helpers else contextlib.nullcontext() as runs:
        plan = conv_pointwise.pointwise_plan(x.shape, w, b, attrs["group"], strides, out, NO_ACTIVATION, shuffled=True)
        shuffled = conv_pointwise.run_pointwise(plan, x)
    assert plan.shuffled and plan.small_map == (kernel == "small_map")
    assert runs is None or runs.shared == (len(plan.parts) > 1)
    np.testing.assert_array_equal(shuffled, _shuffle(plain, attrs["group"]))


def test_parts_are_images_then_panels_then_channel_bands(kernel, rng, monkeypatch):
    monkeypatch.setattr(conv_pointwise, "TEAM_MIN_MACS", 0)
    width = pointwise.panel_width(np.float32)
    with spin_team_bound(1):
        x, w, b, attrs = _operands("images", rng)
        assert [tuple(part[:2]) for part in _plan(x, w, b, attrs).parts.tolist()] == [(0, 1), (1, 3)]
        if kernel == "small_map":  # panels of channels through the groups, or blocks of positions
            x, w, b, attrs = _operands("grouped", rng)  # 3 groups of 18 channels, 63 positions
            total = 3 * -(-18 // width)
            assert [tuple(part) for part in _plan(x, w, b, attrs).parts.tolist()] == conv_pointwise._small_map_parts(1, total, 63, 2)
            return
        x, w, b, attrs = _operands("wide_map", rng)
        cuts = [part[2:4] for part in _plan(x, w, b, attrs).parts.tolist()]
        assert cuts[0][0] == 0 and cuts[0][1] == cuts[1][0] and cuts[1][1] == 1640 and cuts[0][1] % width == 0
        assert cuts[0][1] >= 1640 - cuts[0][1]  # (the partial panel goes with the fewer panels)
        x, w, b, attrs = _operands("many_channels", rng)
        bands = [part[4:] for part in _plan(x, w, b, attrs).parts.tolist()]
        assert bands[0][0] == 0 and bands[0][1] == bands[1][0] and bands[1][1] == 1100
        assert bands[0][1] % conv_pointwise.BLOCK_ROWS == 0


def test_helpers_not_done_within_the_spin_are_waited_for_the_slow_way(kernel, rng, monkeypatch):
    """A compiled wait that gives up spinning at once (its rounds 0) leaves the caller to wait
    through `SpinTeam.wait_posted`: the same bits as the conv alone."""
    monkeypatch.setattr(conv_pointwise, "TEAM_MIN_MACS", 0)
    x, w, b, attrs = _operands("three_panels", rng)
    alone = conv_pointwise.run_pointwise(_plan(x, w, b, attrs), x)
    monkeypatch.setattr(conv_pointwise, "spin_team",  # (the team's own wait spins)
                        types.SimpleNamespace(WAIT_ROUNDS=0, PARTS_DONE=conv_pointwise.spin_team.PARTS_DONE))
    with spin_team_bound(1) as runs:
        waited = []
        real = runs.team.wait_posted
        runs.team.wait_posted = lambda helpers: (waited.append(helpers), real(helpers))
        shared = conv_pointwise.run_pointwise(_plan(x, w, b, attrs), x)
    assert runs.shared == 1 and waited == [1]
    np.testing.assert_array_equal(shared, alone)



def test_helpers_found_asleep_are_woken_before_the_callers_part(kernel, rng, monkeypatch):
    """Where the posting finds a helper asleep, the compiled call returns before running the
    caller's part; the caller wakes the team, then runs its part and waits: the same bits as the
    conv alone."""
    from asyncinfer.concurrency.spin_team import HELPERS_ASLEEP

    monkeypatch.setattr(conv_pointwise, "TEAM_MIN_MACS", 0)
    x, w, b, attrs = _operands("three_panels", rng)
    alone = conv_pointwise.run_pointwise(_plan(x, w, b, attrs), x)
    posted = []

    def post_pointwise_only(control, wt, x, y, bias, buffers, buffer, numbers, *rest):
        posted.append(pointwise.post_pointwise(control, wt, x, y, bias, buffers, numbers, *rest[:-1]))
        return HELPERS_ASLEEP

    def post_small_map_only(control, panels, x, y, bias, columns, own, residual, numbers, *rest):
        posted.append(pointwise.post_small_map(control, panels, x, y, bias, columns, residual, numbers, *rest[:-1]))
        return HELPERS_ASLEEP
    monkeypatch.setattr(conv_pointwise, "post_and_finish_pointwise", post_pointwise_only)
    monkeypatch.setattr(conv_pointwise, "post_and_finish_small_map", post_small_map_only)
    with spin_team_bound(1) as runs:
        shared = conv_pointwise.run_pointwise(_plan(x, w, b, attrs), x)
    assert runs.shared == 1 and len(posted) == 1 and runs.wakes == 1
    np.testing.assert_array_equal(shared, alone)

def test_panels_of_positions_or_bands_of_channels_whichever_shares_more_evenly():
    parts = conv_pointwise._panel_parts
    # 14x14: 7 panels split 4 / 3, 272 channels 136 / 136
    assert parts(1, 196, 272, 2, 32) == [(0, 1, 0, 196, 0, 136), (0, 1, 0, 196, 136, 272)]
    # 28x28: 25 panels split 13 / 12, 136 channels 17 blocks split 9 / 8 (a tie in panels' favour)
    assert parts(1, 784, 136, 2, 32) == [(0, 1, 0, 416, 0, 136), (0, 1, 416, 784, 0, 136)]
    assert parts(1, 40, 1100, 2, 32) == [(0, 1, 0, 40, 0, 544), (0, 1, 0, 40, 544, 1100)]  # a few panels
    assert parts(1, 1640, 12, 2, 32) == [(0, 1, 0, 832, 0, 12), (0, 1, 832, 1640, 0, 12)]  # few channels
    assert parts(2, 196, 272, 2, 32) == [(0, 1, 0, 196, 0, 272), (1, 2, 0, 196, 0, 272)]  # images first


def test_small_maps_split_by_even_panels_else_by_blocks_of_positions():
    parts = conv_pointwise._small_map_parts
    assert parts(1, 18, 49, 2) == [(0, 1, 0, 9, 0, 49), (0, 1, 9, 18, 0, 49)]  # panels divide evenly
    assert parts(1, 35, 49, 2) == [(0, 1, 0, 17, 0, 49), (0, 1, 17, 35, 0, 49)]  # many panels
    assert parts(1, 3, 49, 2) == [(0, 1, 0, 3, 0, 24), (0, 1, 0, 3, 24, 49)]  # 3 panels: blocks of 8 positions
    assert parts(1, 9, 196, 4) == [(0, 1, 0, 9, 0, 48), (0, 1, 0, 9, 48, 96), (0, 1, 0, 9, 96, 144),
                                   (0, 1, 0, 9, 144, 196)]
    assert parts(1, 3, 12, 4) == [(0, 1, 0, 3, 0, 8), (0, 1, 0, 3, 8, 12)]  # no empty parts
    assert parts(3, 3, 49, 2) == [(0, 1, 0, 3, 0, 49), (1, 3, 0, 3, 0, 49)]  # images first
    assert parts(1, 3, 49, 1) == [(0, 1, 0, 3, 0, 49)]
    # a map larger than its panels' weights (two panels of 64 channels at 56x56): positions
    assert parts(1, 2, 3136, 2, 4 * 256 * 3136, True) == [(0, 1, 0, 2, 0, 1568), (0, 1, 0, 2, 1568, 3136)]
    # ... unless its input is small (SqueezeNet's 512 -> 64 at 13x13) and the panels whole
    small = 4 * 512 * 169
    assert small <= conv_pointwise.PANELS_INPUT_BYTES
    assert parts(1, 2, 169, 2, small, True) == [(0, 1, 0, 1, 0, 169), (0, 1, 1, 2, 0, 169)]
    assert parts(1, 2, 169, 2, small, False) == [(0, 1, 0, 2, 0, 88), (0, 1, 0, 2, 88, 169)]  # 48 channels


def test_with_the_team_busy_every_part_runs_here(rng, monkeypatch):
    monkeypatch.setattr(conv_pointwise, "TEAM_MIN_MACS", 0)
    x, w, b, attrs = _operands("many_channels", rng)
    with spin_team_bound(1) as runs, runs.busy():
        plan = _plan(x, w, b, attrs)
        got = conv_pointwise.run_pointwise(plan, x)
    assert len(plan.parts) == 2 and runs.shared == 0
    np.testing.assert_array_equal(got, conv_pointwise.run_pointwise(dataclasses.replace(plan, team=False), x))
    np.testing.assert_allclose(got, reference_run("Conv", [x, w, b], attrs)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", sorted(EPILOGUE_ACTIVATIONS))
@pytest.mark.parametrize("name", ["partial_panel", "deep", "leftover_rows", "grouped"])
def test_fused_activation_gives_the_bits_of_the_standalone_op(activation, name, rng):
    """Bias and activation in the register blocks (Relu, Clip, LeakyRelu, HardSigmoid, HardSwish)
    or after the store (Sigmoid, Swish) equal the conv followed by the activation op, bit for bit,
    NaN and infinities included."""
    x, w, b, attrs = _operands(name, rng)
    act, extras = activation_op(activation)
    assert Epilogue.of([(act, extras)], np.dtype(np.float32)) is not None
    assert_fused_activation_bits(make_op("Conv", attrs, n_inputs=3), x, w, b, activation)


def test_negative_zero_and_nan_pass_relu_as_in_the_op(rng):
    """Relu in the register block keeps -0 and NaN as ``np.maximum(v, 0)``'s compiled twin does."""
    x = np.zeros((1, 2, 8, 8), np.float32)
    x[0, 0] = -0.0
    x[0, 1, 0, 0] = np.nan
    w = np.ones((3, 2, 1, 1), np.float32)
    w[1, 0] = -1.0
    b = np.array([-0.0, 0.0, -0.0], np.float32)
    conv = make_op("Conv", dict(kernel_shape=[1, 1]), n_inputs=3)
    act, extras = activation_op("Relu")
    fused = conv(x, w, b, activations=[(act, extras)])[0]
    np.testing.assert_array_equal(np.signbit(fused), np.signbit(act(conv(x, w, b)[0])[0]))
    assert np.isnan(fused[0, :, 0, 0]).all()


def test_float64_padded_and_depthwise_1x1_convs_take_other_ways(rng):
    x, w, b = randn(rng, 1, 4, 8, 8), randn(rng, 6, 4, 1, 1), randn(rng, 6)
    assert not conv_pointwise.takes_pointwise(x.shape, w.shape, 1, (0, 0), (0, 0), (8, 8), np.dtype(np.float64))
    assert not conv_pointwise.takes_pointwise(x.shape, w.shape, 1, (1, 0), (0, 0), (9, 8), np.dtype(np.float32))
    assert not conv_pointwise.takes_pointwise(x.shape, (4, 1, 1, 1), 4, (0, 0), (0, 0), (8, 8), np.dtype(np.float32))
    attrs = dict(kernel_shape=[1, 1], pads=[1, 0, 0, 0])
    got = make_op("Conv", attrs, n_inputs=3)(x, w, b)[0]
    np.testing.assert_allclose(got, reference_run("Conv", [x, w, b], attrs)[0], rtol=1e-4, atol=1e-4)
    x64, w64, b64 = (a.astype(np.float64) for a in (x, w, b))
    got = make_op("Conv", dict(kernel_shape=[1, 1]), n_inputs=3)(x64, w64, b64)[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, reference_run("Conv", [x64, w64, b64], dict(kernel_shape=[1, 1]))[0], rtol=1e-12)


def test_which_kernel_takes_a_1x1_conv(monkeypatch):
    """With the module's thresholds: deep inputs on small maps go to `small_map_conv`, maps whose
    padding to whole panels wastes little to `pointwise_conv`, the rest (a 1x1 or 1x17 map of a
    shallow input) to BLAS."""
    for name, value in (("MAX_WASTE", 1.35), ("MIN_POSITIONS", 1), ("SMALL_MAP_DEPTH", 512), ("SMALL_MAP", 4096),
                        ("SMALL_MAP_WASTE_DEPTH", 32), ("SMALL_MAP_DEEP", 64), ("SMALL_MAP_DEEP_COST", 0.9)):
        monkeypatch.setattr(conv_pointwise, name, value)
    f32 = np.dtype(np.float32)

    def kind(c: int, size: int, width: int | None = None, m: int = 8) -> str | None:
        out = (size, size if width is None else width)
        x_shape, w_shape = (1, c, *out), (m, c, 1, 1)
        if not conv_pointwise.takes_pointwise(x_shape, w_shape, 1, (0, 0), (0, 0), out, f32):
            return None
        return "small_map" if conv_pointwise._small_map(c, out[0] * out[1], m) else "panels"
    # shallower, on small maps: whichever wastes less of its panels (from 32 input channels)
    assert kind(192, 7, m=1152) == "small_map" and kind(112, 14, m=672) == "small_map"  # (64 columns for 49)
    assert kind(96, 14, m=24) == "panels"  # (24 channels of a 32-wide panel, 224 columns for 196 positions)
    assert kind(24, 14, m=144) == "panels" and kind(40, 28, m=240) == "panels"  # (too shallow; 800 for 784)
    assert kind(8, 28) == "panels" and kind(8, 7) == "panels"  # (7x7: 64 columns for 49 positions)
    assert kind(512, 14) == "small_map" and kind(1024, 7) == "small_map" and kind(512, 28) == "small_map"
    assert kind(512, 56) == "small_map" and kind(512, 72) == "panels"  # (5184 positions: past SMALL_MAP)
    # below SMALL_MAP_DEPTH, deep inputs by the waste too: ResNet-50's 256 -> 64 at 56x56 on small
    # maps, SqueezeNet's 256 -> 48 at 13x13 (64 of 32-wide panels' channels for 48) on panels of positions
    assert kind(256, 56, m=64) == "small_map" and kind(256, 14, m=256) == "small_map"
    assert kind(256, 13, m=48) == "panels" and kind(384, 13, m=48) == "panels" and kind(384, 13, m=64) == "small_map"
    # from SMALL_MAP_DEEP input channels its blocks count for less: no waste either way, it takes them
    assert kind(64, 56, m=256) == "small_map" and kind(32, 56, m=256) == "panels"
    assert kind(144, 56, m=24) == "panels"  # (24 channels of a 32-wide panel)
    assert kind(8, 1, 17) is None and kind(512, 1, 17) == "small_map"  # (17 positions: 32 columns)
    # a map too small for panels of positions: the small-map kernel where it applies, else BLAS
    assert kind(8, 1) is None and kind(512, 1) == "small_map" and kind(128, 3, m=256) == "small_map"
    assert kind(16, 3, m=256) is None  # (too shallow)
