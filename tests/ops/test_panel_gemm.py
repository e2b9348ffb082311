"""Float32 products on the panel GEMM (asyncinfer/ops/compiled/gemm.py, `linalg.matmul`'s
`_panel_gemm`): a's rows and b's columns read in place, blocks of rows by panels of columns,
the bias added as each block is stored, panels shared with the spin team."""
from __future__ import annotations

import types
from functools import partial

import numpy as np
import pytest

from asyncinfer.concurrency import parallel
from asyncinfer.ops import linalg
from asyncinfer.ops.compiled import gemm

from .op_testing import TeamRuns

W = gemm.WIDTH


def _exact(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    y = a.astype(np.float64) @ b.astype(np.float64)
    return y if bias is None else y + bias


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17, 128])
@pytest.mark.parametrize("k, panels", [(1, 1), (7, 3), (128, 4), (300, 2)])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_matches_the_exact_product(m, k, panels, biased, packed, rng):
    """Rows in blocks of 14 (AVX-512, b packed), 8 (or 4 without AVX-512), 4, 2, 1; any depth;
    one panel or several."""
    from asyncinfer.ops.compiled.panels import pack_panels

    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, panels * W)).astype(np.float32)
    bias = rng.standard_normal(panels * W).astype(np.float32) if biased else None
    packing = pack_panels(b) if packed else None
    assert linalg._takes_panel_gemm(a, b, bias, packing)
    got = linalg.matmul(a, b, bias, packing)
    assert got.dtype == np.float32 and got.shape == (m, panels * W)
    np.testing.assert_allclose(got, _exact(a, b, bias), rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_a_view_of_wider_rows_is_read_in_place(rng):
    wide = rng.standard_normal((20, 50)).astype(np.float32)
    a = wide[:, 3:43]
    b = rng.standard_normal((40, 2 * W)).astype(np.float32)
    assert linalg._takes_panel_gemm(a, b, None)
    np.testing.assert_allclose(linalg.matmul(a, b), _exact(a, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("helpers, panels", [(1, 2), (1, 5), (2, 3), (2, 7)])
def test_panels_shared_with_the_team_give_the_same_bits(helpers, panels, packed, rng, monkeypatch):
    """Each thread takes a range of panels (b's columns, read in place or packed: `pack_panels`);
    every output is the same sum in the same order whoever computes it."""
    from asyncinfer.ops.compiled.panels import pack_panels

    monkeypatch.setattr(linalg, "TEAM_MIN_MACS", 0)
    a = rng.standard_normal((37, 64)).astype(np.float32)
    b = rng.standard_normal((64, panels * W)).astype(np.float32)
    bias = rng.standard_normal(panels * W).astype(np.float32)
    packing = pack_panels(b) if packed else None
    alone = linalg.matmul(a, b, bias, packing)  # (no team bound: one thread)
    runs = TeamRuns(helpers)
    try:
        with parallel.pool_bound(None, helpers + 1, runs.team):
            shared = linalg.matmul(a, b, bias, packing)
            with runs.busy():  # the team claimed by another poster: every panel here
                busy = linalg.matmul(a, b, bias, packing)
    finally:
        runs.team.close()
    assert runs.shared == 1
    np.testing.assert_array_equal(shared, alone)
    np.testing.assert_array_equal(busy, alone)
    np.testing.assert_array_equal(alone, linalg._panel_gemm(a[None], b[None], bias)[0])  # (b read in place)
    np.testing.assert_allclose(alone, _exact(a, b, bias), rtol=1e-4, atol=1e-4)


def test_helpers_not_done_within_the_compiled_spin_are_waited_for_the_slow_way(rng, monkeypatch):
    """`finish_gemm` giving up at once (no spin rounds) leaves the caller to wait through
    `SpinTeam.wait_posted`: the same bits as the product alone."""
    monkeypatch.setattr(linalg, "TEAM_MIN_MACS", 0)
    a = rng.standard_normal((37, 64)).astype(np.float32)
    b = rng.standard_normal((64, 4 * W)).astype(np.float32)
    alone = linalg.matmul(a, b)
    # (the compiled wait's rounds only: the team's own wait spins)
    monkeypatch.setattr(linalg, "spin_team", types.SimpleNamespace(WAIT_ROUNDS=0, addresses=linalg.spin_team.addresses))
    runs = TeamRuns(1)
    waited = []
    real = runs.team.wait_posted
    runs.team.wait_posted = lambda helpers: (waited.append(helpers), real(helpers))
    try:
        with parallel.pool_bound(None, 2, runs.team):
            shared = linalg.matmul(a, b)
    finally:
        runs.team.close()
    assert runs.shared == 1 and waited == [1]
    np.testing.assert_array_equal(shared, alone)


def test_other_products_keep_their_ways(rng):
    """Columns not whole panels, a broadcast row, a transposed b, float64, an a larger than
    `PANEL_GEMM_MAX_A_BYTES`, a depth over `PANEL_GEMM_MAX_DEPTH`: not the panel GEMM."""
    a = rng.standard_normal((16, 32)).astype(np.float32)
    b = rng.standard_normal((32, 2 * W)).astype(np.float32)
    assert linalg._takes_panel_gemm(a, b, None)
    assert not linalg._takes_panel_gemm(a, b[:, :W + 1].copy(), None)
    assert not linalg._takes_panel_gemm(np.broadcast_to(a[:1], a.shape), b, None)
    assert not linalg._takes_panel_gemm(a, np.asfortranarray(b), None)
    assert not linalg._takes_panel_gemm(a.astype(np.float64), b.astype(np.float64), None)
    big = np.zeros((linalg.PANEL_GEMM_MAX_A_BYTES // 128 + 1, 32), np.float32)
    assert not linalg._takes_panel_gemm(big, b, None)
    deep = linalg.PANEL_GEMM_MAX_DEPTH + 1
    assert not linalg._takes_panel_gemm(np.zeros((2, deep), np.float32), np.zeros((deep, W), np.float32), None)


def _heads(rng, heads: int, m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Queries as a transposed view (rows a row of all heads apart) and keys transposed (rows
    not contiguous: copied), as an exported attention makes them."""
    q = rng.standard_normal((1, m, heads, k)).astype(np.float32).transpose(0, 2, 1, 3)
    keys = rng.standard_normal((1, n, heads, k)).astype(np.float32).transpose(0, 2, 3, 1)
    return q, keys


@pytest.mark.parametrize("heads, helpers", [(2, 1), (3, 1), (1, 2), (4, 2)])
def test_a_batch_of_heads_runs_entry_by_entry_with_the_same_bits_shared_or_not(heads, helpers, rng, monkeypatch):
    """Entries split between the threads where there are as many, else panels; a view's rows
    read in place, transposed keys copied first."""
    monkeypatch.setattr(linalg, "TEAM_MIN_MACS", 0)
    q, keys = _heads(rng, heads, 24, 16, 3 * W)
    assert linalg._panel_batch(q, keys) is not None
    alone = linalg.matmul(q, keys)
    runs = TeamRuns(helpers)
    try:
        with parallel.pool_bound(None, helpers + 1, runs.team):
            shared = linalg.matmul(q, keys)
    finally:
        runs.team.close()
    assert runs.shared == 1 and shared.shape == (1, heads, 24, 3 * W)
    np.testing.assert_array_equal(shared, alone)
    np.testing.assert_allclose(alone, _exact(q, keys), rtol=1e-4, atol=1e-4)


def test_batches_that_broadcast_or_have_partial_panels_keep_numpy(rng):
    a = rng.standard_normal((2, 5, 8)).astype(np.float32)
    assert linalg._panel_batch(a, rng.standard_normal((1, 8, W)).astype(np.float32)) is None  # broadcast
    assert linalg._panel_batch(a, rng.standard_normal((2, 8, W + 3)).astype(np.float32)) is None
    assert linalg._panel_batch(a.astype(np.float64), rng.standard_normal((2, 8, W))) is None
    b = rng.standard_normal((2, 8, W)).astype(np.float32)
    np.testing.assert_allclose(linalg.matmul(a, b), _exact(a, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("setting", ["", "0"])
def test_a_constant_weight_is_packed_at_its_first_product(monkeypatch, rng, setting):
    """MatMul's and Gemm's constant B (transposed too) is packed in panels at the first product
    the panel GEMM takes (no `packing_weights` needed), unless ASYNCINFER_PACKED_WEIGHTS=0, and
    the packed panels give the very bits of b read in place; a B fed as an input packs nothing."""
    import onnx
    from onnx import helper, numpy_helper

    import asyncinfer as ai

    monkeypatch.setenv("ASYNCINFER_PACKED_WEIGHTS", setting)
    packs = setting != "0"
    k, n = 48, 3 * W
    w = rng.standard_normal((k, n)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["a", "w"], ["y_const"], name="with_constant"),
             helper.make_node("Gemm", ["a", "wt"], ["y_gemm"], name="gemm", transB=1),
             helper.make_node("MatMul", ["a", "b"], ["y_fed"], name="with_input")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["m", k]),
                     helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [k, n])],
        [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["m", n]) for name in ("y_const", "y_gemm", "y_fed")],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ascontiguousarray(w.T), "wt")])
    model = ai.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    a = rng.standard_normal((40, k)).astype(np.float32)
    with ai.Worker(model) as worker:
        ops = {node.layer.name: node.step.op for node in worker._plan.nodes}
        y = ops["with_constant"].run(a, model.constants["w"])
        y_gemm = ops["gemm"].run(a, model.constants["wt"])
        y_fed = ops["with_input"].run(a, w.copy())
        assert ("panels" in ops["with_constant"]._derived) is packs and ("panels" in ops["gemm"]._derived) is packs
        assert not ops["with_input"]._derived
        np.testing.assert_array_equal(y, y_fed)  # packed or read in place: the same bits
        np.testing.assert_allclose(y, _exact(a, w), rtol=1e-4, atol=1e-4)
        # Gemm's transposed B: the panel GEMM once packed, else BLAS (whose sums may differ by rounding)
        check = np.testing.assert_array_equal if packs else partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
        check(y_gemm, y_fed)
        outputs = worker.run_blocking({"a": a, "b": w})
        np.testing.assert_array_equal(outputs["y_const"], y_fed)
        np.testing.assert_array_equal(outputs["y_fed"], y_fed)
        check(outputs["y_gemm"], y_fed)


def test_a_packed_b_takes_the_panel_gemm_deeper(rng, monkeypatch):
    """b packed (`pack_panels`, all of its panels) takes the panel GEMM beyond
    `PANEL_GEMM_MAX_DEPTH`, up to `PANEL_GEMM_MAX_PACKED_DEPTH`, with the bits of b read in place."""
    from asyncinfer.ops.compiled.panels import pack_panels

    monkeypatch.setattr(linalg, "PANEL_GEMM_MAX_DEPTH", 16)
    a = rng.standard_normal((21, 40)).astype(np.float32)
    b = rng.standard_normal((40, 5 * W)).astype(np.float32)
    packed = pack_panels(b)
    assert not linalg._takes_panel_gemm(a, b, None) and linalg._takes_panel_gemm(a, b, None, packed)
    assert not linalg._takes_panel_gemm(a, b, None, packed[:4])  # (not all of b's panels)
    monkeypatch.setattr(linalg, "PANEL_GEMM_MAX_PACKED_DEPTH", 32)
    assert not linalg._takes_panel_gemm(a, b, None, packed)
    monkeypatch.setattr(linalg, "PANEL_GEMM_MAX_PACKED_DEPTH", 4096)
    np.testing.assert_array_equal(linalg.matmul(a, b, None, packed), linalg._panel_gemm(a[None], b[None], None)[0])


def test_a_large_a_goes_in_bands_with_the_bits_of_one(rng):
    """An a larger than a band (`gemm.A_BAND_BYTES`) runs band after band through every panel;
    packed, it takes the panel GEMM whatever its size (`PANEL_GEMM_MAX_A_BYTES` bounds only an a
    whose b is read in place). Each value is still one block's sum: the same bits either way."""
    from asyncinfer.ops.compiled.panels import pack_panels

    k = 1024
    m = 3 * (gemm.A_BAND_BYTES // (4 * k)) + 5  # three whole bands and a few rows
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, 2 * W)).astype(np.float32)
    packed = pack_panels(b)
    assert a.nbytes > linalg.PANEL_GEMM_MAX_A_BYTES
    assert not linalg._takes_panel_gemm(a, b, None) and linalg._takes_panel_gemm(a, b, None, packed)
    banded = linalg.matmul(a, b, None, packed)
    whole = np.empty_like(banded)
    for r in range(0, m, 64):  # (blocks of rows small enough to be one band each)
        gemm.panel_gemm(a[r:r + 64], b, whole[r:r + 64], np.zeros(2 * W, np.float32), 0, 2, False)
    np.testing.assert_array_equal(banded, whole)
    np.testing.assert_allclose(banded, _exact(a, b), rtol=1e-4, atol=1e-3)
