"""The gpu_pixel backend's machinery: placement and transfers, every readback mode (asyncio and
trio), fenced downloads that never block the loop, texture and program reuse, and errors.

Kernel numerics are tested per family in the other files here; whole models in test_models.py.
"""
from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import asyncinfer as ai
from conftest import LoopTicker, make_model, shape_arithmetic_model, tensor_info
from pixel_testing import require_pixel

RTOL, ATOL = 1e-5, 1e-6  # element-wise float32 math on llvmpipe vs NumPy


@pytest.fixture(autouse=True)
def _pixel():
    require_pixel()


def elementwise_model() -> onnx.ModelProto:
    """x -> Add(bias) -> Relu -> Mul(x) -> Sigmoid -> Sub -> y: every layer has a shader."""
    bias = numpy_helper.from_array(np.array([1, -2, 3], np.float32).reshape(3, 1, 1), "bias")
    nodes = [helper.make_node("Add", ["x", "bias"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "x"], ["m"], name="mul"),
             helper.make_node("Sigmoid", ["m"], ["s"], name="sigmoid"),
             helper.make_node("Sub", ["s", "a"], ["y"], name="sub")]
    return make_model(nodes, [tensor_info("x", [2, 3, 4, 5])], [tensor_info("y", [2, 3, 4, 5])], [bias],
                      extra_domains=())


def fallback_model() -> onnx.ModelProto:
    """Relu -> CumSum (no shader: CPU) -> Sigmoid: the CPU layer costs a download and an upload."""
    axis = numpy_helper.from_array(np.array(1, np.int64), "axis")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("CumSum", ["r", "axis"], ["c"], name="cumsum"),
             helper.make_node("Sigmoid", ["c"], ["y"], name="sigmoid")]
    return make_model(nodes, [tensor_info("x", [3, 10])], [tensor_info("y", [3, 10])], [axis], extra_domains=())


def cpu_reference(model: ai.Model, *inputs) -> dict[str, np.ndarray]:
    with ai.Worker(model, "cpu", threads=1) as worker:
        return worker.run_blocking(*inputs)


@pytest.fixture(scope="module")
def elementwise():
    return ai.load_model(elementwise_model())


@pytest.fixture
def x(rng):
    return rng.standard_normal((2, 3, 4, 5)).astype(np.float32)


# -- placement --------------------------------------------------------------------------------------
def test_a_model_with_shaders_for_every_layer_runs_wholly_on_the_pixel_backend(elementwise, x):
    with ai.Worker(elementwise, "gpu_pixel") as worker:
        placement = worker.placement
        assert set(placement.layers.values()) == {"gpu_pixel"} and not placement.fallback
        assert placement.transfer_steps == ["upload x to gpu_pixel"] and placement.transfers == 1
        assert placement.uploaded_constants == 1  # the bias, once, when the worker was made
        got = worker.run_blocking(x)
    np.testing.assert_allclose(got["y"], cpu_reference(elementwise, x)["y"], rtol=RTOL, atol=ATOL)


def test_layers_without_a_shader_fall_back_with_explicit_transfers(rng):
    model = ai.load_model(fallback_model())
    x = rng.standard_normal((3, 10)).astype(np.float32)
    with ai.Worker(model, "gpu_pixel") as worker:
        placement = worker.placement
        assert placement.layers == {"relu": "gpu_pixel", "cumsum": "cpu", "sigmoid": "gpu_pixel"}
        assert placement.fallback == ["cumsum"]
        assert placement.transfer_steps == ["upload x to gpu_pixel", "download r to cpu", "upload c to gpu_pixel"]
        assert "transfers=3" in repr(placement)
        got = worker.run_blocking(x)
    np.testing.assert_allclose(got["y"], cpu_reference(model, x)["y"], rtol=RTOL, atol=ATOL)


def test_cpu_bound_shape_arithmetic_stays_on_the_cpu_and_shape_needs_no_download(rng):
    # Reshape(r, Concat(Shape(r)[0:1], [-1])): Shape reads the texture's shape, not its values.
    proto = shape_arithmetic_model()
    model = ai.load_model(proto)
    x = rng.standard_normal((4, 2, 3)).astype(np.float32)
    with ai.Worker(model, "gpu_pixel") as worker:
        layers = worker.placement.layers
        assert layers["shape"] == layers["slice"] == layers["concat"] == "cpu"
        assert layers["relu"] == "gpu_pixel"
        assert not any(name.startswith("download") for name in worker.placement.transfer_steps)
        got = worker.run_blocking(x)
    np.testing.assert_array_equal(got["y"], np.maximum(x, 0).reshape(4, 6))


# -- readback modes ---------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_await_readback_and_run(elementwise, x):
    expected = cpu_reference(elementwise, x)["y"]
    async with ai.Worker(elementwise, "gpu_pixel") as worker:
        worker.schedule(x)
        y = worker.peek_output()
        assert y.backend == "gpu_pixel"
        clone = await y.readback_and_clone_async()
        assert clone.backend == "cpu"
        np.testing.assert_allclose(clone.numpy(), expected, rtol=RTOL, atol=ATOL)
        outputs = await worker.run(x)
        np.testing.assert_allclose(outputs["y"], expected, rtol=RTOL, atol=ATOL)


@pytest.mark.anyio
async def test_polling_and_callback_readback(elementwise, x):
    import anyio

    expected = cpu_reference(elementwise, x)["y"]
    async with ai.Worker(elementwise, "gpu_pixel") as worker:
        worker.schedule(x)
        y = worker.take_output()
        delivered: list[tuple[bool, int]] = []
        done = anyio.Event()

        def on_done(ok: bool) -> None:
            delivered.append((ok, threading.get_ident()))
            done.set()

        y.readback_request(on_done)
        polls = 0
        while not y.is_readback_request_done():  # each poll returns at once
            polls += 1
            await anyio.sleep(0.001)
        await done.wait()
        assert delivered == [(True, threading.get_ident())]  # on the loop's thread
        np.testing.assert_allclose(y.readback_and_clone().numpy(), expected, rtol=RTOL, atol=ATOL)


def test_blocking_twins_and_data_on_backend(elementwise, x):
    expected = cpu_reference(elementwise, x)["y"]
    with ai.Worker(elementwise, "gpu_pixel") as worker:
        worker.schedule(x)
        y = worker.peek_output()
        np.testing.assert_allclose(y.readback_and_clone().numpy(), expected, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(y.download_to_array(), expected, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(y), expected, rtol=RTOL, atol=ATOL)
        storage = y.data_on_backend
        assert storage.backend == "gpu_pixel" and storage.shape == (2, 3, 4, 5) and storage.dtype == np.float32
        np.testing.assert_allclose(storage.download(), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.anyio
async def test_the_loop_runs_while_the_gl_thread_is_busy(elementwise, x):
    """By construction, not timing: the GL thread is held on an event while the loop keeps
    ticking, polling says not done, and the await completes once the GL thread is let go."""
    import anyio

    async with ai.Worker(elementwise, "gpu_pixel") as worker:
        hold = threading.Event()
        worker._backend.gpu.gl.submit(hold.wait)  # everything queued after this waits on the GL thread
        worker.schedule(x)
        y = worker.peek_output()
        ticker = LoopTicker()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            while ticker.ticks < 50:
                assert not y.is_readback_request_done()
                await anyio.sleep(0)
            hold.set()
            clone = await y.readback_and_clone_async()
            tg.cancel_scope.cancel()
    assert ticker.ticks >= 50
    np.testing.assert_allclose(clone.numpy(), cpu_reference(elementwise, x)["y"], rtol=RTOL, atol=ATOL)


def test_callback_outside_a_loop_runs_on_the_gl_thread_and_may_not_block_there(elementwise, x):
    with ai.Worker(elementwise, "gpu_pixel") as worker:
        worker.schedule(x)
        y = worker.peek_output()
        seen: dict = {}
        finished = threading.Event()

        def on_done(ok: bool) -> None:
            seen["thread"] = threading.current_thread().name
            try:
                y.data_on_backend.download()  # a blocking download here would deadlock: refused
            except ai.AsyncInferError as exc:
                seen["error"] = str(exc)
            seen["value"] = y.download_to_array()  # the readback is done: no waiting involved
            finished.set()

        y.readback_request(on_done)
        assert finished.wait(30)
    assert seen["thread"] == "asyncinfer-gl"
    assert "blocking download was called on the GL thread" in seen["error"]
    assert seen["value"].shape == (2, 3, 4, 5)


def test_chaining_a_pending_pixel_output_into_a_cpu_worker(elementwise, x):
    with ai.Worker(elementwise, "gpu_pixel") as pixel, ai.Worker(elementwise, "cpu") as cpu:
        pixel.schedule(x)
        first = pixel.peek_output()
        second = cpu.run_blocking(first)["y"]
    expected_first = cpu_reference(elementwise, x)["y"]
    np.testing.assert_allclose(second, cpu_reference(elementwise, expected_first)["y"], rtol=1e-4, atol=1e-5)


def test_taken_outputs_survive_dispose(elementwise, x):
    worker = ai.Worker(elementwise, "gpu_pixel")
    worker.schedule(x)
    y = worker.take_output()
    worker.dispose()  # closes the GL context: the taken output was downloaded first
    np.testing.assert_allclose(y.numpy(), cpu_reference(elementwise, x)["y"], rtol=RTOL, atol=ATOL)


# -- reuse ------------------------------------------------------------------------------------------------
def test_textures_and_programs_are_reused_across_runs(elementwise, x):
    with ai.Worker(elementwise, "gpu_pixel") as worker:
        gpu = worker._backend.gpu
        worker.run_blocking(x)
        compiled, allocated, reused = gpu.programs.compiled, gpu.pool.allocated, gpu.pool.reused
        for _ in range(3):
            worker.run_blocking(x)
        assert gpu.programs.compiled == compiled  # cached by op and shape class
        assert gpu.pool.allocated == allocated  # every texture of later runs came from the pool
        assert gpu.pool.reused >= reused + 3 * 5


# -- errors -----------------------------------------------------------------------------------------------
def test_a_tensor_larger_than_the_largest_texture_is_a_clear_error(elementwise, x):
    with ai.Worker(elementwise, "gpu_pixel") as worker:
        gpu = worker._backend.gpu
        real, gpu.max_texture_size = gpu.max_texture_size, 4  # pretend the GL has tiny textures
        try:
            with pytest.raises(ai.ExecutionError, match="upload x to gpu_pixel.*more than the largest texture"):
                worker.run_blocking(x)
        finally:
            gpu.max_texture_size = real
        assert worker.run_blocking(x)["y"].shape == x.shape  # the worker stays usable


def test_gl_errors_become_execution_errors_naming_the_layer(elementwise, x, monkeypatch):
    import ctypes

    from asyncinfer.backends.pixel.kernels.elementwise import Binary

    egl = ctypes.CDLL("libEGL.so.1")
    egl.eglGetProcAddress.restype = ctypes.c_void_p
    gl_enable = ctypes.CFUNCTYPE(None, ctypes.c_uint)(egl.eglGetProcAddress(b"glEnable"))
    real_run = Binary.run

    def run_with_a_gl_error(self, device, inputs, post):
        gl_enable(0xFFFF)  # not a capability: GL records GL_INVALID_ENUM
        return real_run(self, device, inputs, post)

    with ai.Worker(elementwise, "gpu_pixel") as worker:
        monkeypatch.setattr(Binary, "run", run_with_a_gl_error)
        with pytest.raises(ai.ExecutionError, match="layer 'add' \\(Add\\) failed.*GL_INVALID_ENUM") as info:
            worker.run_blocking(x)
        assert info.value.layer == "add"
        monkeypatch.undo()
        assert worker.run_blocking(x)["y"].shape == x.shape


def test_integers_beyond_float_precision_are_refused_on_upload():
    from asyncinfer.backends.pixel.device import PixelDevice

    device = PixelDevice()
    try:
        with pytest.raises(ValueError, match="beyond ±2\\^24"):
            device.gl.call(lambda: device.upload(np.array([1 << 25], np.int64)))
        exact = device.gl.call(lambda: device.upload(np.array([-(1 << 24) + 1, 7], np.int64)))
        np.testing.assert_array_equal(device.start_download(exact).result(30), [-(1 << 24) + 1, 7])
    finally:
        device.close()


def test_disposed_worker_refuses_and_its_gl_thread_is_gone(elementwise, x):
    worker = ai.Worker(elementwise, "gpu_pixel")
    thread = worker._backend.gpu.gl.thread
    worker.run_blocking(x)
    worker.dispose()
    assert not thread.is_alive()
    with pytest.raises(ai.DisposedError):
        worker.schedule(x)


def test_a_worker_takes_a_backend_instance_and_owns_it(elementwise, x):
    from asyncinfer.backends.pixel import PixelBackend

    backend = PixelBackend()
    with ai.Worker(elementwise, backend) as worker:
        assert worker.backend_type is ai.BackendType.GPU_PIXEL and worker._backend is backend
        got = worker.run_blocking(x)
    assert not backend.gpu.gl.thread.is_alive()  # closed with the worker
    np.testing.assert_allclose(got["y"], cpu_reference(elementwise, x)["y"], rtol=RTOL, atol=ATOL)


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc (Linux) to read RSS")
def test_creating_and_disposing_workers_returns_their_memory():
    """Each gpu_pixel worker has its own GL thread; EGL's per-thread state must go with it (it was
    ~4 MiB a worker, 7 GiB over the conformance run)."""
    model = ai.load_model(elementwise_model())
    x = np.ones((2, 3, 4, 5), np.float32)

    def cycle() -> None:
        with ai.Worker(model, "gpu_pixel") as worker:
            worker.run_blocking(x)

    for _ in range(5):  # warm: caches, the allocator, Mesa's shader compiler
        cycle()
    before = _resident_mib()
    for _ in range(40):
        cycle()
    assert _resident_mib() - before < 40, "RSS grows with every gpu_pixel worker created and disposed"
