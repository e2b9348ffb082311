"""Convs of a few input channels (network stems) on the direct kernel (asyncinfer/ops/conv_direct.py,
compiled/direct.py).

Checked against onnx's reference implementation across the ways the kernel cuts its work (rows
of two vectors, one vector and a last partial one, that partial one spilling into the next row or
not; output channels in whole blocks and a last
partial one; strides 1, 2 and 4; asymmetric padding; several images) and the ways a plan shares
it (output rows through the images, on one and two helpers, the team busy); fused activations
against the standalone ops bit for bit; and which convs take it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asyncinfer.ops import conv_direct
from asyncinfer.ops.compiled.direct import LANES

from .op_testing import (EPILOGUE_ACTIVATIONS, assert_conv_takes, assert_fused_activation_bits, make_op, randn,
                         reference_run, spin_team_bound)

# name: (x shape, output channels, kernel, strides, pads)
CASES = {
    "mobilenet_stem": ((1, 3, 40, 70), 16, 3, 2, [1, 1, 1, 1]),   # rows of 35: two vectors, a partial one (AVX-512)
    "resnet_stem": ((1, 3, 30, 100), 64, 7, 2, [3, 3, 3, 3]),
    "patchify": ((1, 3, 32, 136), 24, 4, 4, [0, 0, 0, 0]),       # ConvNeXt's 4x4/4
    "leftover_channels": ((1, 3, 17, 45), 13, 3, 2, [1, 1, 1, 1]),  # 13: a block and a partial one
    "one_channel": ((1, 1, 9, 50), 5, 3, 1, [1, 1, 1, 1]),
    "four_channels_5x5": ((1, 4, 11, 70), 9, 5, 1, [2, 2, 2, 2]),
    "asymmetric_pads": ((1, 3, 21, 66), 32, 3, 2, [0, 1, 2, 0]),
    "images": ((3, 3, 12, 2 * LANES + 7), 8, 3, 1, [1, 1, 1, 1]),
    "images_leftover_channels": ((2, 3, 13, 3 * LANES + 5), 13, 3, 2, [1, 1, 1, 1]),  # spare blocks past image 0
    # rows shorter than a vector: a row's block spills into the next row (12 wide) or cannot (7 wide)
    "rows_under_a_vector": ((2, 3, 9, LANES - 4), 8, 3, 1, [1, 1, 1, 1]),
    "rows_under_half_a_vector": ((2, 3, 9, LANES // 2 - 1), 8, 3, 1, [1, 1, 1, 1]),
}


def _operands(name: str, rng):
    shape, m, k, s, pads = CASES[name]
    return (randn(rng, *shape), randn(rng, m, shape[1], k, k), randn(rng, m),
            dict(kernel_shape=[k, k], strides=[s, s], pads=pads))


def _plan(x, w, b, attrs, epilogue=None):
    from asyncinfer.ops.epilogue import NO_ACTIVATION

    k, s, pads = attrs["kernel_shape"][0], attrs["strides"][0], attrs["pads"]
    out = tuple((x.shape[2 + i] + pads[i] + pads[i + 2] - k) // s + 1 for i in range(2))
    return conv_direct.direct_plan(x.shape, w, b, (s, s), (pads[0], pads[1]), out, epilogue or NO_ACTIVATION)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_alone(name, rng, monkeypatch):
    monkeypatch.setattr(conv_direct, "MIN_WIDTH", 1)  # (rows narrower than the routing's bound too)
    x, w, b, attrs = _operands(name, rng)
    assert_conv_takes(monkeypatch, "direct_plan", attrs, x, w, b)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("helpers", [1, 2])
def test_shared_with_the_spin_team_gives_the_same_bits(name, helpers, rng, monkeypatch):
    """This thread and each helper take a range of output rows: the very bits of the conv run
    whole on one thread."""
    monkeypatch.setattr(conv_direct, "TEAM_MIN_MACS", 0)
    x, w, b, attrs = _operands(name, rng)
    alone = conv_direct.run_direct(_plan(x, w, b, attrs), x)
    with spin_team_bound(helpers) as runs:
        plan = _plan(x, w, b, attrs)
        shared = conv_direct.run_direct(plan, x)
    assert len(plan.parts) == helpers + 1 and runs.shared
    rows = [part for part in plan.parts]
    assert rows[0][0] == 0 and rows[-1][1] == x.shape[0] * plan.y_shape[2]
    assert all(a[1] == b_[0] for a, b_ in zip(rows, rows[1:]))
    np.testing.assert_array_equal(shared, alone)


def test_with_the_team_busy_every_part_runs_here(rng, monkeypatch):
    monkeypatch.setattr(conv_direct, "TEAM_MIN_MACS", 0)
    x, w, b, attrs = _operands("resnet_stem", rng)
    with spin_team_bound(1) as runs, runs.busy():
        plan = _plan(x, w, b, attrs)
        got = conv_direct.run_direct(plan, x)
    assert len(plan.parts) == 2 and runs.shared == 0
    np.testing.assert_array_equal(got, conv_direct.run_direct(dataclasses.replace(plan, team=False), x))


def test_helpers_found_asleep_are_woken_before_the_callers_part(rng, monkeypatch):
    """Parts go to the helpers in one compiled call (`post_and_finish_direct`); where a helper was
    asleep, the team is woken before this thread runs its own part: the same bits."""
    from asyncinfer.concurrency.spin_team import HELPERS_ASLEEP
    from asyncinfer.ops.compiled import direct

    monkeypatch.setattr(conv_direct, "TEAM_MIN_MACS", 0)
    x, w, b, attrs = _operands("images_leftover_channels", rng)
    alone = conv_direct.run_direct(_plan(x, w, b, attrs), x)
    posted = []

    def post_only(control, columns, padded, offsets, y, bias, buffers, tail, spare, *rest):
        posted.append(direct.post_direct(control, columns, padded, offsets, y, bias, buffers, *rest[:-1]))
        return HELPERS_ASLEEP
    monkeypatch.setattr(conv_direct, "post_and_finish_direct", post_only)
    with spin_team_bound(1) as runs:
        shared = conv_direct.run_direct(_plan(x, w, b, attrs), x)
    assert runs.shared == 1 and len(posted) == 1 and runs.wakes == 1
    np.testing.assert_array_equal(shared, alone)


@pytest.mark.parametrize("activation", sorted(EPILOGUE_ACTIVATIONS))
@pytest.mark.parametrize("name", ["mobilenet_stem", "leftover_channels"])
def test_fused_activation_gives_the_bits_of_the_standalone_op(activation, name, rng):
    """Bias and activation in the register blocks (Relu, Clip, LeakyRelu) or after the store (the
    others) equal the conv followed by the activation op, bit for bit, NaN and infinities included."""
    x, w, b, attrs = _operands(name, rng)
    assert_fused_activation_bits(make_op("Conv", attrs, n_inputs=3), x, w, b, activation)


def test_which_convs_take_the_direct_kernel():
    f32 = np.dtype(np.float32)
    stem = ((1, 3, 224, 224), (16, 3, 3, 3), 1, (2, 2), (1, 1), (112, 112))
    assert conv_direct.takes_direct(*stem, f32)
    assert not conv_direct.takes_direct(*stem, np.dtype(np.float64))
    x, w, group, strides, dilations, out = stem
    assert not conv_direct.takes_direct((1, 5, 224, 224), (16, 5, 3, 3), group, strides, dilations, out, f32)
    assert not conv_direct.takes_direct(x, (3, 1, 3, 3), 3, strides, dilations, out, f32)  # depthwise
    assert not conv_direct.takes_direct(x, (16, 3, 1, 1), group, strides, dilations, out, f32)  # 1x1
    assert not conv_direct.takes_direct(x, w, group, (3, 3), dilations, out, f32)
    assert not conv_direct.takes_direct(x, w, group, (2, 1), dilations, out, f32)
    assert not conv_direct.takes_direct(x, w, group, strides, (2, 2), out, f32)
    assert not conv_direct.takes_direct(x, w, group, strides, dilations, (112, LANES - 1), f32)
    # a shallow patchify (stride = window) with many outputs keeps the GEMM way; a deep one, or
    # overlapping windows, do not
    assert not conv_direct.takes_direct(x, (96, 3, 4, 4), group, (4, 4), dilations, (56, 56), f32)
    assert conv_direct.takes_direct(x, (96, 3, 8, 8), group, (4, 4), dilations, (56, 56), f32)
    assert conv_direct.takes_direct(x, (64, 3, 3, 3), group, strides, dilations, out, f32)
    assert conv_direct.takes_direct(x, (64, 3, 7, 7), group, strides, dilations, out, f32)


def test_a_dilated_or_strided_by_3_stem_takes_the_gemm_way(rng):
    x, w, b = randn(rng, 1, 3, 20, 40), randn(rng, 8, 3, 3, 3), randn(rng, 8)
    for attrs in (dict(kernel_shape=[3, 3], strides=[3, 3]), dict(kernel_shape=[3, 3], dilations=[2, 2])):
        got = make_op("Conv", attrs, n_inputs=3)(x, w, b)[0]
        np.testing.assert_allclose(got, reference_run("Conv", [x, w, b], attrs)[0], rtol=1e-4, atol=1e-4)


def test_a_1d_conv_of_few_channels_runs_as_a_map_one_row_high(rng, monkeypatch):
    x, w, b = randn(rng, 2, 2, 3 * LANES + 5), randn(rng, 6, 2, 5), randn(rng, 6)
    assert_conv_takes(monkeypatch, "direct_plan", dict(kernel_shape=[5], pads=[2, 2]), x, w, b)


@pytest.mark.parametrize("phases", [1, 2, 4])
@pytest.mark.parametrize("width, left", [(1, 0), (7, 1), (2 * LANES, 0), (2 * LANES + 1, 1), (4 * LANES + 3, 2),
                                         (6 * LANES - 1, 3)])
def test_the_padded_copy_stores_each_row_as_its_phases(phases, width, left, rng):
    """`copy_inside` against its definition: padded column ``phases·j + f`` of each row at
    ``f·Wq + j``; the border is not written (the buffer keeps its zeros between runs). Widths
    around whole vectors of pairs: the vector loop, its scalar tail and an odd last column."""
    from asyncinfer.ops.compiled.direct import copy_inside

    x = randn(rng, 2, 3, 5, width)
    top = 2
    wp = -(-(left + width + 1) // phases) * phases  # (room on the right, a whole number of phases)
    padded = np.full((2, 3, top + 5 + 1, wp), -7.0, np.float32)
    copy_inside(x, padded, top, left, phases)
    plain = np.full_like(padded, -7.0)
    plain[:, :, top:top + 5, left:left + width] = x
    wq = wp // phases
    expected = np.empty_like(plain)
    for f in range(phases):
        expected[..., f * wq:(f + 1) * wq] = plain[..., f::phases]
    np.testing.assert_array_equal(padded, expected)
