"""3x3 convolutions by Winograd F(4x4, 3x3) (asyncinfer/ops/conv_winograd.py and
compiled/winograd.py), against onnx's reference implementation, however the map is cut into parts
and padded; its fused activations bit for bit against the standalone ops; and the operands it
leaves to the GEMM (non-finite values, small maps, other geometries)."""
from __future__ import annotations

import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from asyncinfer.concurrency import parallel
from asyncinfer.ops import conv_winograd
from asyncinfer.ops.compiled.gemm import WIDTH
from asyncinfer.ops.compiled.winograd_bands import panel_products
from asyncinfer.ops.epilogue import Epilogue

from .op_testing import activation_op, make_op, randn, reference_run, spin_team_bound

_POOL = ThreadPoolExecutor(2, thread_name_prefix="test-conv-winograd")


@pytest.fixture(autouse=True)
def _small_cases_take_winograd(monkeypatch):
    """Models leave layers with small GEMM products or few input channels to the direct panel
    kernel (`MIN_PRODUCT`, `MIN_CHANNELS`, tests/ops/test_conv_direct_panels.py); these small cases
    take Winograd all the same."""
    monkeypatch.setattr(conv_winograd, "MIN_PRODUCT", 0)
    monkeypatch.setattr(conv_winograd, "MIN_CHANNELS", 32)


@pytest.fixture(autouse=True, params=["blas", "panels"])
def products(request, monkeypatch):
    """Every case with the α² products in BLAS and on the panel GEMM (`PANEL_PRODUCTS`: the
    panels where the CPU has AVX-512, BLAS elsewhere; both run on any CPU)."""
    monkeypatch.setattr(conv_winograd, "PANEL_PRODUCTS", request.param == "panels")
    return request.param


# name: (x shape, output channels, attrs, the tile it takes)
CASES = {
    "same_pads": ((1, 32, 21, 17), 24, dict(pads=[1, 1, 1, 1]), 4),
    "no_pads": ((1, 40, 22, 23), 16, {}, 4),
    "asymmetric_pads": ((2, 32, 23, 22), 17, dict(pads=[2, 0, 1, 2]), 4),
    "auto_pad_same_lower": ((1, 32, 20, 21), 16, dict(auto_pad="SAME_LOWER"), 4),
    "batch_of_three": ((3, 32, 24, 24), 32, dict(pads=[1, 1, 1, 1]), 4),
    "one_tile_row": ((1, 32, 4, 128), 16, dict(pads=[1, 1, 1, 1]), 4),
}


def _operands(name: str, rng, bias: bool = True):
    shape, m, attrs, _ = CASES[name]
    x = randn(rng, *shape)
    w = randn(rng, m, shape[1], 3, 3) / np.float32(np.sqrt(9 * shape[1]))
    inputs = [x, w] + ([randn(rng, m)] if bias else [])
    return inputs, dict(attrs, kernel_shape=[3, 3])


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cut", ["whole", "threads", "one_tile_row_a_part"])
def test_matches_reference(name, cut, rng, monkeypatch):
    inputs, attrs = _operands(name, rng, bias=name != "no_pads")
    calls = []
    real = conv_winograd._part
    monkeypatch.setattr(conv_winograd, "_part", lambda *a: (calls.append((a[0].tile, a[8], a[9])), real(*a)))
    conv = make_op("Conv", attrs, n_inputs=len(inputs))
    if cut == "one_tile_row_a_part":  # a map larger than a part's scratch budget
        monkeypatch.setattr(conv_winograd, "PART_BYTES", 1)
        monkeypatch.setattr(conv_winograd, "MIN_PART_TILES", 1)
    if cut == "threads":
        monkeypatch.setattr(conv_winograd, "SPLIT_MIN_MACS", 0)
        with parallel.pool_bound(_POOL.submit, 2):
            got = conv(*inputs)[0]
    else:
        got = conv(*inputs)[0]
    want = reference_run("Conv", inputs, attrs)[0]
    tile = CASES[name][3]
    assert calls and {c[0] for c in calls} == {tile}, "the layer did not take Winograd with its tile"
    tile_rows = -(-want.shape[2] // tile)
    if cut == "threads" and inputs[0].shape[0] == 1:
        assert len(calls) == min(2, tile_rows)  # two bands of tile rows, where there are two
    if cut == "one_tile_row_a_part":
        assert len(calls) == tile_rows * inputs[0].shape[0]
    assert got.shape == want.shape and got.dtype == np.float32 and got.flags.c_contiguous
    # F(4x4, 3x3) rounds more than a direct sum: errors scale with the outputs' magnitude
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("helpers", [1, 2])
def test_bands_shared_with_the_spin_team_have_the_bits_of_one_thread(name, helpers, rng, monkeypatch):
    """`compiled.winograd_bands` on this thread and the team's helpers, a part of the bands each,
    computes every value as `_part` does alone, and matches the reference."""
    inputs, attrs = _operands(name, rng)
    conv = make_op("Conv", attrs, n_inputs=len(inputs))
    monkeypatch.setattr(conv_winograd, "MIN_PART_TILES", 1)
    monkeypatch.setattr(conv_winograd, "PART_BYTES", 1)  # a band a tile row: bands for every sharer
    alone = conv(*inputs)[0]  # (the same bands: BLAS's rounding may depend on a GEMM's width)
    monkeypatch.setattr(conv_winograd, "TEAM_MIN_MACS", 0)
    parts = []
    real = conv_winograd._part
    monkeypatch.setattr(conv_winograd, "_part", lambda *a: (parts.append(1), real(*a)))
    with spin_team_bound(helpers) as runs:
        shared = conv(*inputs)[0]
    if name == "one_tile_row":  # one band: nothing to share, the Python path runs it
        assert runs.shared == 0 and parts
    else:
        assert runs.shared == 1 and not parts  # no band left to the Python path
    np.testing.assert_array_equal(shared, alone)
    want = reference_run("Conv", inputs, attrs)[0]
    np.testing.assert_allclose(shared, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("tiles", [5, WIDTH, WIDTH + 7, 3 * WIDTH + 1])
def test_panel_products_do_not_depend_on_the_band_width(tiles, rng):
    """`panel_products` gives each column the same bits whether it sits in a whole panel or in
    the padded last one, so bands cut anywhere agree; and the products are U @ V."""
    u, v = randn(rng, 36, 24, 40), randn(rng, 36, 40, tiles)

    def products(v: np.ndarray) -> np.ndarray:
        out = np.empty((36, 24, v.shape[2]), np.float32)
        panel_products(u, v, out, np.empty((40, WIDTH), np.float32), np.empty((24, WIDTH), np.float32))
        return out

    whole = products(v)
    for cut in (1, tiles // 2, tiles - 1):
        if 0 < cut < tiles:
            halves = np.concatenate([products(np.ascontiguousarray(v[:, :, :cut])),
                                     products(np.ascontiguousarray(v[:, :, cut:]))], axis=2)
            np.testing.assert_array_equal(halves, whole)
    want = np.matmul(u.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_helpers_not_done_within_the_compiled_spin_are_waited_for_the_slow_way(rng, monkeypatch):
    """`finish_bands` giving up at once (no spin rounds) leaves the caller to wait through
    `SpinTeam.wait_posted`: the same bits as the bands alone."""
    inputs, attrs = _operands("batch_of_three", rng)
    conv = make_op("Conv", attrs, n_inputs=len(inputs))
    monkeypatch.setattr(conv_winograd, "MIN_PART_TILES", 1)
    monkeypatch.setattr(conv_winograd, "PART_BYTES", 1)
    alone = conv(*inputs)[0]
    monkeypatch.setattr(conv_winograd, "TEAM_MIN_MACS", 0)
    # (the compiled wait's rounds only: the team's own wait spins)
    monkeypatch.setattr(conv_winograd, "spin_team", types.SimpleNamespace(WAIT_ROUNDS=0))
    with spin_team_bound(1) as runs:
        waited = []
        real = runs.team.wait_posted
        runs.team.wait_posted = lambda helpers: (waited.append(helpers), real(helpers))
        shared = conv(*inputs)[0]
    assert runs.shared == 1 and waited == [1]
    np.testing.assert_array_equal(shared, alone)


def test_agrees_with_the_gemm_conv(rng, monkeypatch):
    """The same layer through both algorithms: rounding apart, the same outputs."""
    inputs, attrs = _operands("same_pads", rng)
    winograd = make_op("Conv", attrs, n_inputs=3)(*inputs)[0]
    monkeypatch.setattr(conv_winograd, "MIN_TILES", 10**9)
    gemm = make_op("Conv", attrs, n_inputs=3)(*inputs)[0]
    assert not np.array_equal(winograd, gemm)  # two algorithms, two roundings
    np.testing.assert_allclose(winograd, gemm, rtol=1e-4, atol=2e-5 * np.abs(gemm).max())


@pytest.mark.parametrize("activation", ["Relu", "Clip", "LeakyRelu", "HardSwish", "Sigmoid"])
def test_fused_activation_gives_the_bits_of_the_standalone_op(activation, rng):
    inputs, attrs = _operands("same_pads", rng)
    conv = make_op("Conv", attrs, n_inputs=3)
    act, extras = activation_op(activation)
    assert Epilogue.of([(act, extras)], np.dtype(np.float32)) is not None
    fused = conv(*inputs, activations=[(act, extras)])[0]
    separate = act(conv(*inputs)[0], *extras)[0]
    np.testing.assert_array_equal(fused, separate)


@pytest.mark.parametrize("where", ["input", "weights"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_operands_take_the_gemm(where, value, rng, monkeypatch):
    """A NaN or ∞ reaches exactly the outputs whose window reads it, as ONNX defines: the
    transforms would spread it over whole tiles (and make ∞ − ∞ = NaN), so such operands keep
    the GEMM conv."""
    inputs, attrs = _operands("same_pads", rng)
    if where == "input":
        inputs[0][0, 3, 6, 7] = value
    else:
        inputs[1][5, 2, 1, 1] = value
    calls = []
    monkeypatch.setattr(conv_winograd, "_part", lambda *a: calls.append(a))
    with np.errstate(all="ignore"):
        got = make_op("Conv", attrs, n_inputs=3)(*inputs)[0]
        want = reference_run("Conv", inputs, attrs)[0]
    assert not calls
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))


def test_weights_are_transformed_once_when_constant(rng, monkeypatch):
    inputs, attrs = _operands("same_pads", rng)
    count = []
    real = conv_winograd.transform_weights
    monkeypatch.setattr("asyncinfer.ops.conv.transform_weights", lambda w, t: (count.append(t), real(w, t))[1])
    conv = make_op("Conv", attrs, n_inputs=3)
    conv.bind_constants({1: inputs[1]})
    first = conv(*inputs)[0]
    np.testing.assert_array_equal(conv(*inputs)[0], first)
    assert len(count) == 1
    other = [inputs[0], inputs[1] * 2, inputs[2]]  # not the bound constant: transformed for that run
    np.testing.assert_allclose(conv(*other)[0] - inputs[2][:, None, None], 2 * (first - inputs[2][:, None, None]),
                               rtol=1e-4, atol=1e-4)
    assert len(count) == 2


@pytest.mark.parametrize("shape, m, attrs, why", [
    ((1, 32, 7, 7), 32, dict(pads=[1, 1, 1, 1]), "too few tiles"),
    ((1, 16, 20, 20), 32, dict(pads=[1, 1, 1, 1]), "too few input channels"),
    ((1, 32, 20, 20), 8, dict(pads=[1, 1, 1, 1]), "too few output channels"),
    ((1, 32, 20, 20), 16, dict(pads=[1, 1, 1, 1], strides=[2, 2]), "strided"),
    ((1, 32, 20, 20), 16, dict(pads=[2, 2, 2, 2], dilations=[2, 2]), "dilated"),
    ((1, 32, 20, 20), 16, dict(pads=[3, 3, 3, 3]), "pads wider than 2"),
    ((1, 32, 20, 20), 16, dict(pads=[1, 1, 1, 1], group=2), "grouped"),
])
def test_other_layers_do_not_take_winograd(shape, m, attrs, why, rng, monkeypatch):
    group = attrs.get("group", 1)
    x, w = randn(rng, *shape), randn(rng, m, shape[1] // group, 3, 3)
    attrs = dict(attrs, kernel_shape=[3, 3])
    calls = []
    monkeypatch.setattr(conv_winograd, "_part", lambda *a: calls.append(a))
    got = make_op("Conv", attrs, n_inputs=2)(x, w)[0]
    assert not calls, why
    np.testing.assert_allclose(got, reference_run("Conv", [x, w], attrs)[0], rtol=1e-4, atol=1e-4)


def test_float64_keeps_the_gemm(rng, monkeypatch):
    inputs, attrs = _operands("same_pads", rng)
    calls = []
    monkeypatch.setattr(conv_winograd, "_part", lambda *a: calls.append(a))
    got = make_op("Conv", attrs, n_inputs=3)(*[a.astype(np.float64) for a in inputs])[0]
    assert not calls and got.dtype == np.float64
