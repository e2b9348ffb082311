"""Tests of the shape (asyncinfer/ops/shape.py) and indexing (asyncinfer/ops/indexing.py) kernels.

ONNX's own backend node test cases run through the whole engine on every backend
(tests/node_cases.py); here, that those whose every node is one of these ops cover them all. A few
targeted tests cover what those cases do not (errors, old opsets, no input mutation).
"""
from __future__ import annotations

import numpy as np
import pytest

from asyncinfer import ops
from asyncinfer.errors import ExecutionError, UnsupportedOperatorError
from asyncinfer.model.ir import Layer
from node_cases import cases_made_of, expected_failures_among

SHAPE_OPS = {
    "Shape", "Size", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Transpose", "Concat",
    "Split", "Slice", "Tile", "Pad", "ConstantOfShape", "Constant", "Range", "Dropout",
    "DepthToSpace", "SpaceToDepth", "EyeLike", "Trilu", "OneHot",
}
INDEXING_OPS = {
    "Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND", "NonZero", "TopK",
    "Compress", "Unique",
}
MY_OPS = SHAPE_OPS | INDEXING_OPS


def _my_cases() -> dict[str, object]:
    """Cases whose nodes are all ops of these two modules (so no other module is exercised)."""
    return cases_made_of(MY_OPS)


def test_every_op_has_node_cases() -> None:
    covered = {n.op_type for case in _my_cases().values() for n in case.model.graph.node}
    assert covered == MY_OPS
    assert not expected_failures_among(_my_cases())  # every case passes, training-mode Dropout included


# -- targeted tests -------------------------------------------------------------------------------
def make(op_type: str, version: int, n_outputs: int = 1, **attrs) -> ops.Op:
    layer = Layer(name=f"{op_type.lower()}0", op_type=op_type, inputs=[], attrs=attrs,
                  outputs=[f"out{i}" for i in range(n_outputs)], version=version)
    return ops.create(layer)


def test_gather_out_of_range_index_names_the_op() -> None:
    with pytest.raises((ExecutionError, ValueError), match="Gather"):
        make("Gather", 13, axis=0)(np.arange(4.0), np.array([1, 4]))


def test_gather_negative_indices() -> None:
    (out,) = make("Gather", 13, axis=1)(np.arange(6).reshape(2, 3), np.array([-1, 0]))
    np.testing.assert_array_equal(out, [[2, 0], [5, 3]])


def test_unsupported_attributes_are_refused_at_creation() -> None:
    with pytest.raises(UnsupportedOperatorError, match="mode"):
        make("Pad", 19, mode="symmetric")
    with pytest.raises(UnsupportedOperatorError, match="reduction"):
        make("ScatterND", 16, reduction="max")  # max/min arrived in opset 18
    with pytest.raises(UnsupportedOperatorError, match="mode"):
        make("DepthToSpace", 13, blocksize=2, mode="XYZ")
    with pytest.raises(UnsupportedOperatorError):
        make("Dropout", 6, is_test=0)  # training mode


def test_no_input_mutation() -> None:
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    before = data.copy()
    idx = np.array([[0, 1, 2, 0]], dtype=np.int64)
    upd = np.ones((1, 4), np.float32)
    make("ScatterElements", 18, axis=0, reduction="add")(data, idx, upd)
    make("ScatterND", 18)(data, np.array([[1]]), np.zeros((1, 4), np.float32))
    make("Pad", 19, mode="reflect")(data, np.array([1, 1, 1, 1]))
    make("TopK", 11, 2)(data, np.array([2]))
    make("Unique", 11, 4, sorted=0)(data)
    np.testing.assert_array_equal(data, before)


def test_scatter_elements_accumulates_duplicates() -> None:
    (out,) = make("ScatterElements", 16, axis=1, reduction="add")(
        np.zeros((1, 3), np.float32), np.array([[1, 1, -1]]), np.ones((1, 3), np.float32))
    np.testing.assert_array_equal(out, [[0, 2, 1]])


def test_topk_ties_take_the_smaller_index_first() -> None:
    x = np.array([[3, 1, 3, 2, 1]], dtype=np.uint8)
    values, indices = make("TopK", 11, 2)(x, np.array([3]))
    np.testing.assert_array_equal(values, [[3, 3, 2]])
    np.testing.assert_array_equal(indices, [[0, 2, 3]])
    values, indices = make("TopK", 11, 2, largest=0)(x, np.array([2]))
    np.testing.assert_array_equal(indices, [[1, 4]])
    assert indices.dtype == np.int64


def test_slice_attribute_form_and_negative_step_clamping() -> None:
    (out,) = make("Slice", 1, starts=[1], ends=[1000], axes=[1])(np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(out, [[1, 2], [4, 5]])
    # Negative step: a start before the beginning clamps to index 0, an end of INT_MIN means "through 0".
    int_min = np.array([-2**63])
    (out,) = make("Slice", 13)(np.arange(5), np.array([-100]), int_min, np.array([0]), np.array([-1]))
    np.testing.assert_array_equal(out, [0])
    (out,) = make("Slice", 13)(np.arange(5), np.array([10]), int_min, None, np.array([-2]))
    np.testing.assert_array_equal(out, [4, 2, 0])


def test_pad_negative_pads_crop_and_old_attribute_form() -> None:
    x = np.arange(6).reshape(2, 3)
    (out,) = make("Pad", 19)(x, np.array([0, -1, 1, 1]), np.array(9))
    np.testing.assert_array_equal(out, [[1, 2, 9], [4, 5, 9], [9, 9, 9]])
    (out,) = make("Pad", 2, pads=[0, 1, 0, 0], mode="edge")(x)
    np.testing.assert_array_equal(out, [[0, 0, 1, 2], [3, 3, 4, 5]])


def test_split_num_outputs_uneven_and_old_attribute() -> None:
    parts = make("Split", 18, 3, num_outputs=3)(np.arange(7))
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    parts = make("Split", 11, 2, split=[1, 3])(np.arange(4))
    assert [p.tolist() for p in parts] == [[0], [1, 2, 3]]


def test_old_attribute_forms() -> None:
    x = np.zeros((1, 3, 1))
    assert make("Squeeze", 11, axes=[0])(x)[0].shape == (3, 1)
    assert make("Unsqueeze", 11, axes=[-1, 0])(x)[0].shape == (1, 1, 3, 1, 1)
    assert make("Reshape", 1, shape=[3, -1])(x)[0].shape == (3, 1)
    assert make("TopK", 1, 2, k=2)(np.arange(5.0))[1].tolist() == [4, 3]
    assert make("Tile", 1)(np.arange(2), np.array(3), np.array(0))[0].tolist() == [0, 1] * 3


def test_shape_size_nonzero_dtypes() -> None:
    x = np.array([[0, 2], [3, 0]], dtype=np.float32)
    assert make("Shape", 15, start=-1)(x)[0].dtype == np.int64
    assert make("Size", 13)(x)[0].dtype == np.int64
    out = make("NonZero", 13)(x)[0]
    assert out.dtype == np.int64 and out.tolist() == [[0, 1], [1, 0]]


def test_dropout_inference_mask() -> None:
    x = np.ones((2, 2), np.float32)
    out, mask = make("Dropout", 13, 2)(x)
    assert out is x and mask.dtype == np.bool_ and mask.all()
    out, mask = make("Dropout", 13, 2)(x, np.array(0.5, np.float32), np.array(False))
    assert out is x and mask.all()


def test_constant_value_attributes() -> None:
    assert make("Constant", 13, value_floats=[1.0, 2.0])()[0].dtype == np.float32
    assert make("Constant", 13, value_int=3)()[0].dtype == np.int64
    with pytest.raises(UnsupportedOperatorError):
        make("Constant", 13)


def test_unique_unsorted_outputs() -> None:
    y, first, inverse, counts = make("Unique", 11, 4, sorted=0)(np.array([2, 1, 1, 3, 4, 3]))
    assert y.tolist() == [2, 1, 3, 4] and first.tolist() == [0, 1, 3, 4]
    assert inverse.tolist() == [0, 1, 1, 2, 3, 2] and counts.tolist() == [1, 2, 2, 1]


def test_gathernd_negative_index_and_range_int() -> None:
    (out,) = make("GatherND", 13)(np.arange(4).reshape(2, 2), np.array([[-1, 0]]))
    assert out.tolist() == [2]
    (out,) = make("Range", 11)(np.array(10, np.int32), np.array(4, np.int32), np.array(-3, np.int32))
    assert out.dtype == np.int32 and out.tolist() == [10, 7]


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (1, 1, 3, 3)])
def test_pad_modes_match_the_definition_on_random_pads(mode, shape):
    """Pads that fit one reflection or wrap are slice copies (`shape._border_copies`), wider ones go to
    numpy.pad: both must give the definition, negative pads cropping first."""
    rng = np.random.default_rng(len(shape) * 7 + len(mode))
    op = make("Pad", 19, mode=mode)
    checked = 0
    for _ in range(40):
        pads = rng.integers(-2, 6, size=2 * len(shape))
        x = rng.standard_normal(shape).astype(np.float32)
        widths = [(int(pads[i]), int(pads[i + len(shape)])) for i in range(len(shape))]
        kept = x[tuple(slice(max(-b, 0), n - max(-e, 0)) for n, (b, e) in zip(shape, widths))]
        if any(n <= 0 for n in kept.shape):
            continue
        want = np.pad(kept, [(max(b, 0), max(e, 0)) for b, e in widths], mode=mode)
        np.testing.assert_array_equal(op(x, pads.astype(np.int64))[0], want)
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8])
def test_topk_selection_matches_the_stable_sort(largest: int, dtype: type) -> None:
    """The compiled heap selection (`compiled.top_k`) keeps the very indices, in the very order,
    of the definition's stable sort: ties (few distinct values) by ascending index, on any axis,
    k from 1 to the whole row; floats with NaNs (the largest value) and signed zeros (equal)."""
    from asyncinfer.ops import indexing

    rng = np.random.default_rng(7)
    cases = [((1, 3234), 1, 300, 1000), ((2, 60, 3), 1, 40, 5), ((70,), 0, 70, 3), ((5, 9), 1, 1, 4),
             ((4, 33), 0, 2, 2)]
    for shape, axis, k, spread in cases:
        x = rng.integers(0, spread, size=shape).astype(dtype)
        if np.dtype(dtype).kind == "f":
            x = x - spread // 2  # signed zeros below
            x[rng.random(shape) < 0.05] = np.nan
            x[x == 0] = np.where(rng.random(int((x == 0).sum())) < 0.5, -0.0, 0.0)
            if spread > 5:
                x += rng.standard_normal(shape).astype(dtype)
        assert indexing._selected(x, k, axis, bool(largest)) is not None  # (the case takes the selection)
        values, indices = make("TopK", 11, 2, axis=axis, largest=largest)(x, np.array([k]))
        expected = np.take(indexing._stable_order(x, axis, bool(largest)), np.arange(k), axis=axis)
        np.testing.assert_array_equal(indices, expected)
        np.testing.assert_array_equal(values, np.take_along_axis(x, expected, axis=axis))
