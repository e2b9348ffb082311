"""2-D float MaxPool and AveragePool on their compiled loops (asyncinfer/ops/compiled/pool.py: the separable loops,
rows first or columns first, the flat passes over padded planes, the tile loop where the
windows tile the map, and compiled/pool_three.py's 3x3/2 loop) against onnx's reference implementation:
pads, strides, dilations, ceil_mode, auto_pad, NaN, threads."""
from __future__ import annotations

import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from asyncinfer.concurrency import parallel
from asyncinfer.ops import conv_kernels, pool
from asyncinfer.ops.compiled import pool as compiled_pool

from .op_testing import make_op, randn, reference_run, spin_team_bound

CASES = {
    "3x3_s2_pad1_resnet": ((1, 4, 15, 14), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "ceil_mode": ((1, 2, 9, 10), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    "dilated_asym_pads": ((1, 3, 12, 11), dict(kernel_shape=[3, 2], dilations=[2, 3], pads=[2, 1, 0, 2])),
    "same_upper": ((1, 2, 7, 8), dict(kernel_shape=[4, 3], strides=[2, 1], auto_pad="SAME_UPPER")),
    "unit_stride_5x5": ((1, 2, 9, 9), dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2])),
    # stride 2 across runs on even/odd column phases: odd widths, wide kernels, pads past one phase
    "3x5_s2_odd_width": ((1, 2, 9, 13), dict(kernel_shape=[3, 5], strides=[1, 2], pads=[1, 3, 1, 2])),
    "s2_dilated": ((1, 2, 8, 12), dict(kernel_shape=[2, 3], strides=[2, 2], dilations=[1, 2], pads=[0, 1, 1, 1])),
    # windows that overlap nothing but the map's edge: not tiles
    "2x2_s2_ceil_mode": ((1, 2, 7, 9), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    "2x2_s2_padded": ((1, 2, 8, 8), dict(kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1])),
    "3x3_s3x1_dilated_rows": ((1, 2, 14, 9), dict(kernel_shape=[3, 3], strides=[3, 1], dilations=[2, 1],
                                                  pads=[2, 1, 2, 1])),
    "s2x3_ceil": ((1, 3, 10, 13), dict(kernel_shape=[3, 2], strides=[2, 3], ceil_mode=1)),
    # nothing to pad (the flat passes read the input in place): windows ending on the last row
    # and column, a floor mode that leaves a row and a column unread, dilated taps, wide kernels
    "3x3_s2_no_pads_squeezenet": ((1, 3, 13, 13), dict(kernel_shape=[3, 3], strides=[2, 2])),
    "3x3_s2_no_pads_floor": ((1, 2, 12, 14), dict(kernel_shape=[3, 3], strides=[2, 2])),
    # the 3x3/2 loop's vectors (AVX-512: 16 lanes, AVX2 and NEON: 8): whole ones and a last one
    # overlapping the one before, half ones, down the rows and along them
    "3x3_s2_wide_pads": ((1, 2, 9, 70), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "3x3_s2_wide_no_pads": ((1, 3, 8, 53), dict(kernel_shape=[3, 3], strides=[2, 2])),
    "3x3_s2_one_vector_out": ((1, 2, 7, 33), dict(kernel_shape=[3, 3], strides=[2, 2])),
    "3x3_s2_ceil_asym": ((2, 2, 10, 40), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[0, 1, 1, 0], ceil_mode=1)),
    # a map taller than the 3x3/2 loop's block of rows combined down (`DOWN_BLOCK_VALUES`): three blocks
    "3x3_s2_rows_in_blocks": ((1, 2, 140, 300), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "2x4_s1x3_no_pads_dilated": ((1, 2, 11, 16), dict(kernel_shape=[2, 4], strides=[1, 3], dilations=[3, 2])),
}
# windows that tile the map (kernel = stride, no pads): the tile loop; a last row or column
# shorter than a tile is not read (floor mode)
TILE_CASES = {
    "2x2_s2_odd_width": ((2, 3, 8, 9), dict(kernel_shape=[2, 2], strides=[2, 2])),
    "3x3_s3_remainders": ((1, 2, 11, 10), dict(kernel_shape=[3, 3], strides=[3, 3])),
    "1x2_s1x2": ((1, 3, 5, 8), dict(kernel_shape=[1, 2], strides=[1, 2])),
    "4x2_s4x2": ((1, 2, 8, 6), dict(kernel_shape=[4, 2], strides=[4, 2], dilations=[1, 1])),
}


#: The loops a case is made to take: the separable ones, the flat passes (`pool.flat_pays`
#: forced) or the 3x3/2 loop where the window is one (`pool.takes_three_by_two` forced).
LOOPS = ["separable", "flat", "three_by_two"]


def _force_loop(monkeypatch, loop: str) -> None:
    monkeypatch.setattr(pool, "flat_pays", lambda strides, width, in_place: loop == "flat")
    monkeypatch.setattr(pool, "takes_three_by_two", lambda kernel, strides, dilations, width, in_place: (
        loop == "three_by_two" and _three_by_two(kernel, strides, dilations)))


def _three_by_two(kernel, strides, dilations) -> bool:
    return list(kernel) == [3, 3] and list(strides) == [2, 2] and all(d == 1 for d in dilations)


def _expected_loop(name: str, attrs: dict, loop: str) -> str:
    if name in TILE_CASES:
        return "tiles"
    kernel, strides = attrs["kernel_shape"], attrs.get("strides", [1, 1])
    if loop == "three_by_two" and _three_by_two(kernel, strides, attrs.get("dilations", [1, 1])):
        return "three_by_two"
    return "flat" if loop == "flat" else "columns" if strides[0] > 1 else "rows"


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(CASES) + sorted(TILE_CASES))
def test_matches_reference(name, dtype, loop, rng, monkeypatch):
    """Every case on the separable loops, on the flat passes and (3x3/2) on its own loop."""
    shape, attrs = CASES.get(name) or TILE_CASES[name]
    x = randn(rng, *shape, dtype=dtype)
    calls = []
    _spy_on_loops(monkeypatch, calls)
    _force_loop(monkeypatch, loop)
    (got,) = make_op("MaxPool", attrs, version=12)(x)
    (want,) = reference_run("MaxPool", [x], attrs, opset=12)
    assert set(calls) == {_expected_loop(name, attrs, loop)}
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(CASES) + sorted(TILE_CASES))
def test_average_pool_matches_reference(name, dtype, include_pad, loop, rng, monkeypatch):
    """The same loops summing (then divided by each window's count, pads counted or not)."""
    shape, attrs = CASES.get(name) or TILE_CASES[name]
    attrs = dict(attrs, count_include_pad=include_pad)
    x = randn(rng, *shape, dtype=dtype)
    calls = []
    _spy_on_loops(monkeypatch, calls)
    _force_loop(monkeypatch, loop)
    (got,) = make_op("AveragePool", attrs, version=19)(x)
    (want,) = reference_run("AveragePool", [x], attrs, opset=19)
    assert set(calls) == {_expected_loop(name, attrs, loop)}
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-12, atol=1e-7)


@pytest.mark.parametrize("shape", [(1, 5, 28, 28), (2, 3, 14, 9), (1, 2, 1, 7), (1, 3, 6, 1), (1, 2, 1, 1),
                                   (3, 100, 7, 7), (1, 7, 2, 5), (1, 3, 1, 20), (1, 4, 2, 16), (2, 9, 14, 14)])
@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_three_by_three_unit_stride_average_pool_sums_blocks_of_planes(shape, include_pad, dtype, rng, monkeypatch):
    """A 3x3/1 average pool with a pad of one all round (Inception's) sums blocks of whole planes
    in two flat passes (`pool_three.sum_three_by_one`; 300 planes of 7x7 make several blocks,
    the last one short; from 14 columns the edges are written over after each pass, one and two
    rows included): the bits of the flat passes over padded planes it replaced there
    (signed zeros, NaN and inf included), and the reference's values. Where pads do not count,
    the loop divides each sum by its window's count itself (`mean_three_by_one`): the bits of the
    sums divided by the counts afterwards."""
    from asyncinfer.ops.compiled.pool_three import mean_three_by_one, sum_three_by_one
    attrs = dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=include_pad)
    x = randn(rng, *shape, dtype=dtype)
    calls = []
    _spy_on_loops(monkeypatch, calls)
    (got,) = make_op("AveragePool", attrs, version=19)(x)
    assert set(calls) == {"three_by_one_sum" if include_pad else "three_by_one_mean"}
    (want,) = reference_run("AveragePool", [x], attrs, opset=19)
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-12, atol=1e-7)
    x.reshape(-1)[:3] = [-0.0, np.nan, np.inf][:x.size]  # (the reference skips NaN as it skips pads: bits only)
    planes = x.reshape(-1, *shape[2:])
    flat, in_blocks, means = np.empty_like(planes), np.empty_like(planes), np.empty_like(planes)
    compiled_pool.flat_pool(planes, flat, 0, len(planes), 3, 3, 1, 1, 1, 1, 1, 1, 0.0, True)
    sum_three_by_one(planes, in_blocks, 0, len(planes))
    np.testing.assert_array_equal(in_blocks.view(np.uint8), flat.view(np.uint8))
    h, w = shape[2:]
    counts = np.multiply.outer([min(r + 1, h - 1) - max(r - 1, 0) + 1 for r in range(h)],
                               [min(j + 1, w - 1) - max(j - 1, 0) + 1 for j in range(w)]).astype(dtype)
    mean_three_by_one(planes, means, 1, len(planes))  # (from the second plane: the first one left as it was)
    means[0] = flat[0] / counts
    np.testing.assert_array_equal(means.view(np.uint8), (flat / counts).view(np.uint8))


@pytest.mark.parametrize("shape", [(1, 5, 28, 28), (2, 3, 14, 9), (1, 2, 1, 7), (1, 3, 6, 1), (1, 2, 1, 1),
                                   (3, 100, 7, 7), (1, 7, 2, 5), (1, 3, 1, 20), (1, 4, 2, 16), (2, 9, 14, 14)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_three_by_three_unit_stride_max_pool_takes_blocks_of_planes(shape, dtype, rng, monkeypatch):
    """A 3x3/1 max pool with a pad of one all round (Inception-v2's last pool) takes the two flat
    passes over blocks of whole planes (`pool_three.max_three_by_one`; 300 planes of 7x7 make
    several blocks, the last one short): the reference's values, and the bits of the flat passes
    over padded planes it replaced (signed zeros, NaN and inf included: a NaN in a window wins)."""
    from asyncinfer.ops.compiled.pool_three import max_three_by_one
    attrs = dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    x = randn(rng, *shape, dtype=dtype)
    calls = []
    _spy_on_loops(monkeypatch, calls)
    (got,) = make_op("MaxPool", attrs, version=12)(x)
    assert set(calls) == {"three_by_one_max"}
    np.testing.assert_array_equal(got, reference_run("MaxPool", [x], attrs, opset=12)[0])
    x.reshape(-1)[:4] = [-0.0, np.nan, np.inf, 0.0][:x.size]
    x.reshape(-1)[-1] = -np.inf
    planes = x.reshape(-1, *shape[2:])
    flat, in_blocks = np.empty_like(planes), np.empty_like(planes)
    compiled_pool.flat_pool(planes, flat, 0, len(planes), 3, 3, 1, 1, 1, 1, 1, 1, -np.inf, False)
    max_three_by_one(planes, in_blocks, 0, len(planes))
    np.testing.assert_array_equal(in_blocks.view(np.uint8), flat.view(np.uint8))


WHOLE_MAP_CASES = {
    "7x7_on_7x7": ((1, 6, 7, 7), dict(kernel_shape=[7, 7])),
    "strided_on_5x3": ((2, 3, 5, 3), dict(kernel_shape=[5, 3], strides=[2, 2], count_include_pad=1)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(WHOLE_MAP_CASES))
def test_an_average_pool_over_the_whole_map_is_the_planes_mean(name, dtype, rng, monkeypatch):
    """One window over the whole map (ResNet's last pool) is each plane's mean, no loop of windows;
    with pads it keeps the loops."""
    shape, attrs = WHOLE_MAP_CASES[name]
    x = randn(rng, *shape, dtype=dtype)
    calls = []
    _spy_on_loops(monkeypatch, calls)
    (got,) = make_op("AveragePool", attrs, version=19)(x)
    (want,) = reference_run("AveragePool", [x], attrs, opset=19)
    assert not calls
    assert got.dtype == dtype and got.shape == want.shape == shape[:2] + (1, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-12, atol=1e-7)
    padded = dict(attrs, pads=[1, 1, 1, 1])
    (got,) = make_op("AveragePool", padded, version=19)(x)
    assert calls
    np.testing.assert_allclose(got, reference_run("AveragePool", [x], padded, opset=19)[0], rtol=1e-5, atol=1e-7)


def _spy_on_loops(monkeypatch, calls: list) -> None:
    names = {compiled_pool.ROWS_FIRST: "rows", compiled_pool.COLUMNS_FIRST: "columns", compiled_pool.TILES: "tiles",
             compiled_pool.FLAT: "flat", compiled_pool.THREE_BY_TWO: "three_by_two",
             compiled_pool.THREE_BY_ONE_SUM: "three_by_one_sum", compiled_pool.THREE_BY_ONE_MEAN: "three_by_one_mean",
             compiled_pool.THREE_BY_ONE_MAX: "three_by_one_max"}
    monkeypatch.setattr(pool, "pool_range", lambda loop, *a: calls.append(names[loop]) or _pool_range(loop, *a))


_pool_range = pool.pool_range


def test_nan_wins_and_planes_split_between_threads(rng, monkeypatch):
    """A window holding a NaN gives NaN, as np.maximum (and the NumPy path) do. (onnx's reference
    loop keeps a NaN only where it comes first in the window: the spec leaves NaN open.)"""
    x = randn(rng, 2, 6, 10, 10)
    x[0, 1, 3, 3] = np.nan
    x[1, 5, 0, 0] = np.nan
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    op = make_op("MaxPool", attrs, version=12)
    monkeypatch.setattr(conv_kernels, "PARALLEL_MIN_MACS", 0)
    with ThreadPoolExecutor(2) as helpers, parallel.pool_bound(helpers.submit, 2):
        (got,) = op(x)
    numpy_path = op.separable_reduce(x, np.maximum, -np.inf)[0]
    np.testing.assert_array_equal(got, numpy_path)
    assert np.isnan(got[0, 1, 1:3, 1:3]).all() and np.isnan(got).sum() == 5


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_nan_anywhere_in_a_window_wins(name, loop, rng, monkeypatch):
    """The columns-first loop and the flat passes take a one-instruction max that drops a NaN it
    does not read first, and redo a row (a block of planes, padded or read in place) exactly when
    it holds one; the 3x3/2 loop's max keeps a NaN in any of its three operands: a NaN in any row
    and column of a window, at each stride, still gives NaN there (as np.maximum)."""
    shape, attrs = CASES[name]
    x = randn(rng, *shape)
    values = x.reshape(-1)
    values[rng.choice(values.size, size=max(2, values.size // 40), replace=False)] = np.nan
    _force_loop(monkeypatch, loop)
    op = make_op("MaxPool", attrs, version=12)
    (got,) = op(x)
    numpy_path = op.separable_reduce(x, np.maximum, -np.inf)[0]
    np.testing.assert_array_equal(got, numpy_path)
    assert np.isnan(got).any() and not np.isnan(got).all()


def test_tiles_nan_wins_and_planes_split_between_threads(rng, monkeypatch):
    x = randn(rng, 2, 6, 8, 8)
    x[0, 1, 3, 2] = np.nan  # in the tile of output (1, 1), not its first element
    x[1, 5, 7, 7] = np.nan
    op = make_op("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2]), version=12)
    monkeypatch.setattr(conv_kernels, "PARALLEL_MIN_MACS", 0)
    with ThreadPoolExecutor(2) as helpers, parallel.pool_bound(helpers.submit, 2):
        (got,) = op(x)
    np.testing.assert_array_equal(got, op.separable_reduce(x, np.maximum, -np.inf)[0])
    assert np.isnan(got[0, 1, 1, 1]) and np.isnan(got[1, 5, 3, 3]) and np.isnan(got).sum() == 2


@pytest.mark.parametrize("op_type, attrs", [
    ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2])),                       # SqueezeNet's: columns first
    ("MaxPool", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])),    # rows first
    ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2])),                       # tiles
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])),  # the 3x3/1 sum's planes
])
@pytest.mark.parametrize("helpers", [1, 2])
def test_planes_shared_with_the_spin_team_give_the_same_bits(op_type, attrs, helpers, rng):
    """Float32 pools of enough window taps give each sharer a share of the planes: the bits of
    the pool on one thread, NaN included."""
    x = randn(rng, 2, 8, 80, 80)  # (from 100 k window taps: every case here)
    x[1, 3, 4, 4] = np.nan
    op = make_op(op_type, attrs, version=19 if op_type == "AveragePool" else 12)
    alone = op(x)[0]
    with spin_team_bound(helpers) as runs:
        shared = make_op(op_type, attrs, version=19 if op_type == "AveragePool" else 12)(x)[0]
    assert runs.shared == 1
    np.testing.assert_array_equal(shared, alone)  # (the loops themselves are checked against the reference above)
    assert np.isnan(shared).any()


def test_helpers_not_done_within_the_compiled_spin_are_waited_for_the_slow_way(rng, monkeypatch):
    """The compiled wait (`spin_team.wait_parts`) giving up at once (no spin rounds) leaves the caller to wait through
    `SpinTeam.wait_posted`: the same bits as the pool alone."""
    x = randn(rng, 2, 8, 80, 80)
    op = make_op("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2]), version=12)
    alone = op(x)[0]
    # (the compiled wait's rounds only: the team's own wait spins)
    monkeypatch.setattr(pool, "spin_team", types.SimpleNamespace(WAIT_ROUNDS=0, range_cuts=pool.spin_team.range_cuts))
    with spin_team_bound(1) as runs:
        waited = []
        real = runs.team.wait_posted
        runs.team.wait_posted = lambda helpers: (waited.append(helpers), real(helpers))
        shared = make_op("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2]), version=12)(x)[0]
    assert runs.shared == 1 and waited == [1]
    np.testing.assert_array_equal(shared, alone)


def test_pool_with_the_team_busy_runs_here(rng):
    x = randn(rng, 1, 8, 30, 30)
    op = make_op("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2]), version=12)
    with spin_team_bound(1) as runs, runs.busy():
        got = op(x)[0]
    assert runs.shared == 0
    np.testing.assert_array_equal(got, op.separable_reduce(x, np.maximum, -np.inf)[0])


def test_float64_and_tiny_pools_stay_off_the_team(rng):
    with spin_team_bound(1) as runs:
        make_op("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2]), version=12)(randn(rng, 1, 8, 30, 30, dtype=np.float64))
        make_op("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2]), version=12)(randn(rng, 1, 2, 4, 4))
    assert runs.shared == 0


@pytest.mark.parametrize("op_type", ["MaxPool", "AveragePool"])
def test_flat_passes_in_blocks_of_planes(op_type, rng, monkeypatch):
    """The flat passes take the planes a block at a time (`FLAT_BLOCK_FLOATS`: here 114 planes of
    13x11, then a partial block of 56; without pads, read in place, 165 planes of 11x9, then 5):
    the spare tail after a block, the stale planes of the earlier one, and (in place) the rows
    past a plane's end never reach an output."""
    _force_loop(monkeypatch, "flat")
    x = randn(rng, 1, 170, 11, 9) * 4
    x[0, 120] += 50  # (a large plane in the second block: its neighbours' windows must not see it)
    x[0, 169] -= 50
    for attrs in (dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
                  dict(kernel_shape=[3, 2], strides=[1, 1], dilations=[2, 1], pads=[2, 0, 2, 1]),
                  dict(kernel_shape=[3, 3], strides=[2, 2]),  # in place: rows that run into the next plane
                  dict(kernel_shape=[2, 3], strides=[2, 1], dilations=[1, 3])):
        (got,) = make_op(op_type, attrs, version=19)(x)
        (want,) = reference_run(op_type, [x], attrs, opset=19)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
