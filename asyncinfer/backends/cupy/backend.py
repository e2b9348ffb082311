"""The gpu_compute backend: layers enqueue kernels on one CUDA stream from one dispatcher thread.

``dispatch`` only queues the step (it never blocks). On the dispatcher thread a layer's kernels
are enqueued on the stream and its future completes at once, without synchronising: stream
order makes every dependent kernel correct. Only copies to the host wait for the device, and
they complete from CUDA events polled by the dispatcher: the plan's download steps (values going
to a CPU-fallback layer) and output readbacks (:meth:`start_download`). A value's device buffer
goes back to CuPy's memory pool when the run drops its last reference.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import ops
from ...errors import AsyncInferError, DisposedError, ExecutionError
from ...model.ir import Layer
from ...runtime.future import TaskFuture
from ..base import DeviceBackend, ValueTypes
from .device import DeviceRuntime, Readback
from .dispatcher import Dispatcher
from .kernels import Kernel, KernelContext, apply_activations, can_fuse, kernel_class
from .tensor import DeviceTensorData

if TYPE_CHECKING:
    from ...runtime.execution import Execution, Step


class CuPyBackend(DeviceBackend):
    """CUDA through CuPy (``BackendType.GPU_COMPUTE``).

    Args:
        runtime: the device runtime; default a :class:`~.device.CudaRuntime` on ``device_id``.
            Tests pass a :class:`~.hostdevice.HostRuntime` to run everything on NumPy.
        device_id: the CUDA device to use.
        use_cudnn: run convolutions through cuDNN when CuPy has it (default: yes, unless the
            environment sets ``ASYNCINFER_CUDNN=0``); otherwise the im2col kernel.

    Raises:
        BackendUnavailableError: the device could not be started (the message says why).
    """

    name = "gpu_compute"
    device = "cuda"

    def __init__(self, runtime: DeviceRuntime | None = None, *, device_id: int = 0, use_cudnn: bool | None = None):
        if runtime is None:
            from .device import CudaRuntime

            if use_cudnn is None:
                use_cudnn = os.environ.get("ASYNCINFER_CUDNN", "1") != "0"
            runtime = CudaRuntime(device_id, use_cudnn=use_cudnn)
        self.runtime = runtime
        # layer id -> (layer, its kernel, the input indices it reads on the host); filled by
        # supports() while the plan is built, read on the dispatcher thread afterwards
        self._kernels: dict[int, tuple[Layer, Kernel, frozenset[int]]] = {}
        self._constants: dict[int, tuple[np.ndarray, DeviceTensorData]] = {}
        self._dispatcher = Dispatcher(runtime)
        self._ctx: KernelContext = self._dispatcher.context  # type: ignore[assignment]

    @property
    def description(self) -> str:
        """The device, in words."""
        return self.runtime.description

    # -- planning (worker creation) --------------------------------------------------------------
    def supports(self, layer: Layer, types: ValueTypes) -> bool:
        cls = kernel_class(layer)
        if cls is None or not all(can_fuse(f.op_type) and f.domain in ("", "ai.onnx") for f in layer.fused):
            return False
        try:
            op = ops.create(layer)
        except AsyncInferError:
            return False
        host = super().host_inputs(layer) | cls.host_inputs
        if not cls.accepts(layer, op, types, host):
            return False
        self._kernels[id(layer)] = (layer, cls(layer, op), host)
        return True

    def host_inputs(self, layer: Layer) -> frozenset[int]:
        entry = self._kernels.get(id(layer))
        if entry is not None and entry[0] is layer:
            return entry[2]
        return super().host_inputs(layer)

    def upload_constant(self, layer: Layer, input_index: int, array: np.ndarray) -> DeviceTensorData:
        """A device copy of a constant, made once (and shared by every layer reading it)."""
        cached = self._constants.get(id(array))
        if cached is not None and cached[0] is array:
            return cached[1]
        data = self._dispatcher.call(lambda: self._wrap(self._ctx.to_device(np.asarray(array))))
        self._constants[id(array)] = (array, data)  # holding the array keeps its id unique
        return data

    # -- running ---------------------------------------------------------------------------------
    def dispatch(self, execution: "Execution", step: "Step") -> None:
        if not self._dispatcher.submit(lambda: self._run_step(execution, step)):
            execution.fail_step(step, DisposedError("the gpu_compute backend was closed before this layer could run"))

    def _run_step(self, execution: "Execution", step: "Step") -> None:
        """On the dispatcher thread: enqueue one step's work; complete it unless it is a download."""
        args = execution.begin_step(step)
        if args is None:
            return
        try:
            if step.transfer == "download":
                readback = self.runtime.start_readback(_device_array(args[0]))
                self._dispatcher.watch(readback, lambda: self._downloaded(execution, step, readback, args))
                return
            if step.transfer == "upload":
                outputs = [self._wrap(self._ctx.to_device(_host_array(args[0])))]
            else:
                outputs = self._run_layer(step, args)
        except Exception as exc:  # noqa: BLE001 - any kernel failure becomes an ExecutionError
            execution.fail_step(step, execution.kernel_error(step, exc, args))
            return
        execution.end_step(step, outputs)

    def _run_layer(self, step: "Step", args: list) -> list:
        entry = self._kernels.get(id(step.layer))
        if entry is None or entry[0] is not step.layer:
            raise AsyncInferError(f"gpu_compute has no kernel prepared for {step.layer.describe()}")
        _, kernel, host = entry
        inputs = [None if a is None else (_host_array(a) if i in host else _device_array(a))
                  for i, a in enumerate(args)]
        xp = self._ctx.xp
        fused = {"activations": step.activations} if kernel.takes_activations else {}
        # (NumPy turns 0-d results into scalars: arrays again, so activations can run in place)
        outputs = [o if o is None or isinstance(o, xp.ndarray) else xp.asarray(o)
                   for o in kernel(self._ctx, *inputs, **fused)]
        if step.activations and not kernel.takes_activations:
            fresh = kernel.fresh_output and not any(outputs[0] is x for x in inputs)
            outputs[0] = apply_activations(self._ctx, outputs[0], step.activations, fresh)
        # outputs the model does not use (unnamed) are dropped now, so their buffers go back at once
        return [None if o is None or not name else self._wrap(o) for o, name in zip(outputs, step.layer.outputs)]

    def _downloaded(self, execution: "Execution", step: "Step", readback: Readback, args: list) -> None:
        """A download step's event completed: its host copy is the step's output."""
        try:
            host = readback.result()
        except Exception as exc:  # noqa: BLE001
            execution.fail_step(step, execution.kernel_error(step, exc, args))
            return
        execution.end_step(step, [host])

    def _wrap(self, array: Any) -> DeviceTensorData:
        xp = self._ctx.xp
        return DeviceTensorData(array if isinstance(array, xp.ndarray) else xp.asarray(array), self)

    # -- readback ----------------------------------------------------------------------------------
    def start_download(self, value: Any) -> TaskFuture:
        """Copy a device value to the host: a pinned-memory copy and an event on the stream; the
        future completes (on the dispatcher thread) when the event does. Never blocks."""
        future = TaskFuture(label="gpu_compute readback")
        if value is None:  # an omitted optional output
            future.set_result(None)
            return future
        if not isinstance(value, DeviceTensorData):
            future.set_exception(ExecutionError(
                f"gpu_compute cannot download {type(value).__name__} (not a device value)"))
            return future

        def job() -> None:
            try:
                readback = self.runtime.start_readback(value.array)
            except Exception as exc:  # noqa: BLE001
                future.set_exception(ExecutionError(
                    f"gpu_compute readback of {value!r} failed: {type(exc).__name__}: {exc}"))
                return
            self._dispatcher.watch(readback, lambda: _complete(future, readback))

        if not self._dispatcher.submit(job):
            future.set_exception(DisposedError("the gpu_compute backend is closed: nothing can be read back from it"))
        return future

    def download_blocking(self, value: DeviceTensorData) -> np.ndarray:
        """Blocking download (``TensorData.download``); refused on the dispatcher thread, where it
        would wait for itself."""
        if self._dispatcher.on_thread():
            raise AsyncInferError("download() was called on the gpu_compute dispatcher thread (e.g. from a readback "
                                  "callback) and would deadlock; use readback_request or start_download instead")
        return self.start_download(value).result()

    def close(self) -> None:
        """Finish queued work and copies in flight, then stop the dispatcher thread."""
        self._dispatcher.close()
        self._constants.clear()

    @property
    def closed(self) -> bool:
        return self._dispatcher.closed


def _complete(future: TaskFuture, readback: Readback) -> None:
    try:
        host = readback.result()
    except Exception as exc:  # noqa: BLE001
        future.set_exception(ExecutionError(f"gpu_compute readback failed: {type(exc).__name__}: {exc}"))
        return
    future.set_result(host)


def _device_array(value: Any) -> Any:
    """The device array of a device value; anything else is a placement bug, reported as such."""
    if not isinstance(value, DeviceTensorData):
        raise TypeError(f"expected a gpu_compute device value, got {type(value).__name__} "
                        "(a host value reached a device input without an upload)")
    return value.array


def _host_array(value: Any) -> Any:
    if isinstance(value, DeviceTensorData):
        raise TypeError("expected a host value, got a gpu_compute device value (a download is missing)")
    return value
