"""The few-row GEMM kernel of decode steps (`ops.compiled.few_rows`): the definition's values,
and each row's bits independent of the other rows and of how the columns are split."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from asyncinfer.concurrency import parallel
from asyncinfer.ops import linalg
from asyncinfer.ops.compiled.few_rows import ONE_ROW_SEQUENTIAL_COLUMNS, few_rows_matmul
from asyncinfer.ops.compiled.panels import BLOCK_ROWS, no_panels, pack_panels, panel_width


def _operands(m: int, k: int, n: int, dtype: type, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m, k, n", [(1, 768, 100), (3, 5, 33), (4, 8, 16), (7, 131, 257), (8, 64, 1000),
                                     (16, 3, 17), (5, 1, 9), (2, 0, 4)])
@pytest.mark.parametrize("tile", [16, 48, 4096])
@pytest.mark.parametrize("packed", [False, True])
def test_equals_the_float64_product(m, k, n, dtype, tile, packed):
    a, b = _operands(m, k, n, dtype, seed=m * 1000 + k)
    y = np.full((m, n), np.nan, dtype=dtype)
    few_rows_matmul(a, b, y, 0, k, tile, pack_panels(b) if packed else no_panels(dtype))
    expected = a.astype(np.float64) @ b.astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(y, expected, rtol=tol, atol=tol * max(1, k) ** 0.5)


@pytest.mark.parametrize("k0, k1", [(0, 13), (13, 40), (4, 8), (40, 40)])
@pytest.mark.parametrize("packed", [False, True])
def test_sums_only_its_block_of_k(k0, k1, packed):
    a, b = _operands(6, 40, 70, np.float32)
    y = np.full((6, 70), -7.0, dtype=np.float32)
    few_rows_matmul(a, b, y, k0, k1, 32, pack_panels(b) if packed else no_panels(np.float32))
    np.testing.assert_allclose(y, a[:, k0:k1].astype(np.float64) @ b[k0:k1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_inf_and_nan_propagate_as_in_the_definition(packed):
    a, b = _operands(5, 12, 40, np.float32)
    a[1, 3], a[2, 4], b[7, 5] = np.inf, np.nan, -np.inf
    b[3, 2] = 0.0  # inf * 0 is NaN
    y = np.empty((5, 40), dtype=np.float32)
    few_rows_matmul(a, b, y, 0, 12, 16, pack_panels(b) if packed else no_panels(np.float32))
    with np.errstate(invalid="ignore"):
        expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isinf(y), np.isinf(expected))
    np.testing.assert_allclose(y[finite], expected[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("k, n", [(768, 300), (771, 300), (771, ONE_ROW_SEQUENTIAL_COLUMNS + 29)])
def test_a_row_has_the_same_bits_alone_in_any_batch(k, n, packed, dtype):
    """A stream's logits must not depend on who shares its decode step: each row of a batch of
    1..16 equals the row computed alone, bit for bit (the row-wise loop's 4-row block and 1-row
    remainder, the panels' register blocks of 8, 4, 2 and 1 rows, the tail columns next to the
    panels, and both one-row kernels, sequential on narrow b and interleaved on wide, sum in one
    order)."""
    a, b = _operands(16, k, n, dtype, seed=k)
    panels = pack_panels(b) if packed else no_panels(dtype)
    alone = np.empty((16, n), dtype=dtype)
    for r in range(16):
        few_rows_matmul(a[r:r + 1].copy(), b, alone[r:r + 1], 0, k, 128, panels)
    for m in range(1, 17):
        for first in sorted({0, 16 - m, (16 - m) // 2}):
            y = np.empty((m, n), dtype=dtype)
            few_rows_matmul(a[first:first + m].copy(), b, y, 0, k, 128, panels)
            np.testing.assert_array_equal(y, alone[first:first + m])


def test_panels_are_the_whole_column_blocks_of_b():
    b = np.arange(5 * 70, dtype=np.float32).reshape(5, 70)
    width = panel_width(np.float32)
    panels = pack_panels(b)
    assert panels.shape == (70 // width, 5, width) and panels.flags.c_contiguous
    for p in range(panels.shape[0]):
        np.testing.assert_array_equal(panels[p], b[:, p * width:(p + 1) * width])
    assert BLOCK_ROWS in (4, 8) and panel_width(np.float64) == width // 2


@pytest.mark.parametrize("width", [2, 3])
def test_split_along_k_across_the_pool(width, monkeypatch):
    """linalg.matmul routes few-row GEMMs here and splits K across the pool: the definition's
    values, the pool used, and each row's bits the same in any batch of the same worker."""
    monkeypatch.setattr(linalg, "FEW_ROWS_MIN_B_BYTES", 0)
    monkeypatch.setattr(linalg, "SPLIT_MIN_B_BYTES", 0)
    a, b = _operands(16, 298, 1000, np.float32, seed=width)
    calls = []
    real = parallel.run_parts
    monkeypatch.setattr(parallel, "run_parts", lambda count, part: (calls.append(count), real(count, part)))
    with ThreadPoolExecutor(width) as pool, parallel.pool_bound(pool.submit, width):
        batched = linalg.matmul(a, b)
        assert calls == [width]
        for r in (0, 5, 15):
            np.testing.assert_array_equal(linalg.matmul(a[r:r + 1], b)[0], batched[r])
        np.testing.assert_array_equal(linalg.matmul(a[3:11], b), batched[3:11])
    np.testing.assert_allclose(batched, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def test_matmul_takes_the_kernel_only_where_it_applies(monkeypatch):
    """Transposed weights, integer operands, mixed dtypes, many rows and a K too shallow for its
    rows (a convolution's few channels by its im2col matrix) keep their other paths (and the
    definition's values)."""
    monkeypatch.setattr(linalg, "FEW_ROWS_MIN_B_BYTES", 0)
    used = []
    real = linalg.few_rows_matmul
    monkeypatch.setattr(linalg, "few_rows_matmul", lambda *args: (used.append(1), real(*args)))
    a, b = _operands(4, 64, 40, np.float32)
    cases = [(a, b, True), (a, np.asfortranarray(b), False), (a.astype(np.int64), b.astype(np.int64), False),
             (np.ones((17, 64), np.float32), b, False), (a.astype(np.float64), b, False),
             (a.astype(np.float16), b.astype(np.float16), False), (a[:, :63], b[:63], False)]
    for x, w, expected_use in cases:
        used.clear()
        np.testing.assert_allclose(linalg.matmul(x, w), np.matmul(x, w), rtol=1e-3, atol=1e-2)
        assert bool(used) == expected_use
    assert linalg.matmul(np.ones((0, 30), np.float32), b[:30]).shape == (0, 40)


@pytest.mark.parametrize("setting", ["", "1", "0"])
def test_a_constant_weight_is_packed_once_and_only_for_batches(monkeypatch, setting):
    """MatMul and Gemm keep their constant B packed in panels from their first product of two rows
    or more inside `packing_weights` (and use it: the same bits as the row-wise loop), unless
    ASYNCINFER_PACKED_WEIGHTS=0; one row, a product outside the context, or a B fed as an input
    packs nothing."""
    import onnx
    from onnx import helper, numpy_helper

    import asyncinfer as ai

    monkeypatch.setattr(linalg, "FEW_ROWS_MIN_B_BYTES", 0)
    monkeypatch.setenv("ASYNCINFER_PACKED_WEIGHTS", setting)
    packs = setting != "0"  # ASYNCINFER_PACKED_WEIGHTS=0: one copy of the weights, the same bits
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 70)).astype(np.float32)
    c = rng.standard_normal(70).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["a", "w"], ["y_const"], name="with_constant"),
             helper.make_node("Gemm", ["a", "w", "c"], ["y_gemm"], name="gemm"),
             helper.make_node("MatMul", ["a", "b"], ["y_fed"], name="with_input")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["m", 64]),
                     helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [64, 70])],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["m", 70]) for n in ("y_const", "y_gemm", "y_fed")],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")])
    model = ai.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    with ai.Worker(model) as worker:
        ops = {n.layer.name: n.step.op for n in worker._plan.nodes}
        weight, bias = model.constants["w"], model.constants["c"]  # what the plan binds and feeds
        one, a = rng.standard_normal((1, 64)).astype(np.float32), rng.standard_normal((3, 64)).astype(np.float32)
        with linalg.packing_weights():
            ops["with_constant"].run(one, weight)  # one row: nothing to pack
        unpacked = ops["with_constant"].run(a, weight)  # outside the context: none made
        assert not any(op._derived for op in ops.values())
        with linalg.packing_weights():
            packed = ops["with_constant"].run(a, weight)
            gemm = ops["gemm"].run(a, weight, bias)
            fed = ops["with_input"].run(a, weight.copy())  # the same values, not the constant
        assert ("panels" in ops["with_constant"]._derived) is packs and ("panels" in ops["gemm"]._derived) is packs
        assert not ops["with_input"]._derived
        np.testing.assert_array_equal(packed, unpacked)  # packed or not: the same bits
        np.testing.assert_array_equal(packed, fed)
        used = []
        real = linalg._few_rows
        monkeypatch.setattr(linalg, "_few_rows", lambda *args: (used.append(args[3].shape[0] > 0), real(*args))[1])
        np.testing.assert_array_equal(ops["with_constant"].run(a, weight), packed)
        assert used == [packs]  # kept panels are used outside the context too
        expected = packed.copy()
        expected += bias
        np.testing.assert_array_equal(gemm, expected)
        out = worker.run_blocking({"a": a, "b": w})  # and the whole model, as the plan runs it
        np.testing.assert_array_equal(out["y_const"], packed)
        np.testing.assert_allclose(out["y_const"], a.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
