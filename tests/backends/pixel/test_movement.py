"""gpu_pixel data movement and shape kernels against the CPU backend: free views, Transpose,
Concat, Slice, Split, Gather(Elements), Expand, Tile, Pad, DepthToSpace/SpaceToDepth, Cast.

Moves are exact, so outputs must equal the CPU's bit for bit, for float32, int64 and bool data.
Some cases also check which shader path ran (texel copies vs one value at a time) by recording
the ``mode`` of every draw.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from asyncinfer.backends.pixel.device import PixelDevice
from pixel_testing import assert_close, one_node_model, run_both

RNG = np.random.default_rng(7)
INT_MAX = np.iinfo(np.int64).max


def data(shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    """Random values of ``dtype`` (integers signed and small, so stored exactly)."""
    if dtype == "bool":
        return RNG.random(shape) > 0.5
    if dtype in ("int64", "int32"):
        return RNG.integers(-1000, 1000, shape).astype(dtype)
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture
def modes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ``mode`` of every draw the pixel device issues during the test."""
    seen: list[str] = []
    original = PixelDevice.draw

    def draw(self, out_shape, body, inputs, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs.get("mode", "value"))
        return original(self, out_shape, body, inputs, **kwargs)

    monkeypatch.setattr(PixelDevice, "draw", draw)
    return seen


def check(op: str, inputs: list, attrs: dict | None = None, *, opset: int = 17, n_outputs: int = 1,
          constants: dict[int, np.ndarray] | None = None, optimize: bool = True) -> int:
    """Run one node on gpu_pixel and cpu, require equal outputs; returns the pixel draw count."""
    constants = constants or {}
    model = one_node_model(op, inputs, attrs, opset=opset, n_outputs=n_outputs, constants=constants)
    feeds = {f"i{k}": x for k, x in enumerate(inputs) if x is not None and k not in constants}
    got, expected, worker = run_both(model, feeds, optimize=optimize)
    assert_close(got, expected, rtol=0, atol=0)
    return worker._backend.gpu.draws


# -- free views --------------------------------------------------------------------------------------
VIEWS = [
    ("Reshape", (2, 3, 4, 5), {}, 17, {1: np.array([6, -1])}),
    ("Reshape", (2, 3, 4), {}, 17, {1: np.array([0, 0, 2, 2])}),
    ("Reshape", (0, 3), {"allowzero": 1}, 17, {1: np.array([3, 0])}),
    ("Flatten", (2, 3, 4, 5), {"axis": 2}, 17, {}),
    ("Flatten", (2, 3, 4), {"axis": -1}, 17, {}),
    ("Flatten", (2, 3, 4), {"axis": 0}, 17, {}),
    ("Squeeze", (1, 3, 1, 5), {}, 17, {}),
    ("Squeeze", (1, 3, 1, 5), {"axes": [-2]}, 11, {}),
    ("Squeeze", (1, 3, 1, 5), {}, 13, {1: np.array([0, 2])}),
    ("Unsqueeze", (3, 5), {"axes": [0, -1]}, 11, {}),
    ("Unsqueeze", (3, 5), {}, 13, {1: np.array([1, -1])}),
]


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool"])
@pytest.mark.parametrize("op,shape,attrs,opset,constants", VIEWS)
def test_views_issue_no_draw(op, shape, attrs, opset, constants, dtype):  # type: ignore[no-untyped-def]
    inputs = [data(shape, dtype)] + [None] * len(constants)
    assert check(op, inputs, attrs, opset=opset, constants=constants) == 0


def test_identity_is_a_view() -> None:
    assert check("Identity", [data((3, 5))], optimize=False) == 0


def two_node_model(first: onnx.NodeProto, second: onnx.NodeProto, x: np.ndarray,
                   inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    """``x`` through ``first`` then ``second`` (whose input is ``mid``), output ``out``."""
    graph = helper.make_graph(
        [first, second], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_empty_tensor_value_info("out")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("second", [
    helper.make_node("Transpose", ["mid"], ["out"], perm=[0, 2, 1]),
    helper.make_node("Slice", ["mid", "starts", "ends", "axes"], ["out"]),
    helper.make_node("Concat", ["mid", "mid"], ["out"], axis=-1),
])
def test_draws_read_views_of_channel_blocked_tensors(second: onnx.NodeProto) -> None:
    """A reshaped NCHW tensor keeps its channel-blocked layout; the next draw must read it so."""
    x = data((2, 6, 3, 5))
    inits = [onnx.numpy_helper.from_array(np.array(v), n) for n, v in
             (("shape", [2, 6, 15]), ("starts", [1]), ("ends", [14]), ("axes", [-1]))]
    model = two_node_model(helper.make_node("Reshape", ["x", "shape"], ["mid"]), second, x, inits)
    got, expected, _ = run_both(model, {"x": x})
    assert_close(got, expected, rtol=0, atol=0)


# -- Transpose ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,perm,mode", [
    ((2, 6, 3, 5), [0, 1, 3, 2], "texel"),   # channels stay blocked
    ((2, 6, 3, 5), [0, 2, 3, 1], "value"),   # NCHW -> NHWC
    ((2, 3, 5, 6), [0, 3, 1, 2], "value"),   # NHWC -> NCHW
    ((2, 6, 3, 5), [3, 2, 1, 0], "value"),
    ((4, 3, 7), [1, 0, 2], "texel"),
    ((4, 3, 7), [0, 2, 1], "value"),
    ((4, 3, 7), [2, 0, 1], "value"),
    ((5, 9), None, "value"),
    ((2, 3, 4, 5, 6), [0, 3, 1, 4, 2], "value"),
])
def test_transpose(shape, perm, mode, modes) -> None:  # type: ignore[no-untyped-def]
    attrs = {} if perm is None else {"perm": perm}
    check("Transpose", [data(shape)], attrs)
    assert modes == [mode]


@pytest.mark.parametrize("dtype", ["int64", "bool"])
def test_transpose_keeps_dtype(dtype: str) -> None:
    check("Transpose", [data((3, 4, 5), dtype)], {"perm": [2, 0, 1]})


# -- Concat ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shapes,axis,mode", [
    ([(1, 8, 3, 3), (1, 4, 3, 3), (1, 5, 3, 3)], 1, "texel"),   # channel counts multiples of 4 (the last free)
    ([(1, 6, 3, 3), (1, 4, 3, 3)], 1, "value"),                  # 6 channels: unaligned offset
    ([(2, 5, 3, 3), (2, 5, 1, 3)], 2, "texel"),                  # spatial axis
    ([(2, 5, 3, 3), (2, 5, 3, 2)], -1, "texel"),
    ([(2, 5, 3, 3), (1, 5, 3, 3)], 0, "texel"),
    ([(3, 4), (3, 8), (3, 3)], -1, "texel"),
    ([(3, 3), (3, 4)], 1, "value"),
    ([(3, 3), (2, 3)], 0, "texel"),
    ([(7,), (2,), (5,)], 0, "value"),
])
def test_concat(shapes, axis, mode, modes) -> None:  # type: ignore[no-untyped-def]
    check("Concat", [data(s) for s in shapes], {"axis": axis})
    assert modes == [mode]


@pytest.mark.parametrize("dtype", ["int64", "bool"])
def test_concat_keeps_dtype_with_a_constant_input(dtype: str) -> None:
    const = data((2, 3, 4), dtype)
    check("Concat", [data((2, 1, 4), dtype), None, data((2, 2, 4), dtype)], {"axis": 1}, constants={1: const})


def test_concat_of_more_inputs_than_texture_units(modes) -> None:  # type: ignore[no-untyped-def]
    check("Concat", [data((2, 1, 3)) for _ in range(40)], {"axis": 1})
    assert len(modes) > 1


def test_concat_with_an_empty_input() -> None:
    check("Concat", [data((2, 3)), data((2, 0)), data((2, 2))], {"axis": 1})


# -- Slice -------------------------------------------------------------------------------------------
SLICES = [  # starts, ends, axes, steps
    ([1, 0], [3, 2], None, None),
    ([0, 1], [INT_MAX, -1], [2, 3], None),
    ([-1], [-INT_MAX], [-1], [-1]),
    ([4, 2], [0, -100], [1, 3], [-2, -1]),
    ([1], [100], [0], [2]),
    ([0, 0, 0, 1], [2, 6, 3, 5], None, [1, 1, 2, 3]),
    ([3], [3], [1], None),  # empty
]


@pytest.mark.parametrize("starts,ends,axes,steps", SLICES)
def test_slice(starts, ends, axes, steps) -> None:  # type: ignore[no-untyped-def]
    params = (starts, ends, axes, steps)
    constants = {k + 1: np.array(v, np.int64) for k, v in enumerate(params) if v is not None}
    check("Slice", [data((2, 6, 3, 5))] + [None] * 4, constants=constants)


@pytest.mark.parametrize("shape,starts,ends,axes,mode", [
    ((2, 6, 3, 5), [1, 1], [3, 4], [2, 3], "texel"),   # spatial crop of NCHW
    ((2, 9, 3, 5), [4], [9], [1], "texel"),            # channel offset 4
    ((2, 9, 3, 5), [1], [9], [1], "value"),            # channel offset 1
    ((3, 10), [4], [9], [1], "texel"),
    ((3, 10), [2], [9], [1], "value"),
])
def test_slice_paths(shape, starts, ends, axes, mode, modes) -> None:  # type: ignore[no-untyped-def]
    constants = {1: np.array(starts), 2: np.array(ends), 3: np.array(axes)}
    check("Slice", [data(shape), None, None, None], constants=constants)
    assert modes == [mode]


@pytest.mark.parametrize("dtype", ["int64", "bool"])
def test_slice_keeps_dtype(dtype: str) -> None:
    constants = {1: np.array([5]), 2: np.array([0]), 3: np.array([1]), 4: np.array([-2])}
    check("Slice", [data((3, 7), dtype), None, None, None, None], constants=constants)


def test_slice_opset_9_attributes() -> None:
    check("Slice", [data((4, 6))], {"starts": [1, -4], "ends": [INT_MAX, -1], "axes": [0, 1]}, opset=9)


# -- Split -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,attrs,opset,split,n", [
    ((2, 7, 3), {"axis": 1}, 13, [2, 4, 1], 3),
    ((2, 8, 3, 3), {"axis": 1}, 13, [4, 4], 2),
    ((6, 5), {"axis": -1, "split": [1, 4]}, 11, None, 2),
    ((6, 5), {"axis": 0}, 11, None, 3),
    ((2, 7), {"axis": 1, "num_outputs": 3}, 18, None, 3),
])
def test_split(shape, attrs, opset, split, n) -> None:  # type: ignore[no-untyped-def]
    constants = {} if split is None else {1: np.array(split, np.int64)}
    check("Split", [data(shape)] + [None] * len(constants), attrs, opset=opset, n_outputs=n, constants=constants)


def test_split_keeps_dtype() -> None:
    check("Split", [data((4, 6), "int64")], {"axis": 1}, opset=13, n_outputs=2)


# -- Gather ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,axis,indices", [
    ((5, 3, 4), 0, [[0, -1], [4, 2]]),
    ((5, 3, 4), 1, [2, -3, 1]),
    ((5, 3, 4), -1, [[3], [-4]]),
    ((5, 3, 4), 1, 2),  # scalar index: the axis goes away
    ((2, 6, 3, 3), 1, [5, 0, -2]),
    ((7,), 0, [[6, 0, -7]]),
])
@pytest.mark.parametrize("constant", [True, False])
@pytest.mark.parametrize("index_type", ["int64", "int32"])
def test_gather(shape, axis, indices, constant, index_type) -> None:  # type: ignore[no-untyped-def]
    idx = np.array(indices, index_type)
    if constant:
        check("Gather", [data(shape), None], {"axis": axis}, constants={1: idx})
    else:
        check("Gather", [data(shape), idx], {"axis": axis})


@pytest.mark.parametrize("dtype", ["int64", "bool"])
def test_gather_keeps_dtype(dtype: str) -> None:
    check("Gather", [data((4, 5), dtype), np.array([3, -1, 0])], {"axis": 1})


def test_gather_embedding_rows_copy_texels(modes) -> None:  # type: ignore[no-untyped-def]
    table = data((50, 12))
    check("Gather", [None, np.array([[3, 49, 0], [7, 7, -1]])], {"axis": 0}, constants={0: table})
    assert modes == ["texel"]


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(axis: int) -> None:
    x = data((3, 4, 5))
    dim = x.shape[axis]
    idx = RNG.integers(-dim, dim, (3, 2, 5) if axis != 1 else (2, 4, 5))
    check("GatherElements", [x, idx], {"axis": axis})


# -- Expand, Tile --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,target,dtype", [
    ((3, 1), (2, 3, 4), "float32"),
    ((1,), (5,), "int64"),
    ((2, 1, 4), (2, 3, 4), "bool"),
    ((2, 6, 1, 1), (2, 6, 3, 3), "float32"),
    ((4,), (1,), "float32"),  # the input's shape wins
])
def test_expand(shape, target, dtype) -> None:  # type: ignore[no-untyped-def]
    check("Expand", [data(shape, dtype), None], constants={1: np.array(target, np.int64)})


@pytest.mark.parametrize("shape,repeats,dtype", [
    ((2, 3), (2, 3), "float32"),
    ((2, 5, 3, 3), (1, 2, 1, 2), "int64"),
    ((3, 4), (3, 1), "bool"),
    ((3,), (0,), "float32"),
])
def test_tile(shape, repeats, dtype) -> None:  # type: ignore[no-untyped-def]
    check("Tile", [data(shape, dtype), None], constants={1: np.array(repeats, np.int64)})


# -- Pad ---------------------------------------------------------------------------------------------
PADS = [
    ((2, 6, 3, 5), [0, 0, 1, 2, 0, 0, 2, 1]),        # spatial NCHW
    ((2, 6, 3, 5), [0, 1, 0, 0, 0, 3, 0, 0]),        # channels
    ((2, 6, 3, 5), [0, 0, 7, -1, 0, 0, 5, 9]),       # wider than the axis; a crop
    ((4, 5), [2, 3, 1, 4]),
]


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("shape,pads", PADS)
def test_pad(shape, pads, mode) -> None:  # type: ignore[no-untyped-def]
    constants = {1: np.array(pads, np.int64), 2: np.array(1.5, np.float32)}
    check("Pad", [data(shape), None, None], {"mode": mode}, opset=19, constants=constants)


def test_pad_spatial_copies_texels(modes) -> None:  # type: ignore[no-untyped-def]
    check("Pad", [data((1, 8, 4, 4)), None], constants={1: np.array([0, 0, 1, 1, 0, 0, 1, 1])})
    assert modes == ["texel"]


def test_pad_axes_input() -> None:
    constants = {1: np.array([1, 2, 0, 3]), 3: np.array([0, -1])}
    check("Pad", [data((3, 4, 5)), None, None, None], {"mode": "reflect"}, opset=18, constants=constants)


@pytest.mark.parametrize("dtype,value", [("int64", 7), ("bool", True)])
def test_pad_keeps_dtype(dtype, value) -> None:  # type: ignore[no-untyped-def]
    constants = {1: np.array([1, 0, 2, 3]), 2: np.array(value, dtype)}
    check("Pad", [data((3, 4), dtype), None, None], constants=constants)


def test_pad_opset_2_attributes() -> None:
    check("Pad", [data((3, 4))], {"pads": [1, 0, 0, 2], "mode": "edge"}, opset=2)


# -- DepthToSpace, SpaceToDepth -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("blocksize,channels", [(2, 8), (3, 9)])
def test_depth_to_space(mode, blocksize, channels) -> None:  # type: ignore[no-untyped-def]
    check("DepthToSpace", [data((2, channels, 3, 2))], {"blocksize": blocksize, "mode": mode})


@pytest.mark.parametrize("blocksize", [2, 3])
def test_space_to_depth(blocksize: int) -> None:
    check("SpaceToDepth", [data((2, 3, 6, 6), "int64")], {"blocksize": blocksize})


# -- Cast ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source,target,draws", [
    ("int64", TensorProto.FLOAT, 0),
    ("bool", TensorProto.FLOAT, 0),
    ("int64", TensorProto.INT32, 0),
    ("float32", TensorProto.FLOAT, 0),
    ("float32", TensorProto.INT64, 1),
    ("float32", TensorProto.BOOL, 1),
    ("int64", TensorProto.BOOL, 1),
])
def test_cast(source, target, draws) -> None:  # type: ignore[no-untyped-def]
    x = data((3, 5), source)
    if source == "float32":
        x = (x * 10).round(1)
        x[0, :3] = [0.0, -2.7, 2.7]
    assert check("Cast", [x], {"to": target}, optimize=False) == draws


# -- edge cases --------------------------------------------------------------------------------------
def test_host_inputs_fed_at_run_time() -> None:
    """Shapes and slice bounds that are model inputs are read on the host each run."""
    check("Reshape", [data((2, 3, 4), "int64"), np.array([4, -1])])
    check("Slice", [data((5, 6)), np.array([1, 4]), np.array([4, 0]), np.array([0, 1]), np.array([1, -1])])


def test_pad_of_an_empty_tensor_is_all_fill() -> None:
    constants = {1: np.array([1, 0, 1, 0]), 2: np.array(3.0, np.float32)}
    check("Pad", [data((0, 3)), None, None], constants=constants)


@pytest.mark.parametrize("opset", [9, 13])
def test_dropout_with_a_mask_is_a_view_and_ones(opset: int) -> None:
    """The optimizer keeps Dropout when its mask is named; the mask is float before opset 10."""
    assert check("Dropout", [data((2, 5))], opset=opset, n_outputs=2) == 1


@pytest.mark.parametrize("op_type", ["Gather", "GatherElements"])
def test_out_of_range_indices_are_an_error_naming_the_index_and_the_worker_stays_usable(op_type) -> None:
    import asyncinfer as ai
    from pixel_testing import require_pixel

    require_pixel()
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    good = np.array([[0, -1], [2, 1], [1, 0]], np.int64)
    bad = good.copy()
    bad[1, 0] = 3 if op_type == "Gather" else 4  # one past the end of the gathered axis
    model = ai.load_model(one_node_model(op_type, [data, good], {"axis": 0 if op_type == "Gather" else 1}))
    with ai.Worker(model, "gpu_pixel") as worker:
        assert not worker.placement.fallback
        with pytest.raises(ai.ExecutionError, match=f"{op_type}.*index . is out of range"):
            worker.run_blocking({"i0": data, "i1": bad})
        got = worker.run_blocking({"i0": data, "i1": good})["o0"]
    expected = np.take(data, good, axis=0) if op_type == "Gather" else np.take_along_axis(data, good % 4, axis=1)
    np.testing.assert_array_equal(got, expected)
