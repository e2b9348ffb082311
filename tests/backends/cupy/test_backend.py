"""The gpu_compute backend: dispatcher thread, transfers, CPU fallback, readback, lifecycle.

Without CUDA (CI), workers built for ``"gpu_compute"`` raise BackendUnavailableError saying what
is missing; that is tested first. The backend's machinery is then tested on the NumPy runtime
(:class:`HostRuntime`: the same interface as the CUDA runtime, on host memory, with events a test
can hold), by building workers whose ``gpu_compute`` backend is a ``CuPyBackend(HostRuntime())``:
the real Worker, Plan and Execution run, with uploads, device kernels, CPU fallback, downloads
and every readback mode. Tests at the end need a CUDA device and skip without one.

Numerical tolerance against the CPU backend: rtol 1e-4, atol 1e-5 (float32), except whole
convolutional models (rtol 1e-3, atol 1e-5: long chains of GEMMs summed in another order).
"""
from __future__ import annotations

import gc
import sys
import threading
import types
import weakref

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
import asyncinfer.runtime.worker as worker_module
from asyncinfer import ops
from asyncinfer.backends import BackendType, parse_backend_type
from asyncinfer.backends.cupy import CuPyBackend, DeviceTensorData, HostRuntime
from asyncinfer.backends.cupy.device import cuda_unavailable_reason
from asyncinfer.runtime.plan import value_types
from conftest import TEST_DOMAIN, LoopTicker, make_model, tensor_info
from model_zoo import light_params, light_path

NO_CUDA = "no CUDA device (CuPy not installed or no GPU)"
needs_cuda = pytest.mark.skipif(cuda_unavailable_reason() is not None, reason=NO_CUDA)
TOL = dict(rtol=1e-4, atol=1e-5)


# -- no CUDA: the error says what is missing -----------------------------------------------------------
@pytest.mark.skipif(cuda_unavailable_reason() is None, reason="CUDA is available here: the backend builds")
def test_without_cuda_building_a_worker_says_what_is_missing(digits_model):
    with pytest.raises(ai.BackendUnavailableError) as info:
        ai.Worker(digits_model, "gpu_compute")
    message = str(info.value)
    assert message == cuda_unavailable_reason()
    assert "gpu_compute needs CuPy and a CUDA device" in message
    assert "pip install 'asyncinfer[gpu]'" in message or "CUDA device" in message


def test_missing_cupy_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    reason = cuda_unavailable_reason()
    assert reason == "gpu_compute needs CuPy and a CUDA device: CuPy is not installed (pip install 'asyncinfer[gpu]')"
    with pytest.raises(ai.BackendUnavailableError, match=r"CuPy is not installed \(pip install 'asyncinfer\[gpu\]'\)"):
        ai.Worker(ai.load_model(_add_model()), "gpu_compute")


def test_driver_error_text_is_reported(monkeypatch):
    class CUDARuntimeError(RuntimeError):
        pass

    def no_device() -> int:
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_device))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(ai.BackendUnavailableError,
                       match="no usable CUDA device .*cudaErrorNoDevice: no CUDA-capable device is detected"):
        ai.Worker(ai.load_model(_add_model()), "gpu_compute")
    fake.cuda.runtime.getDeviceCount = lambda: 0
    with pytest.raises(ai.BackendUnavailableError, match="no CUDA device is visible"):
        ai.Worker(ai.load_model(_add_model()), "gpu_compute")


def test_a_failing_device_start_is_backend_unavailable():
    class Broken(HostRuntime):
        def start(self):
            raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    with pytest.raises(ai.BackendUnavailableError, match="could not start.*InsufficientDriver"):
        CuPyBackend(Broken())


# -- the backend on the NumPy runtime -------------------------------------------------------------
@pytest.fixture
def runtimes(monkeypatch):
    """Workers built for "gpu_compute" get a CuPyBackend on a fresh HostRuntime (listed here)."""
    made: list[HostRuntime] = []
    real = worker_module.create_backend

    def create(kind, *, threads=None):
        if parse_backend_type(kind) is BackendType.GPU_COMPUTE:
            made.append(HostRuntime())
            return CuPyBackend(made[-1])
        return real(kind, threads=threads)

    monkeypatch.setattr(worker_module, "create_backend", create)
    return made


def _add_model():
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    return make_model([helper.make_node("Add", ["x", "one"], ["y"], name="add")],
                      [tensor_info("x", [2, 3])], [tensor_info("y", [2, 3])], [one])


def _const(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _cnn_model(rng):
    """Conv+Relu → MaxPool → Conv → Add(skip) → Relu → GlobalAveragePool → Flatten → Gemm → Softmax."""
    inits = [_const("w1", rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3),
             _const("b1", rng.standard_normal(4).astype(np.float32)),
             _const("w2", rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.3),
             _const("wf", rng.standard_normal((5, 4)).astype(np.float32)),
             _const("bf", rng.standard_normal(5).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
             helper.make_node("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Add", ["c2", "p1"], ["s"], name="skip"),
             helper.make_node("Relu", ["s"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], transB=1, name="fc"),
             helper.make_node("Softmax", ["logits"], ["y"], axis=1, name="softmax")]
    return make_model(nodes, [tensor_info("x", ["N", 3, 8, 8])], [tensor_info("y", ["N", 5])], inits, opset=13)


@pytest.fixture
def cnn(rng):
    return ai.load_model(_cnn_model(rng))


def _cpu_outputs(model, *inputs):
    with ai.Worker(model, "cpu") as worker:
        return worker.run_blocking(*inputs)


def test_whole_model_on_the_device_with_one_upload(runtimes, cnn, rng):
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    with ai.Worker(cnn, "gpu_compute") as worker:
        placement = worker.placement
        assert set(placement.layers.values()) == {"gpu_compute"} and placement.fallback == []
        assert placement.transfer_steps == ["upload x to gpu_compute"]  # outputs are read back, not steps
        assert placement.uploaded_constants == 5
        runtime = runtimes[0]
        assert runtime.uploads == 5, "constants are uploaded once, when the worker is built"
        got = worker.run_blocking(x)
        np.testing.assert_allclose(got["y"], _cpu_outputs(cnn, x)["y"], **TOL)
        worker.run_blocking(x)
        assert runtime.uploads == 5 + 2, "each run uploads its input only"
        assert "Conv+Relu" in {layer.kind for layer in cnn.layers}  # the fused activation ran on the device


def test_every_device_call_is_made_on_the_dispatcher_thread(runtimes, cnn, rng):
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    with ai.Worker(cnn, "gpu_compute") as worker:
        worker.run_blocking(x)
        worker.schedule(x)
        worker.peek_output().readback_and_clone()
        dispatcher_thread = worker._backend._dispatcher.thread
        assert runtimes[0].threads == {dispatcher_thread.ident}
        assert dispatcher_thread is not threading.current_thread()


def test_schedule_never_waits_for_the_device(runtimes, cnn, rng):
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    with ai.Worker(cnn, "gpu_compute") as worker:
        gate = threading.Event()
        runtimes[0].upload_gate = gate  # the device is busy: the input upload cannot finish
        try:
            worker.schedule(x)  # returns although the dispatcher thread is stuck
            y = worker.peek_output()
            assert y.is_pending and not y.is_readback_request_done()
        finally:
            gate.set()
        np.testing.assert_allclose(y.readback_and_clone().numpy(), _cpu_outputs(cnn, x)["y"], **TOL)


def test_layers_complete_when_enqueued_and_readback_completes_from_its_event(runtimes, cnn, rng):
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    with ai.Worker(cnn, "gpu_compute") as worker:
        runtime = runtimes[0]
        runtime.hold_events()
        execution = worker.schedule(x)
        y = worker.peek_output()
        assert execution.layer_future("softmax").wait(10), "layers must not wait for the device"
        assert not y.is_pending
        y.readback_request()
        before = runtime.queries
        for _ in range(200):  # the dispatcher keeps polling the event, and the readback stays pending
            if runtime.queries > before + 3:
                break
            threading.Event().wait(0.002)
        assert runtime.queries > before + 3
        assert not y.is_readback_request_done()
        runtime.release_events()
        assert y._readback_future().wait(10)
        assert y.is_readback_request_done()
        np.testing.assert_allclose(y.readback_and_clone().numpy(), _cpu_outputs(cnn, x)["y"], **TOL)


def _fallback_model():
    """Add (device) → Hardmax (no device kernel: CPU) → Mul (device); two outputs."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    two = helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])
    nodes = [helper.make_node("Add", ["x", "one"], ["a"], name="add"),
             helper.make_node("Hardmax", ["a"], ["h"], axis=-1, name="hardmax"),
             helper.make_node("Mul", ["h", "two"], ["y"], name="mul"),
             helper.make_node("Mul", ["a", "two"], ["z"], name="mul_direct")]
    return make_model(nodes, [tensor_info("x", [3, 4])], [tensor_info("y", [3, 4]), tensor_info("z", [3, 4])],
                      [one, two], opset=13)


def test_cpu_fallback_with_explicit_transfers(runtimes, rng):
    model = ai.load_model(_fallback_model())
    x = rng.standard_normal((3, 4)).astype(np.float32)
    with ai.Worker(model, "gpu_compute") as worker:
        placement = worker.placement
        assert placement.layers == {"add": "gpu_compute", "hardmax": "cpu", "mul": "gpu_compute",
                                    "mul_direct": "gpu_compute"}
        assert placement.fallback == ["hardmax"]
        assert placement.transfer_steps == ["upload x to gpu_compute", "download a to cpu", "upload h to gpu_compute"]
        got = worker.run_blocking(x)
    expected = _cpu_outputs(model, x)
    for name in ("y", "z"):
        np.testing.assert_allclose(got[name], expected[name], **TOL)


def test_types_without_a_device_kernel_fall_back_to_the_cpu(runtimes, rng):
    one = helper.make_tensor("one", TensorProto.DOUBLE, [1], [1.0])
    proto = make_model([helper.make_node("Add", ["x", "one"], ["y"], name="add64")],
                       [tensor_info("x", [4], TensorProto.DOUBLE)], [tensor_info("y", [4], TensorProto.DOUBLE)], [one])
    model = ai.load_model(proto)
    x = rng.standard_normal(4)
    with ai.Worker(model, "gpu_compute") as worker:
        assert worker.placement.fallback == ["add64"] and worker.placement.transfers == 0
        np.testing.assert_array_equal(worker.run_blocking(x)["y"], x + 1)


def test_shape_and_size_of_device_values_need_no_download(runtimes, rng):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Shape", ["r"], ["s"], name="shape"),
             helper.make_node("Size", ["r"], ["n"], name="size"),
             helper.make_node("Reshape", ["r", "flat"], ["f"], name="flatten"),
             helper.make_node("Reshape", ["f", "s"], ["y"], name="restore")]
    flat = _const("flat", np.array([-1], np.int64))
    proto = make_model(nodes, [tensor_info("x", ["N", 3])],
                       [tensor_info("y", ["N", 3]), tensor_info("n", [], TensorProto.INT64)], [flat], opset=14)
    model = ai.load_model(proto)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    with ai.Worker(model, "gpu_compute") as worker:
        assert worker.placement.layers == {"relu": "gpu_compute", "shape": "cpu", "size": "cpu",
                                           "flatten": "gpu_compute", "restore": "gpu_compute"}
        assert worker.placement.transfer_steps == ["upload x to gpu_compute"]
        out = worker.run_blocking(x)
    np.testing.assert_array_equal(out["y"], np.maximum(x, 0))
    assert int(out["n"]) == 12


# -- every readback mode ----------------------------------------------------------------------------
@pytest.fixture
def gpu_worker(runtimes, cnn):
    with ai.Worker(cnn, "gpu_compute") as worker:
        yield worker


@pytest.fixture
def x_and_expected(cnn, rng):
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    return x, _cpu_outputs(cnn, x)["y"]


def test_readback_and_clone_and_download_to_array(gpu_worker, x_and_expected):
    x, expected = x_and_expected
    gpu_worker.schedule(x)
    y = gpu_worker.peek_output()
    assert y.backend == "gpu_compute"
    clone = y.readback_and_clone()
    assert clone.backend == "cpu"
    np.testing.assert_allclose(clone.numpy(), expected, **TOL)
    np.testing.assert_allclose(y.download_to_array(), expected, **TOL)
    np.testing.assert_allclose(np.asarray(y), expected, **TOL)
    np.testing.assert_allclose(y.numpy(), expected, **TOL)


def test_data_on_backend_is_device_storage(gpu_worker, x_and_expected):
    x, expected = x_and_expected
    gpu_worker.schedule(x)
    y = gpu_worker.peek_output()
    y.readback_and_clone()  # computed
    data = y.data_on_backend
    assert isinstance(data, DeviceTensorData) and data.backend == "gpu_compute"
    assert data.shape == (2, 5) and data.dtype == np.float32
    first, second = data.download(), data.download()
    np.testing.assert_allclose(first, expected, **TOL)
    assert first is not second and first.flags.writeable, "each download is a caller-owned copy"


def test_polling_readback_request(gpu_worker, runtimes, x_and_expected):
    x, expected = x_and_expected
    runtimes[0].hold_events()
    gpu_worker.schedule(x)
    y = gpu_worker.peek_output()
    y.readback_request()
    assert not y.is_readback_request_done()
    runtimes[0].release_events()
    for _ in range(5000):
        if y.is_readback_request_done():
            break
        threading.Event().wait(0.001)
    assert y.is_readback_request_done()
    np.testing.assert_allclose(y.readback_and_clone().numpy(), expected, **TOL)


def test_readback_callback_without_a_loop_runs_on_the_dispatcher_thread(gpu_worker, x_and_expected):
    x, expected = x_and_expected
    gpu_worker.schedule(x)
    y = gpu_worker.peek_output()
    seen: list = []
    done = threading.Event()

    def callback(success: bool) -> None:
        seen.append((success, threading.current_thread()))
        with pytest.raises(ai.AsyncInferError, match="dispatcher thread.*would deadlock"):
            y.data_on_backend.download()  # blocking here would wait for this very thread
        done.set()

    y.readback_request(callback)
    assert done.wait(10)
    assert seen[0][0] is True and seen[0][1] is gpu_worker._backend._dispatcher.thread
    np.testing.assert_allclose(y.readback_and_clone().numpy(), expected, **TOL)


@pytest.mark.anyio
async def test_async_readback_never_blocks_the_loop(gpu_worker, runtimes, x_and_expected):
    import anyio

    x, expected = x_and_expected
    runtimes[0].hold_events()
    gpu_worker.schedule(x)
    y = gpu_worker.peek_output()
    ticker = LoopTicker()
    called: list[bool] = []
    y.readback_request(called.append)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        while ticker.ticks < 20:
            await anyio.sleep(0)
        assert not y.is_readback_request_done()
        threading.Timer(0.02, runtimes[0].release_events).start()
        clone = await y.readback_and_clone_async()
        await anyio.sleep(0.01)  # let the callback delivered to this loop run
        tg.cancel_scope.cancel()
    assert ticker.ticks > 20 and called == [True]
    np.testing.assert_allclose(clone.numpy(), expected, **TOL)
    outs = await gpu_worker.run(x)
    np.testing.assert_allclose(outs["y"], expected, **TOL)


def test_schedule_iterable_and_take_output_survive_dispose(runtimes, cnn, x_and_expected):
    x, expected = x_and_expected
    worker = ai.Worker(cnn, "gpu_compute")
    names = list(worker.schedule_iterable(x))
    assert len(names) == len(worker.placement.layers) + len(worker.placement.transfer_steps)
    taken = worker.take_output()
    worker.dispose()  # finishes the run whose output was taken, reads it back, then closes the device
    assert worker._backend.closed
    np.testing.assert_allclose(taken.numpy(), expected, **TOL)


def test_chained_run_takes_a_pending_device_output(runtimes, cnn, x_and_expected):
    x, expected = x_and_expected
    softmax_again = ai.load_model(make_model(
        [helper.make_node("Softmax", ["p"], ["q"], axis=1, name="softmax2")],
        [tensor_info("p", ["N", 5])], [tensor_info("q", ["N", 5])], opset=13))
    with ai.Worker(cnn, "gpu_compute") as first, ai.Worker(softmax_again, "gpu_compute") as second:
        first.schedule(x)
        second.schedule(first.peek_output())
        got = second.peek_output().readback_and_clone().numpy()
    e = np.exp(expected - expected.max(axis=1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(axis=1, keepdims=True), **TOL)


# -- failures and lifecycle --------------------------------------------------------------------------
def test_kernel_failure_names_the_layer_and_the_worker_survives(runtimes, rng):
    proto = make_model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                        helper.make_node("Reshape", ["r", "shape"], ["y"], name="bad_reshape")],
                       [tensor_info("x", [6]), tensor_info("shape", [2], TensorProto.INT64)],
                       [tensor_info("y", None)], opset=14)
    with ai.Worker(ai.load_model(proto), "gpu_compute") as worker:
        assert worker.placement.layers == {"relu": "gpu_compute", "bad_reshape": "gpu_compute"}
        worker.schedule(np.arange(6, dtype=np.float32), np.array([4, 4], np.int64))
        y = worker.peek_output()
        with pytest.raises(ai.ExecutionError, match="bad_reshape.*cannot reshape") as info:
            y.readback_and_clone()
        assert info.value.layer == "bad_reshape"
        assert y.is_readback_request_done()
        out = worker.run_blocking(np.arange(6, dtype=np.float32) - 3, np.array([2, 3], np.int64))
        np.testing.assert_array_equal(out["y"], np.maximum(np.arange(6, dtype=np.float32) - 3, 0).reshape(2, 3))


def test_cpu_failure_reaches_device_dependents(runtimes):
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("Add", ["x", "one"], ["a"], name="add"),
             helper.make_node("Fail", ["a"], ["b"], domain=TEST_DOMAIN, name="broken_layer"),
             helper.make_node("Mul", ["b", "one"], ["y"], name="after_failure")]
    proto = make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])], [one])
    proto.graph.value_info.append(tensor_info("b", [2]))  # the test op has no type inference
    model = ai.load_model(proto)
    with ai.Worker(model, "gpu_compute") as worker:
        assert worker.placement.fallback == ["broken_layer"]
        worker.schedule(np.zeros(2, np.float32))
        called: list[bool] = []
        y = worker.peek_output()
        y.readback_request(called.append)
        with pytest.raises(ai.ExecutionError, match="broken_layer"):
            y.readback_and_clone()
        assert called == [False]


def test_closed_backend_refuses_work_and_downloads(runtimes, cnn, x_and_expected):
    x, _ = x_and_expected
    worker = ai.Worker(cnn, "gpu_compute")
    worker.schedule(x)
    y = worker.peek_output()
    y.readback_and_clone()
    device_value = y.data_on_backend
    backend = worker._backend
    worker.dispose()
    assert runtimes[0].stopped and backend.closed
    future = backend.start_download(device_value)
    assert future.done() and isinstance(future.exception(), ai.DisposedError)
    with pytest.raises(ai.DisposedError):
        device_value.download()
    backend.close()  # idempotent


def test_close_waits_for_copies_in_flight(runtimes, cnn, x_and_expected):
    x, expected = x_and_expected
    worker = ai.Worker(cnn, "gpu_compute")
    worker.schedule(x)
    y = worker.peek_output()
    y.readback_and_clone()
    runtimes[0].hold_events()
    future = worker._backend.start_download(y.data_on_backend)
    threading.Timer(0.05, runtimes[0].release_events).start()
    worker.dispose()
    assert future.done() and not future.failed(), "close() finishes the readbacks already started"
    np.testing.assert_allclose(future.result(), expected, **TOL)


def test_intermediate_device_buffers_are_released_after_their_last_reader(runtimes, cnn, rng):
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    with ai.Worker(cnn, "gpu_compute") as worker:
        backend = worker._backend
        made: "weakref.WeakSet[DeviceTensorData]" = weakref.WeakSet()
        count = [0]
        wrap = backend._wrap

        def tracking_wrap(array):
            data = wrap(array)
            made.add(data)
            count[0] += 1
            return data

        backend._wrap = tracking_wrap
        execution = worker.schedule(x)
        y = worker.peek_output()
        y.readback_and_clone()
        gc.collect()
        # (the plan's layers: a fused layer without a kernel here runs the layers it replaced)
        assert count[0] == len(worker.placement.layers) + 1, "each device layer and the input upload made a device value"
        alive = [d for d in made if d is not y.data_on_backend]
        assert alive == [], f"{len(alive)} intermediate device values are still referenced"
        del execution


def test_concurrent_runs_share_the_device(runtimes, cnn, rng):
    xs = [rng.standard_normal((1, 3, 8, 8)).astype(np.float32) for _ in range(6)]
    with ai.Worker(cnn, "gpu_compute") as worker:
        outs: dict[int, np.ndarray] = {}

        def run(i):
            outs[i] = worker.run_blocking(xs[i])["y"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    with ai.Worker(cnn, "cpu") as cpu:
        for i, x in enumerate(xs):
            np.testing.assert_allclose(outs[i], cpu.run_blocking(x)["y"], **TOL)


# -- models -------------------------------------------------------------------------------------------
LIGHT = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
         "vgg19", "zfnet512"]


def _light_model(name):
    return ai.load_model(light_path(name))


@pytest.mark.parametrize("name", light_params(LIGHT))
def test_light_models_need_no_fallback(name):
    model = _light_model(name)
    backend = CuPyBackend(HostRuntime())
    try:
        types_ = value_types(model)
        refused = [kind for layer in model.layers for kind in _refused(backend, layer, types_)]
    finally:
        backend.close()
    assert refused == []


def _refused(backend, layer, types_) -> list[str]:
    """The kinds of ``layer`` (or, for a fusion without a kernel here, of the layers it keeps as
    its expansion, which the plan places instead) that ``backend`` leaves to the CPU."""
    if not layer.cpu_bound and backend.prepare(layer, ops.create(layer), types_) is not None:
        return []
    if layer.expansion and not layer.cpu_bound:
        return [kind for inner in layer.expansion for kind in _refused(backend, inner, types_)]
    return [layer.kind]


def _compared_values(model) -> list[str]:
    """The model's outputs, a final Softmax's input in place of its output: these zoo models'
    random weights make logits of about 1e9 whose float32 rounding differs between two correct
    backends by hundreds, which a softmax turns into whole probabilities (0 against 1/996 on the
    2-core Zen 5 VM, with OpenBLAS's Haswell kernels)."""
    producers = {out: layer for layer in model.layers for out in layer.outputs}
    names = []
    for out in model.outputs:
        layer = producers.get(out.name)
        names.append(layer.inputs[0] if layer is not None and layer.op_type == "Softmax" else out.name)
    return names


@pytest.mark.parametrize("name", ["squeezenet", "shufflenet", "inception_v1"])
def test_light_models_match_the_cpu(runtimes, rng, name):
    model = _light_model(name)
    x = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
    names = _compared_values(model)
    with ai.Worker(model, "gpu_compute") as worker:
        assert worker.placement.fallback == []
        got = worker.run_blocking(x, outputs=names)
    with ai.Worker(model, "cpu") as worker:
        want = worker.run_blocking(x, outputs=names)
    for key in names:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-3, atol=1e-5 * np.abs(want[key]).max())


def _transformer_block(rng, vocab=11, d=8, heads=2, t=5):
    """Embedding Gather → attention (MatMul, Transpose, Reshape, Softmax, masked with Equal/Where) →
    LayerNorm → GELU MLP (Div, Erf, Add, Mul) → ReduceMean, Slice, Concat, Squeeze, Unsqueeze."""
    dh = d // heads
    w = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.4  # noqa: E731
    inits = [_const("emb", w(vocab, d)), _const("wq", w(d, d)), _const("wk", w(d, d)), _const("wv", w(d, d)),
             _const("wo", w(d, d)), _const("w1", w(d, 2 * d)), _const("w2", w(2 * d, d)),
             _const("g1", w(d) + 1), _const("b1", w(d)), _const("g2", w(d) + 1), _const("b2", w(d)),
             _const("heads_shape", np.array([1, t, heads, dh], np.int64)),
             _const("model_shape", np.array([1, t, d], np.int64)), _const("scale", np.array(dh ** -0.5, np.float32)),
             _const("zero", np.array(0, np.float32)), _const("neg", np.array(-1e4, np.float32)),
             _const("sqrt2", np.array(np.sqrt(2), np.float32)), _const("half", np.array(0.5, np.float32)),
             _const("onef", np.array(1, np.float32)), _const("axes01", np.array([0, 1], np.int64)),
             _const("axis0", np.array([0], np.int64)), _const("s0", np.array([1], np.int64)),
             _const("s1", np.array([3], np.int64)), _const("ax2", np.array([2], np.int64)),
             _const("mean_axes", np.array([1], np.int64))]
    n = helper.make_node
    nodes = [
        n("Gather", ["emb", "ids"], ["e"], axis=0, name="embed"),
        n("LayerNormalization", ["e", "g1", "b1"], ["h"], axis=-1, epsilon=1e-5, name="ln1"),
        n("MatMul", ["h", "wq"], ["q0"], name="q"), n("MatMul", ["h", "wk"], ["k0"], name="k"),
        n("MatMul", ["h", "wv"], ["v0"], name="v"),
        n("Reshape", ["q0", "heads_shape"], ["q1"], name="q_heads"),
        n("Reshape", ["k0", "heads_shape"], ["k1"], name="k_heads"),
        n("Reshape", ["v0", "heads_shape"], ["v1"], name="v_heads"),
        n("Transpose", ["q1"], ["q2"], perm=[0, 2, 1, 3], name="q_t"),
        n("Transpose", ["k1"], ["k2"], perm=[0, 2, 3, 1], name="k_t"),
        n("Transpose", ["v1"], ["v2"], perm=[0, 2, 1, 3], name="v_t"),
        n("MatMul", ["q2", "k2"], ["sc0"], name="scores"),
        n("Mul", ["sc0", "scale"], ["sc1"], name="scale_scores"),
        n("Equal", ["mask", "zero"], ["pad"], name="is_pad"),
        n("Where", ["pad", "neg", "zero"], ["bias0"], name="mask_bias"),
        n("Unsqueeze", ["bias0", "axes01"], ["bias1"], name="mask_4d"),
        n("Add", ["sc1", "bias1"], ["sc2"], name="masked"),
        n("Softmax", ["sc2"], ["p"], axis=-1, name="attn"),
        n("MatMul", ["p", "v2"], ["o0"], name="context"),
        n("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3], name="merge_t"),
        n("Reshape", ["o1", "model_shape"], ["o2"], name="merge"),
        n("MatMul", ["o2", "wo"], ["o3"], name="out_proj"),
        n("Add", ["o3", "e"], ["r1"], name="residual1"),
        n("LayerNormalization", ["r1", "g2", "b2"], ["h2"], axis=-1, name="ln2"),
        n("MatMul", ["h2", "w1"], ["m0"], name="fc1"),
        n("Div", ["m0", "sqrt2"], ["m1"], name="gelu_div"), n("Erf", ["m1"], ["m2"], name="gelu_erf"),
        n("Add", ["m2", "onef"], ["m3"], name="gelu_add"), n("Mul", ["m0", "m3"], ["m4"], name="gelu_mul"),
        n("Mul", ["m4", "half"], ["m5"], name="gelu_half"),
        n("MatMul", ["m5", "w2"], ["m6"], name="fc2"),
        n("Add", ["m6", "r1"], ["r2"], name="residual2"),
        n("ReduceMean", ["r2", "mean_axes"], ["pooled"], keepdims=0, name="pool"),
        n("Slice", ["r2", "s0", "s1", "mean_axes"], ["mid"], name="slice_tokens"),
        n("Squeeze", ["mid", "axis0"], ["mid2"], name="squeeze"),
        n("ReduceSum", ["mid2", "axis0"], ["mid3"], keepdims=0, name="sum_tokens"),
        n("Unsqueeze", ["mid3", "axis0"], ["mid4"], name="unsqueeze"),
        n("Concat", ["pooled", "mid4"], ["y"], axis=-1, name="concat"),
    ]
    return make_model(nodes, [tensor_info("ids", [1, t], TensorProto.INT64), tensor_info("mask", [1, t])],
                      [tensor_info("y", [1, 2 * d]), tensor_info("p", [1, heads, t, t])], inits, opset=18)


def test_transformer_block_runs_on_the_device_and_matches_the_cpu(runtimes, rng):
    model = ai.load_model(_transformer_block(rng))
    ids = np.array([[3, 1, 10, 0, 7]], np.int64)
    mask = np.array([[1, 1, 1, 0, 1]], np.float32)
    with ai.Worker(model, "gpu_compute") as worker:
        assert worker.placement.fallback == [], worker.placement.fallback
        got = worker.run_blocking(ids, mask)
    expected = _cpu_outputs(model, ids, mask)
    for key in ("y", "p"):
        np.testing.assert_allclose(got[key], expected[key], **TOL)
    assert np.allclose(got["p"][..., 3], 0, atol=1e-6), "the padded token gets no attention"


def test_out_of_range_token_is_an_execution_error(runtimes, rng):
    model = ai.load_model(_transformer_block(rng))
    with ai.Worker(model, "gpu_compute") as worker:
        with pytest.raises(ai.ExecutionError, match="embed.*out of range"):
            worker.run_blocking(np.array([[3, 1, 11, 0, 7]], np.int64), np.ones((1, 5), np.float32))


# -- CUDA only ------------------------------------------------------------------------------------------
@needs_cuda
def test_cuda_runtime_round_trip_through_pinned_memory_and_events():
    from asyncinfer.backends.cupy.device import CudaRuntime

    backend = CuPyBackend(CudaRuntime())
    try:
        host = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
        value = backend.upload_constant(None, 0, host)  # (a plain upload: no kernel layout)
        assert type(value.array).__module__.startswith("cupy")
        future = backend.start_download(value)
        assert future.wait(30)
        np.testing.assert_array_equal(future.result(), host)
        np.testing.assert_array_equal(value.download(), host)
    finally:
        backend.close()


@needs_cuda
def test_cuda_worker_matches_the_cpu(cnn, rng):
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    with ai.Worker(cnn, "gpu_compute") as worker:
        assert worker.placement.fallback == []
        got = worker.run_blocking(x)
        worker.schedule(x)
        y = worker.peek_output()
        y.readback_request()
        assert y._readback_future().wait(30) and y.is_readback_request_done()
    np.testing.assert_allclose(got["y"], _cpu_outputs(cnn, x)["y"], rtol=1e-3, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_cuda_light_models_match_the_cpu(name, rng):
    model = _light_model(name)
    x = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
    with ai.Worker(model, "gpu_compute") as worker:
        assert worker.placement.fallback == []
        got = worker.run_blocking(x)
    for key, want in _cpu_outputs(model, x).items():
        np.testing.assert_allclose(got[key], want, rtol=1e-3, atol=1e-4)


@needs_cuda
def test_cuda_memory_pool_reuses_buffers_between_runs(cnn, rng):
    x = rng.standard_normal((8, 3, 8, 8)).astype(np.float32)
    with ai.Worker(cnn, "gpu_compute") as worker:
        backend = worker._backend
        worker.run_blocking(x)
        used_first, held_first = backend._dispatcher.call(backend.runtime.memory_stats)
        for _ in range(5):
            worker.run_blocking(x)
        used, held = backend._dispatcher.call(backend.runtime.memory_stats)
    assert used == used_first, "a finished run must give every buffer back to the pool"
    assert held == held_first, "later runs must reuse the pooled buffers, not grow the pool"


@needs_cuda
def test_cudnn_and_im2col_convolutions_agree(rng):
    from asyncinfer import ops as ops_
    from asyncinfer.backends.cupy.cudnn import cudnn_convolution
    from asyncinfer.backends.cupy.device import CudaRuntime
    from asyncinfer.backends.cupy.kernels.conv import ConvKernel
    from asyncinfer.model.ir import Layer

    conv = cudnn_convolution()
    if conv is None:
        pytest.skip("CuPy has no cuDNN here: the im2col kernel is the only convolution")
    ctx = CudaRuntime(use_cudnn=True).start()
    import cupy

    layer = Layer(name="c", op_type="Conv", inputs=["x", "w"], outputs=["y"],
                  attrs=dict(pads=[1, 1, 1, 1], strides=[2, 2], group=2), version=17)
    kernel = ConvKernel(layer, ops_.create(layer))
    x, w = rng.standard_normal((2, 4, 9, 9)).astype(np.float32), rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    with_cudnn = cupy.asnumpy(kernel(ctx, cupy.asarray(x), cupy.asarray(w))[0])
    plain = cupy.asnumpy(kernel(type(ctx)(xp=cupy, to_device=ctx.to_device, erf=ctx.erf), cupy.asarray(x),
                                cupy.asarray(w))[0])
    np.testing.assert_allclose(with_cudnn, plain, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(plain, ops_.create(layer)(x, w)[0], rtol=1e-3, atol=1e-4)
