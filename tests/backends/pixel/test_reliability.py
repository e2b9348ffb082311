"""gpu_pixel under hostile inputs (issue 14): constants at the edges of float32 and int32 baked
into shaders, texture allocations that fail, loops llvmpipe cuts short, GL threads that must end,
and ONNX's pre-opset-7 legacy broadcasting. Every case runs through the public API on small
models and is compared with the CPU backend (or with hand-computed values), checking in
``placement`` that the layer really ran on gpu_pixel. The CPU backend's own failures found on the
way are the xfail tests at the end.
"""
from __future__ import annotations

import gc
import math
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from pixel_testing import assert_close, one_node_model, require_pixel, run_both

INF, NAN = math.inf, math.nan
EXACT = dict(rtol=1e-6, atol=0.0)


@pytest.fixture(autouse=True)
def _pixel():
    require_pixel()


def edge_values(denormal: bool = True) -> np.ndarray:
    """Every kind of float32: the extremes, infinities, NaN, zeros, a denormal and ordinary values.
    Without the denormal where it meets arithmetic: GPUs may flush denormal operands to zero
    (GLSL allows it; llvmpipe does), the CPU does not."""
    return np.array([[-3e38, -1.0, -0.0, 0.0, 1e-45 if denormal else 0.25, 0.5, 1.0, 3.4028235e38,
                      INF, -INF, NAN, 2.0]], np.float32)


def f32(value: float) -> np.ndarray:
    """``value`` as a float32 scalar (1e39 becomes inf, as ONNX's float attributes do)."""
    with np.errstate(over="ignore"):
        return np.array(value, np.float32)


def feeds_of(inputs: list, constants: dict) -> dict[str, np.ndarray]:
    return {f"i{k}": x for k, x in enumerate(inputs) if x is not None and k not in constants}


# -- 1. constants baked into GLSL ------------------------------------------------------------------------
CLIP_BOUNDS = [(-3e38, 3e38), (-1e39, 1e39), (-INF, INF), (NAN, 1.0), (0.0, NAN), (INF, None), (None, -INF),
               (3.4028235e38, 3.4028235e38), (2.0, -2.0), (None, -3e38), (3e38, None), (-0.0, 0.0)]


@pytest.mark.parametrize("lo, hi", CLIP_BOUNDS, ids=[f"{lo}..{hi}" for lo, hi in CLIP_BOUNDS])
@pytest.mark.parametrize("as_inputs", [False, True], ids=["attributes", "inputs"])
def test_clip_with_extreme_bounds_and_nan_matches_the_cpu(lo, hi, as_inputs):
    """GLSL's min/max are undefined at NaN (llvmpipe returned the bound for a NaN x); the CPU op
    (np.maximum/np.minimum) propagates a NaN x or a NaN bound."""
    x = edge_values(denormal=False)
    if as_inputs:  # opset 13: bounds are constant inputs
        consts = {k: f32(v) for k, v in ((1, lo), (2, hi)) if v is not None}
        model = one_node_model("Clip", [x, None, None], opset=13, constants=consts)
    else:  # opset 6: bounds are attributes (None: absent)
        attrs = {k: float(v) for k, v in (("min", lo), ("max", hi)) if v is not None}
        model = one_node_model("Clip", [x], attrs, opset=6)
    got, expected, _ = run_both(model, {"i0": x})
    assert_close(got, expected, **EXACT)


SCALARS = [3e38, -3e38, 1e39, -1e39, NAN, INF, -INF, 3.4028235e38, 0.0, -0.0]


ATTRIBUTE_CASES = {  # op: (opset, attributes given the value)
    "LeakyRelu": (16, lambda v: {"alpha": v}), "Elu": (6, lambda v: {"alpha": v}),
    "HardSigmoid": (6, lambda v: {"alpha": v, "beta": v}), "Selu": (6, lambda v: {"alpha": v, "gamma": v}),
    "ThresholdedRelu": (10, lambda v: {"alpha": v}), "Shrink": (9, lambda v: {"lambd": v, "bias": v}),
    "Swish": (24, lambda v: {"alpha": v}),
}


# Swish's exp(-alpha·x) is exp2(x · (-alpha·log2 e)) on llvmpipe: a finite alpha near the float32
# limit overflows there (GLSL lets the compiler reassociate), so only its inf, NaN and zeros count.
CONSTANT_CASES = [(case, value) for case in ["Add", "Mul", "Pad", "Gemm-alpha", "Gemm-beta", *ATTRIBUTE_CASES]
                  for value in SCALARS if not (case == "Swish" and math.isfinite(value) and value != 0)]


@pytest.mark.parametrize("case, value", CONSTANT_CASES, ids=[f"{c}-{v}" for c, v in CONSTANT_CASES])
def test_huge_infinite_nan_and_zero_constants_match_the_cpu(case, value):
    """Attributes and fill values are baked into the shader; constant inputs become textures.
    Either way the results are the CPU's, inf and NaN inputs included. A literal ``0.0 * x`` was
    folded to 0 by the compiler (LeakyRelu alpha=0 turned NaN and -inf into 0), and GLSL's
    min/max/clamp dropped NaN."""
    x = edge_values(denormal=False)
    v32 = f32(value)
    consts: dict[int, np.ndarray] = {}
    attrs: dict = {}
    if case in ("Add", "Mul"):
        inputs, opset, consts = [x, v32], 17, {1: v32}
    elif case == "Pad":
        consts = {1: np.array([0, 2, 0, 1], np.int64), 2: v32}
        inputs, attrs, opset = [x, None, None], {"mode": "constant"}, 13
    elif case.startswith("Gemm"):  # alpha or beta (not both: GLSL may legally factor a·b + a·c)
        x = x.reshape(3, 4)
        consts = {1: np.eye(4, dtype=np.float32), 2: np.ones((3, 4), np.float32)}
        attrs = {"alpha": value, "beta": 1.0} if case == "Gemm-alpha" else {"alpha": 1.0, "beta": value}
        inputs, opset, case = [x, None, None], 13, "Gemm"
    else:
        opset, make = ATTRIBUTE_CASES[case]
        inputs, attrs = [x], make(value)
    got, expected, _ = run_both(one_node_model(case, inputs, attrs, opset=opset, constants=consts),
                                feeds_of(inputs, consts))
    assert_close(got, expected, **EXACT)


@pytest.mark.parametrize("value", [1e-45, -1e-40, 1.1754942e-38], ids=str)
def test_denormal_constants_are_written_exactly(value):
    """A denormal literal keeps its value where it is only moved (Pad's fill). Arithmetic, min
    and max included, flushes denormal operands to zero on llvmpipe (GLSL allows it): not tested."""
    x = np.array([[1.0, -2.0, 0.0]], np.float32)
    pad = one_node_model("Pad", [x, None, None], {"mode": "constant"}, opset=13,
                         constants={1: np.array([0, 1, 0, 2], np.int64), 2: np.array(value, np.float32)})
    got, expected, _ = run_both(pad, {"i0": x})
    np.testing.assert_array_equal(got["o0"], expected["o0"])


BIG_INTS = [2**31, 2**40, 2**63 - 1, -2**63]


@pytest.mark.parametrize("step", BIG_INTS, ids=str)
def test_slice_steps_beyond_int32_compile(step):
    """A step that leaves one element was written into the shader as an int literal GLSL refuses
    (``literal value `1099511627776' out of range``)."""
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    start = 1 if step > 0 else -2
    consts = {1: np.array([start], np.int64), 2: np.array([2**63 - 1 if step > 0 else -2**63], np.int64),
              3: np.array([2], np.int64), 4: np.array([step], np.int64)}
    got, expected, _ = run_both(one_node_model("Slice", [x, None, None, None, None], opset=13, constants=consts),
                                {"i0": x})
    assert_close(got, expected, **EXACT)


@pytest.mark.parametrize("op_type", ["MaxPool", "AveragePool", "Conv"])
def test_window_strides_and_dilations_beyond_int32_compile(op_type):
    """Strides (and dilations of a 1-tap kernel) that leave one output position still compiled
    into the shader's index arithmetic."""
    x = np.arange(2 * 3 * 5 * 6, dtype=np.float32).reshape(2, 3, 5, 6)
    attrs: dict = {"strides": [2**31, 2**40]}
    consts = {}
    if op_type == "Conv":  # 1×1: the CPU Conv's polyphase split fails for taps past (0, 0) here
        consts = {1: np.arange(4 * 3, dtype=np.float32).reshape(4, 3, 1, 1)}
        inputs = [x, None]
    else:
        attrs |= {"kernel_shape": [1, 2], "dilations": [2**40, 1]}
        inputs = [x]
    got, expected, _ = run_both(one_node_model(op_type, inputs, attrs, opset=19 if op_type != "Conv" else 11,
                                               constants=consts), {"i0": x})
    assert expected["o0"].shape[2:] == (1, 1)
    assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _pad_model_with_a_fill_input() -> onnx.ModelProto:
    """Pad of an int64 tensor whose constant value is a model input (read on the host)."""
    pads = onnx.numpy_helper.from_array(np.array([0, 1, 0, 1], np.int64), "pads")
    node = helper.make_node("Pad", ["x", "pads", "value"], ["y"], name="pad", mode="constant")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.INT64, [1, 3]),
                                            helper.make_tensor_value_info("value", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [1, 5])], [pads])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_an_integer_pad_value_a_float_texel_cannot_hold_is_an_error_not_a_rounding():
    """Integers live in float32 texels: 2^31 + 1 came back as 2^31 (silently). Now the layer
    fails naming itself, and the worker stays usable."""
    model = ai.load_model(_pad_model_with_a_fill_input())
    x = np.array([[1, 2, 3]], np.int64)
    with ai.Worker(model, "gpu_pixel") as worker:
        assert worker.placement.layers == {"pad": "gpu_pixel"}
        for value in (2**31 + 1, 2**24 + 1, -(2**40) - 1):
            with pytest.raises(ai.ExecutionError, match="pad.*float32") as info:
                worker.run_blocking(x, np.array(value, np.int64))
            assert info.value.layer == "pad"
        for value in (7, -(2**24), 2**40):  # exact in float32: written as is
            got = worker.run_blocking(x, np.array(value, np.int64))["y"]
            np.testing.assert_array_equal(got, [[value, 1, 2, 3, value]])


def lrn_reference(x: np.ndarray, size: int, alpha: float, beta: float, bias: float) -> np.ndarray:
    """ONNX LRN by its definition (channels outside the tensor count as absent)."""
    c = x.shape[1]
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    square_sum = np.zeros_like(x, dtype=np.float64)
    for ch in range(c):
        square_sum[:, ch] = (x[:, max(0, ch - lo):min(c, ch + hi + 1)].astype(np.float64) ** 2).sum(axis=1)
    return (x / (bias + alpha / size * square_sum) ** beta).astype(np.float32)


@pytest.mark.parametrize("size", [9, 2**31 - 1])
def test_lrn_sizes_past_the_channel_count_are_not_unrolled(size):
    """LRN's window was unrolled ``size`` terms per lane into the GLSL: a size of 2^31 - 1 built
    strings until memory ran out. Only the channels that exist are summed."""
    x = np.random.default_rng(0).standard_normal((1, 6, 3, 3)).astype(np.float32)
    model = ai.load_model(one_node_model("LRN", [x], {"size": size, "alpha": 0.5, "bias": 2.0}, opset=13))
    with ai.Worker(model, "gpu_pixel") as worker:
        assert not worker.placement.fallback
        got = worker.run_blocking(x)["o0"]
    np.testing.assert_allclose(got, lrn_reference(x, size, 0.5, 0.75, 2.0), rtol=1e-5, atol=1e-6)


# -- 2. allocations that fail ----------------------------------------------------------------------------
def _expand_model() -> onnx.ModelProto:
    """``y = ReduceSum(Expand(x, shape))`` with the shape a model input (CPU-bound: read on the host)."""
    nodes = [helper.make_node("Expand", ["x", "shape"], ["e"], name="expand"),
             helper.make_node("Relu", ["e"], ["r"], name="relu"),
             helper.make_node("ReduceSum", ["r"], ["y"], name="sum", keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1]),
                                           helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_tensor_beyond_the_real_max_texture_size_fails_its_run_and_the_next_run_succeeds():
    model = ai.load_model(_expand_model())
    x = np.ones((1, 1), np.float32)
    with ai.Worker(model, "gpu_pixel") as worker:
        assert set(worker.placement.layers.values()) == {"gpu_pixel"}
        side = worker._backend.gpu.max_texture_size
        # A (N, 1) tensor takes a texel per value: one more than the largest texture holds.
        # Nothing is allocated: the size is checked before.
        with pytest.raises(ai.ExecutionError, match="layer 'expand'.*more than the largest texture") as info:
            worker.run_blocking(x, np.array([side * side + 1, 1], np.int64))
        assert info.value.layer == "expand"
        assert worker.run_blocking(x, np.array([3, 5], np.int64))["y"] == 15.0


def test_a_failed_texture_allocation_fails_its_run_and_leaves_the_context_usable(monkeypatch):
    """A texture GL refuses (GL_OUT_OF_MEMORY; here GL_INVALID_VALUE, a width past the limit, is
    provoked for real) comes back from moderngl as an object and an error flag. It failed the
    layer with "framebuffer is not complete", and the flag then failed the next run's first,
    unrelated step ("upload x ... GL_OUT_OF_MEMORY")."""
    import moderngl

    model = ai.load_model(_expand_model())
    x = np.ones((1, 1), np.float32)
    real_texture = moderngl.Context.texture
    doomed = (777, 1)  # the size of Expand's (777, 1) output: a texel per value, one row

    def texture(ctx, size, *args, **kwargs):
        if tuple(size) == doomed:  # a width GL must refuse: a real GL error, as an OOM leaves it
            size = (int(ctx.info["GL_MAX_TEXTURE_SIZE"]) + 1, 1)
        return real_texture(ctx, size, *args, **kwargs)

    with ai.Worker(model, "gpu_pixel") as worker:
        monkeypatch.setattr(moderngl.Context, "texture", texture)
        with pytest.raises(ai.ExecutionError, match="layer 'expand'.*could not allocate a 777×1") as info:
            worker.run_blocking(x, np.array([777, 1], np.int64))
        assert info.value.layer == "expand"
        assert worker.run_blocking(x, np.array([3, 5], np.int64))["y"] == 15.0  # no stale GL error
        assert worker.run_blocking(x, np.array([2, 2], np.int64))["y"] == 4.0
        monkeypatch.undo()
        assert worker.run_blocking(x, np.array([777, 1], np.int64))["y"] == 777.0


LONG_GROUPS = [("ReduceSum", (1, 262144), [1]), ("ReduceMean", (1, 3, 512, 512), [2, 3]),
               ("ReduceSum", (65536, 1), [0]), ("Softmax", (1, 140000), None)]


@pytest.mark.parametrize("op_type, shape, axes", LONG_GROUPS)
def test_a_group_too_long_for_one_fragment_is_an_error_on_llvmpipe_not_a_wrong_value(op_type, shape, axes):
    """llvmpipe leaves a fragment's loops after 65535 iterations in all, silently: ReduceMean over
    a 512×512 map gave 0.25 instead of 1, Softmax over 140000 values 0.5 each. There it is now an
    error naming the layer; elsewhere the value is right."""
    x = np.ones(shape, np.float32)
    if op_type == "Softmax":
        model = one_node_model(op_type, [x], {"axis": -1}, opset=13)
        expected = np.full(shape, 1 / shape[-1], np.float32)
    else:
        model = one_node_model(op_type, [x, None], {"keepdims": 0}, opset=18, constants={1: np.array(axes, np.int64)})
        expected = np.full([d for a, d in enumerate(shape) if a not in axes], 1.0 if op_type == "ReduceMean"
                           else math.prod(shape[a] for a in axes), np.float32)
    with ai.Worker(ai.load_model(model), "gpu_pixel") as worker:
        assert not worker.placement.fallback
        if "llvmpipe" in worker._backend.gpu.renderer:
            with pytest.raises(ai.ExecutionError, match="loop iterations in one fragment.*runs at most 65535"):
                worker.run_blocking(x)
        else:
            np.testing.assert_allclose(worker.run_blocking(x)["o0"], expected, rtol=1e-5)


def test_groups_at_llvmpipes_loop_limit_still_run():
    """The longest groups that fit (65535 iterations) are computed, and right."""
    for shape, axes in [((1, 262140), [1]), ((65535, 1), [0]), ((1, 1, 255, 257), [2, 3])]:
        x = np.ones(shape, np.float32)
        model = one_node_model("ReduceSum", [x, None], {"keepdims": 0}, opset=18,
                               constants={1: np.array(axes, np.int64)})
        got, expected, _ = run_both(model, {"i0": x})
        assert_close(got, expected, rtol=0, atol=0)


# -- 3. GL threads end ------------------------------------------------------------------------------------
def _relu_model() -> ai.Model:
    return ai.load_model(one_node_model("Relu", [np.ones((2, 3), np.float32)]))


def test_dispose_ends_every_thread_the_worker_started():
    model, x = _relu_model(), -np.ones((2, 3), np.float32)
    before = set(threading.enumerate())
    worker = ai.Worker(model, "gpu_pixel")
    gl = worker._backend.gpu.gl.thread
    assert gl in threading.enumerate()
    worker.schedule(x)
    worker.peek_output().readback_request()  # a download in flight when disposing
    worker.dispose()
    assert not gl.is_alive()
    assert set(threading.enumerate()) - before == set()


def test_fifty_workers_created_and_disposed_leave_no_thread_behind():
    model, x = _relu_model(), np.ones((2, 3), np.float32)
    before = set(threading.enumerate())
    for _ in range(50):
        with ai.Worker(model, "gpu_pixel") as worker:
            worker.run_blocking(x)
    assert set(threading.enumerate()) - before == set()


def test_a_worker_dropped_without_dispose_ends_its_gl_thread():
    """A forgotten worker must not keep a GL context and its thread for the life of the process."""
    model, x = _relu_model(), np.ones((2, 3), np.float32)
    worker = ai.Worker(model, "gpu_pixel")
    gl = worker._backend.gpu.gl.thread
    worker.run_blocking(x)
    del worker
    gc.collect()
    gl.join(timeout=30)  # a bound, not a timing: the thread ends once its queue is drained
    assert not gl.is_alive()


# -- 4. opset < 7 legacy broadcasting --------------------------------------------------------------------
LEGACY = [((3,), 1), ((3, 4), 1), ((2,), 0), ((4, 3), 2), ((3,), 3), ((3,), None), ((), None)]
LEGACY_OPS = {"Add": (6, np.add), "Sub": (6, np.subtract), "Mul": (6, np.multiply), "Div": (6, np.divide),
              "Pow": (1, np.power), "Greater": (1, np.greater), "Less": (1, np.less), "And": (1, np.logical_and),
              "Or": (1, np.logical_or), "Xor": (1, np.logical_xor)}


@pytest.mark.parametrize("b_shape, axis", LEGACY, ids=[f"{s}@{a}" for s, a in LEGACY])
@pytest.mark.parametrize("op_type", list(LEGACY_OPS))
def test_legacy_broadcast_with_axis_matches_hand_computed_values(op_type, b_shape, axis):
    """Before opset 7, ``broadcast=1`` aligns B with A from ``axis`` on (suffix when no axis):
    B (3,) at axis 1 of A (2, 3, 4, 3) is read as (3, 1, 1). gpu_pixel broadcast NumPy-style
    (from the right): silently wrong, or a shape error."""
    opset, fn = LEGACY_OPS[op_type]
    rng = np.random.default_rng(1)
    a = rng.uniform(0.5, 2.0, (2, 3, 4, 3)).astype(np.float32)
    b = rng.uniform(0.5, 2.0, b_shape).astype(np.float32)
    if op_type in ("And", "Or", "Xor"):
        a, b = a > 1.2, b > 1.2
    attrs = {"broadcast": 1} | ({} if axis is None else {"axis": axis})
    start = a.ndim - len(b_shape) if axis is None else axis
    expected = fn(a, b.reshape(b_shape + (1,) * (a.ndim - start - len(b_shape))))
    model = one_node_model(op_type, [a, b], attrs, opset=opset)
    got, cpu, _ = run_both(model, {"i0": a, "i1": b})  # checks that it ran on gpu_pixel
    for result in (got["o0"], cpu["o0"]):
        assert result.shape == expected.shape and result.dtype == expected.dtype
        np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)


# -- the CPU backend's failures found here (reported; the CPU ops are not this backend's) -------------------
def test_cpu_lrn_with_a_size_past_the_channel_count():
    x = np.random.default_rng(0).standard_normal((1, 6, 3, 3)).astype(np.float32)
    model = ai.load_model(one_node_model("LRN", [x], {"size": 15, "alpha": 0.5, "bias": 2.0}, opset=13))
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)["o0"]
    np.testing.assert_allclose(got, lrn_reference(x, 15, 0.5, 0.75, 2.0), rtol=1e-5, atol=1e-6)


def test_cpu_conv_with_strides_beyond_int32_and_a_kernel_wider_than_one():
    x = np.arange(2 * 3 * 5 * 6, dtype=np.float32).reshape(2, 3, 5, 6)
    w = np.ones((4, 3, 1, 2), np.float32)
    model = ai.load_model(one_node_model("Conv", [x, None], {"strides": [2**31, 2**40]}, opset=11, constants={1: w}))
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)["o0"]
    np.testing.assert_allclose(got, (x[:, :, :1, :2] * 1).sum(axis=(1, 2, 3)).reshape(2, 1, 1, 1).repeat(4, 1))


def test_a_constant_the_device_cannot_hold_sends_its_layer_to_the_cpu_at_plan_time(monkeypatch):
    require_pixel()
    from asyncinfer.backends.pixel.backend import PixelBackend

    def refuse(self, kernel, index, array):
        raise ValueError("this constant does not fit a texture")  # as an upload the device cannot make

    monkeypatch.setattr(PixelBackend, "prepare_constant", refuse)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    w = np.full((2, 3), 0.5, np.float32)
    model = ai.load_model(one_node_model("Add", [x, None], constants={1: w}), optimize=False)
    with ai.Worker(model, "gpu_pixel") as worker:  # built, not a raw ValueError
        assert worker.placement.fallback == [model.layers[0].name]
        np.testing.assert_array_equal(worker.run_blocking(x)["o0"], x + w)
