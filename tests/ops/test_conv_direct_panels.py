"""Deep convs on the direct panel kernel (asyncinfer/ops/conv_direct.py's `panel_plan`,
compiled/direct_panels.py).

Checked against onnx's reference implementation across the ways the kernel cuts its work (a map's
positions, rows end to end, cut into blocks of 8, 4, 2 and 1; output channels in whole panels and a last partial
one; strides 1 and 2, unequal ones; dilation; asymmetric padding; several images; 1-D convs) and
the ways a plan shares it (panels x output rows, on one and two helpers, the team busy); fused
activations against the standalone ops bit for bit; the bits of the stem kernel where both run;
and which convs take it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asyncinfer.ops import conv_direct, conv_winograd
from asyncinfer.ops.compiled import direct_panels
from asyncinfer.ops.compiled.direct_panels import WIDTH
from asyncinfer.ops.epilogue import NO_ACTIVATION

from .op_testing import (EPILOGUE_ACTIVATIONS, assert_conv_takes, assert_fused_activation_bits, make_op, randn,
                         reference_run, spin_team_bound)

# name: (x shape, output channels, kernel, strides, dilations, pads)
CASES = {
    "densenet_small_map": ((1, 24, 7, 7), 32, (3, 3), (1, 1), (1, 1), [1, 1, 1, 1]),
    "every_block_size": ((1, 8, 5, 3), 2 * WIDTH + 5, (3, 3), (1, 1), (1, 1), [1, 1, 1, 1]),  # 15 = 8 + 4 + 2 + 1
    "blocks_across_rows": ((1, 8, 6, 15), 2 * WIDTH + 5, (3, 3), (1, 1), (1, 1), [1, 1, 1, 1]),  # 90 = 11 x 8 + 2
    "partial_panel": ((1, 16, 5, 9), 13, (3, 3), (1, 1), (1, 1), [1, 1, 1, 1]),
    "stride2_asymmetric": ((2, 12, 11, 13), 40, (3, 3), (2, 2), (1, 1), [0, 1, 2, 0]),
    "unequal_strides_rect": ((1, 6, 12, 10), 20, (5, 3), (2, 1), (1, 1), [2, 1, 2, 1]),
    "dilated": ((1, 9, 10, 12), 33, (3, 3), (1, 1), (2, 3), [2, 3, 2, 3]),
    "no_pads": ((1, 10, 9, 9), 7, (3, 3), (1, 1), (1, 1), [0, 0, 0, 0]),
    "images": ((3, 16, 5, 6), WIDTH, (3, 3), (1, 1), (1, 1), [1, 1, 1, 1]),
    "few_positions_large_stride": ((2, 3, 4, 70), 37, (3, 9), (3, 20), (1, 1), [1, 2, 0, 1]),  # 2x4 positions
    # rows of 14 positions or more in row blocks (with AVX-512), a partial last panel across rows
    "row_blocks": ((1, 8, 4, 28), 2 * WIDTH + 5, (3, 3), (1, 1), (1, 1), [1, 1, 1, 1]),  # 28 = 2 x 14
    "row_blocks_overlapping": ((2, 8, 3, 27), WIDTH, (3, 3), (1, 1), (1, 1), [1, 1, 1, 1]),  # 27 = 14 + 13 more
    "row_blocks_stride2": ((1, 8, 7, 56), 2 * WIDTH, (3, 3), (2, 2), (1, 1), [1, 1, 1, 1]),  # 28 wide
    "row_too_short_for_blocks": ((1, 8, 3, 20), WIDTH, (3, 3), (1, 1), (1, 1), [1, 1, 1, 1]),  # 2 x 14 for 20: across
    # 7 wide: rows in pairs, the last pair overlapping (7 rows), at strides 1 and 2; a partial panel across rows
    "paired_rows": ((2, 8, 7, 7), 2 * WIDTH + 3, (3, 3), (1, 1), (1, 1), [1, 1, 1, 1]),
    "paired_rows_stride2": ((1, 8, 14, 13), WIDTH, (3, 3), (2, 2), (1, 1), [1, 1, 1, 1]),
}


def _operands(name: str, rng):
    shape, m, kernel, strides, dilations, pads = CASES[name]
    return (randn(rng, *shape), randn(rng, m, shape[1], *kernel), randn(rng, m),
            dict(kernel_shape=list(kernel), strides=list(strides), dilations=list(dilations), pads=pads))


def _plan(x, w, b, attrs, epilogue=NO_ACTIVATION):
    kernel, strides, dilations, pads = attrs["kernel_shape"], attrs["strides"], attrs["dilations"], attrs["pads"]
    out = tuple((x.shape[2 + i] + pads[i] + pads[i + 2] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
                for i in range(2))
    return conv_direct.panel_plan(x.shape, w, b, tuple(strides), tuple(dilations), (pads[0], pads[1]), out, epilogue)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_alone(name, rng, monkeypatch):
    monkeypatch.setattr(conv_direct, "PANEL_MIN_DEPTH", 1)  # (small cases: every one takes the kernel)
    x, w, b, attrs = _operands(name, rng)
    assert_conv_takes(monkeypatch, "panel_plan", attrs, x, w, b)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("helpers", [1, 2])
def test_shared_with_the_spin_team_gives_the_same_bits(name, helpers, rng, monkeypatch):
    """This thread and each helper take a range of units (panels x output rows): the very bits of
    the conv run whole on one thread."""
    monkeypatch.setattr(conv_direct, "TEAM_MIN_MACS", 0)
    x, w, b, attrs = _operands(name, rng)
    alone = conv_direct.run_direct_panels(_plan(x, w, b, attrs), x)
    with spin_team_bound(helpers) as runs:
        plan = _plan(x, w, b, attrs)
        shared = conv_direct.run_direct_panels(plan, x)
    assert 1 < len(plan.parts) <= helpers + 1 and runs.shared
    _assert_parts_tile(plan, x.shape[0] * plan.y_shape[2])
    np.testing.assert_array_equal(shared, alone)


def _assert_parts_tile(plan, rows):
    """The parts (u0, u1, q0, q1) cover every panel at every output row once: bands of rows, every
    panel's units each, or ranges of the units of all rows, one after another."""
    total = plan.panels.shape[0]
    if all(q0 == 0 and q1 == rows for _, _, q0, q1 in plan.parts):
        spans, end = [(u0, u1) for u0, u1, _, _ in plan.parts], total * rows
    else:
        assert all(u0 == 0 and u1 == total * (q1 - q0) for u0, u1, q0, q1 in plan.parts)
        spans, end = [(q0, q1) for _, _, q0, q1 in plan.parts], rows
    assert spans[0][0] == 0 and spans[-1][1] == end
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:]))


def test_with_the_team_busy_every_part_runs_here(rng, monkeypatch):
    monkeypatch.setattr(conv_direct, "TEAM_MIN_MACS", 0)
    x, w, b, attrs = _operands("stride2_asymmetric", rng)
    with spin_team_bound(1) as runs, runs.busy():
        plan = _plan(x, w, b, attrs)
        got = conv_direct.run_direct_panels(plan, x)
    assert len(plan.parts) == 2 and runs.shared == 0
    np.testing.assert_array_equal(got, conv_direct.run_direct_panels(dataclasses.replace(plan, team=False), x))


def test_two_convs_of_one_padded_shape_keep_their_own_borders(rng):
    """A padded image buffer is kept per shape and place of its input: a conv whose input sits
    elsewhere in a buffer of the same shape must not find the other's values in its border."""
    w, b = randn(rng, 8, 8, 3, 3), randn(rng, 8)
    centred = dict(kernel_shape=[3, 3], strides=[1, 1], dilations=[1, 1], pads=[1, 1, 1, 1])    # 9x9 in 11x11
    corner = dict(kernel_shape=[3, 3], strides=[1, 1], dilations=[1, 1], pads=[0, 0, 1, 1])     # 10x10 in 11x11
    x9, x10 = randn(rng, 1, 8, 9, 9), randn(rng, 1, 8, 10, 10)
    for _ in range(2):
        for x, attrs in ((x10, corner), (x9, centred)):
            got = conv_direct.run_direct_panels(_plan(x, w, b, attrs), x)
            np.testing.assert_allclose(got, reference_run("Conv", [x, w, b], attrs)[0], rtol=1e-4, atol=1e-4)


def test_an_input_without_padding_is_read_in_place(rng):
    """A conv without pads whose windows reach no further than the input reads it where it is
    (no copy into a padded buffer); `test_matches_reference_alone[no_pads]` checks its values."""
    x, w, b, attrs = _operands("no_pads", rng)
    plan = _plan(x, w, b, attrs)
    assert plan.padded == x.shape
    assert np.shares_memory(conv_direct.padded_input(plan.padded, 0, 0, x.shape, x), x)
    padded = _plan(x, w, b, dict(attrs, pads=[1, 1, 1, 1]))
    assert not np.shares_memory(conv_direct.padded_input(padded.padded, 1, 1, x.shape, x), x)


@pytest.mark.parametrize("activation", sorted(EPILOGUE_ACTIVATIONS))
@pytest.mark.parametrize("name", ["every_block_size", "partial_panel", "row_blocks_overlapping", "paired_rows"])
def test_fused_activation_gives_the_bits_of_the_standalone_op(activation, name, rng, monkeypatch):
    """Bias and activation in the register blocks equal the conv followed by the activation op,
    bit for bit, NaN and infinities included."""
    monkeypatch.setattr(conv_direct, "PANEL_MIN_DEPTH", 1)
    x, w, b, attrs = _operands(name, rng)
    assert_fused_activation_bits(make_op("Conv", attrs, n_inputs=3), x, w, b, activation)


@pytest.mark.skipif(not direct_panels.ROW_BLOCKS, reason="row blocks are for AVX-512's 32 vector registers")
def test_which_rows_take_row_blocks():
    """Rows of 14 or more positions whose last block overlaps little (the cases above run each
    way: row_blocks* and row_too_short_for_blocks)."""
    blocks = direct_panels.row_blocks_of.py_func
    assert [blocks(width, 1) for width in (7, 13, 14, 20, 27, 28, 35, 55, 56, 112)] == [0, 0, 1, 0, 2, 2, 0, 4, 4, 8]
    assert blocks(28, 2) == 2 and blocks(28, 3) == 0


def test_the_bits_of_the_stem_kernel(rng):
    """Both direct kernels sum each value from zero along the taps in (c, ky, kx) order: a conv
    either may take gives the same bits on each."""
    x, w, b = randn(rng, 1, 4, 11, 40), randn(rng, 9, 4, 5, 5), randn(rng, 9)
    out = (11, 40)
    stem = conv_direct.run_direct(conv_direct.direct_plan(x.shape, w, b, (1, 1), (2, 2), out, NO_ACTIVATION), x)
    panels = conv_direct.run_direct_panels(
        conv_direct.panel_plan(x.shape, w, b, (1, 1), (1, 1), (2, 2), out, NO_ACTIVATION), x)
    np.testing.assert_array_equal(panels, stem)


def test_a_1d_conv_runs_as_a_map_one_row_high(rng, monkeypatch):
    x, w, b = randn(rng, 2, 16, 37), randn(rng, 6, 16, 5), randn(rng, 6)
    assert_conv_takes(monkeypatch, "panel_plan", dict(kernel_shape=[5], pads=[2, 1], strides=[2]), x, w, b)


def test_which_convs_take_the_panel_kernel():
    f32 = np.dtype(np.float32)
    deep = ((1, 128, 14, 14), (32, 128, 3, 3), 1, (1, 1), (14, 14))
    assert conv_direct.takes_direct_panels(*deep, f32)
    assert not conv_direct.takes_direct_panels(*deep, np.dtype(np.float64))
    x, w, group, strides, out = deep
    assert not conv_direct.takes_direct_panels(x, (128, 1, 3, 3), 128, strides, out, f32)  # depthwise
    assert not conv_direct.takes_direct_panels(x, (64, 64, 3, 3), 2, strides, out, f32)    # grouped
    assert not conv_direct.takes_direct_panels(x, (32, 128, 1, 1), group, strides, out, f32)  # 1x1
    assert not conv_direct.takes_direct_panels(x, (32, 7, 3, 3), group, strides, out, f32)    # 63 taps: too shallow
    assert conv_direct.takes_direct_panels(x, (32, 8, 3, 3), group, (2, 2), (7, 7), f32)
    assert not conv_direct.takes_direct_panels(x, w, group, (3, 3), (5, 5), f32)  # strided, 25 positions
    assert not conv_direct.takes_direct_panels((1, 128, 14), (32, 128, 3), group, (1,), (14,), f32)  # (2-D operands)
    # few positions: any stride (an STFT's 4 frames of 256 taps at stride 128)
    assert conv_direct.takes_direct_panels(x, w, group, (3, 3), (4, 4), f32)
    stft = ((1, 1, 1, 640), (258, 1, 1, 256), 1, (1, 128), (1, 4))
    assert conv_direct.takes_direct_panels(*stft, f32)


def test_an_stft_like_1d_conv_takes_the_panels(rng, monkeypatch):
    """A 1-D conv of one input channel, a long window at a large stride and a few frames (a voice
    detector's STFT as a conv) runs on the panel kernel, not on the im2col GEMM."""
    x, w, b = randn(rng, 1, 1, 640), randn(rng, 2 * WIDTH + 2, 1, 256), randn(rng, 2 * WIDTH + 2)
    assert_conv_takes(monkeypatch, "panel_plan", dict(kernel_shape=[256], pads=[0, 0], strides=[128]), x, w, b)


def test_small_maps_are_left_to_the_panels_by_winograd(monkeypatch):
    """Winograd takes 3x3 layers with 4x4 tiles from about 21x21 on, where each of its GEMMs
    makes `MIN_PRODUCT` values, from `MIN_CHANNELS` input channels (256; 40 on CPUs where its
    transforms pay sooner, as here); smaller maps and products, and shallower inputs, whose
    transforms cost more than its GEMMs save, take the panel kernel."""
    f32 = np.dtype(np.float32)
    assert conv_direct.takes_direct_panels((1, 128, 28, 28), (128, 128, 3, 3), 1, (1, 1), (28, 28), f32)
    assert conv_winograd.winograd_tile((1, 128, 28, 28), (128, 128, 3, 3), 1, (1, 1), (1, 1), (1, 1), (1, 1),
                                       (28, 28), f32) == 0  # (the module's 256 channels)
    assert conv_winograd.winograd_tile((1, 256, 28, 28), (256, 256, 3, 3), 1, (1, 1), (1, 1), (1, 1), (1, 1),
                                       (28, 28), f32) == 4
    monkeypatch.setattr(conv_winograd, "MIN_CHANNELS", 40)

    def tile(c, m, hw):
        return conv_winograd.winograd_tile((1, c, hw, hw), (m, c, 3, 3), 1, (1, 1), (1, 1), (1, 1), (1, 1),
                                           (hw, hw), np.dtype(np.float32))
    assert tile(256, 256, 14) == 0 and tile(48, 192, 13) == 0
    assert tile(128, 128, 28) == 4 and tile(64, 64, 56) == 4 and tile(128, 32, 56) == 4
    assert tile(128, 32, 28) == 0  # (56 tiles x 32 channels: GEMM products too small)
    assert tile(32, 128, 27) == 0 and tile(48, 192, 27) == 4  # (SqueezeNet's expand layers)
    assert conv_direct.takes_direct_panels((1, 256, 14, 14), (256, 256, 3, 3), 1, (1, 1), (14, 14), f32)


# -- convs of one input side by side (`joined_panel_plan`: SqueezeNet's expand layers) -------------
# name: (x shape, strides, each conv's (output channels, kernel, dilations, pads)); every conv's
# channels but the last's fill whole panels
JOINED = {
    "fire_module": ((1, 16, 11, 13), (1, 1), [(2 * WIDTH, (1, 1), (1, 1), [0, 0, 0, 0]),
                                              (2 * WIDTH, (3, 3), (1, 1), [1, 1, 1, 1])]),
    "wide_first_partial_last": ((2, 8, 9, 7), (1, 1), [(WIDTH, (3, 3), (1, 1), [1, 1, 1, 1]),
                                                       (WIDTH, (1, 1), (1, 1), [0, 0, 0, 0]),
                                                       (13, (5, 5), (1, 1), [2, 2, 2, 2])]),
    "stride2_dilated_asymmetric": ((1, 6, 12, 11), (2, 2), [(WIDTH, (3, 3), (2, 2), [2, 1, 2, 3]),
                                                            (5, (3, 1), (1, 1), [1, 0, 1, 0])]),
}


def _joined(name, rng):
    shape, strides, convs = JOINED[name]
    x = randn(rng, *shape)
    parts, outs = [], set()
    for m, kernel, dilations, pads in convs:
        w, b = randn(rng, m, shape[1], *kernel), randn(rng, m)
        attrs = dict(kernel_shape=list(kernel), strides=list(strides), dilations=list(dilations), pads=pads)
        outs.add(tuple((shape[2 + i] + pads[i] + pads[i + 2] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
                       for i in range(2)))
        parts.append((conv_direct.PanelConv(w, b, tuple(dilations), (pads[0], pads[1])), attrs))
    [out] = outs  # (the convs of a case map onto one output)
    return x, parts, strides, out


@pytest.mark.parametrize("name", sorted(JOINED))
@pytest.mark.parametrize("helpers", [0, 1, 2])
def test_joined_convs_give_each_conv_its_own_sums(name, helpers, rng, monkeypatch):
    """One plan of convs side by side: each conv's channels are its own conv (the definition's
    values, and the bits of that conv alone on the panel kernel), on this thread alone or shared
    with the helpers, the parts cut where the work of the panels' taps is shared evenly."""
    monkeypatch.setattr(conv_direct, "TEAM_MIN_MACS", 0)
    x, convs, strides, out = _joined(name, rng)
    if helpers:
        with spin_team_bound(helpers) as runs:
            plan = conv_direct.joined_panel_plan(x.shape, [c for c, _ in convs], strides, out, NO_ACTIVATION)
            got = conv_direct.run_direct_panels(plan, x)
        assert 1 < len(plan.parts) <= helpers + 1 and runs.shared
    else:
        plan = conv_direct.joined_panel_plan(x.shape, [c for c, _ in convs], strides, out, NO_ACTIVATION)
        got = conv_direct.run_direct_panels(plan, x)
    _assert_parts_tile(plan, x.shape[0] * out[0])
    start = 0
    for conv, attrs in convs:
        m = conv.weight.shape[0]
        alone = conv_direct.run_direct_panels(
            conv_direct.panel_plan(x.shape, conv.weight, conv.bias, strides, conv.dilations, conv.begin, out,
                                   NO_ACTIVATION), x)
        np.testing.assert_array_equal(got[:, start:start + m], alone)
        np.testing.assert_allclose(alone, reference_run("Conv", [x, conv.weight, conv.bias], attrs)[0],
                                   rtol=1e-4, atol=1e-4)
        start += m
    assert got.shape == (x.shape[0], start, *out)


def test_parts_are_rows_where_the_input_outweighs_the_weights_else_units_by_their_taps(monkeypatch):
    """Two threads: a band of rows each where the input is the larger operand (each reads only its
    rows' input) and the rows divide evenly enough; else ranges of units (panels x rows), cut where
    the taps summed are half done (a 1x1 conv's panels beside a 3x3's take a ninth of the time:
    not at half the units, which would leave one thread every 1x1 panel)."""
    monkeypatch.setattr(conv_direct.parallel, "team_size", lambda: 2)
    monkeypatch.setattr(conv_direct, "TEAM_MIN_MACS", 0)
    c, h = 16, 10
    convs = [conv_direct.PanelConv(np.zeros((2 * WIDTH, c, 1, 1), np.float32), None, (1, 1), (0, 0)),
             conv_direct.PanelConv(np.zeros((2 * WIDTH, c, 3, 3), np.float32), None, (1, 1), (1, 1))]
    plan = conv_direct.joined_panel_plan((1, c, h, h), convs, (1, 1), (h, h), NO_ACTIVATION)
    assert plan.panel_taps.tolist() == [[0, c]] * 2 + [[1, 9 * c]] * 2
    assert plan.panels.nbytes == 4 * 9 * c * WIDTH * 4 > 4 * c * (h + 2) ** 2  # weights outweigh the input
    cost = lambda u0, u1: sum(int(plan.panel_taps[u // h, 1]) + conv_direct.UNIT_OVERHEAD_TAPS  # noqa: E731
                              for u in range(u0, u1))
    (a0, a1, _, _), (b0, b1, _, _) = plan.parts
    assert a1 == b0 and abs(cost(a0, a1) - cost(b0, b1)) <= 9 * c + conv_direct.UNIT_OVERHEAD_TAPS
    assert 2 * h < a1 < 4 * h  # (inside the 3x3's first panel)
    wide = conv_direct.joined_panel_plan((1, c, 35, 35), convs, (1, 1), (35, 35), NO_ACTIVATION)  # 88 KB of input
    total = wide.panels.shape[0]
    assert wide.parts == ((0, total * 17, 0, 17), (0, total * 18, 17, 35))
    odd = conv_direct.joined_panel_plan((1, c, 31, 9), convs, (1, 1), (31, 9), NO_ACTIVATION)  # 21 KB: weights
    assert odd.parts[0][2:] == (0, 31)