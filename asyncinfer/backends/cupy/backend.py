"""The gpu_compute backend: layers enqueue kernels on one CUDA stream from one dispatcher thread.

``dispatch`` only queues the step (it never blocks). On the dispatcher thread a layer's kernels
are enqueued on the stream and its future completes at once, without synchronising: stream
order makes every dependent kernel correct. Only copies to the host wait for the device, and
they complete from CUDA events polled by the dispatcher: the plan's download steps (values going
to a CPU-fallback layer) and output readbacks (`start_download`). A value's device buffer
goes back to CuPy's memory pool when the run drops its last reference.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ...concurrency.future import TaskFuture
from ...errors import AsyncInferError, DisposedError, ExecutionError
from ...model.ir import Layer
from ...ops.base import Op
from ..base import Step, ValueTypes
from ..device import DeviceBackend
from .device import DeviceRuntime, Readback
from .dispatcher import Dispatcher
from .kernels import Kernel, KernelContext, apply_activations, can_fuse, kernel_class
from .tensor import DeviceTensorData


class CuPyBackend(DeviceBackend):
    """CUDA through CuPy (``BackendType.GPU_COMPUTE``).

    Args:
        runtime: the device runtime; default a `CudaRuntime` on ``device_id``.
            Tests pass a `HostRuntime` to run everything on NumPy.
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
        self._constants: dict[int, tuple[np.ndarray, DeviceTensorData]] = {}
        self.thread = self._dispatcher = Dispatcher(runtime)
        self._ctx: KernelContext = self._dispatcher.context  # type: ignore[assignment]

    @property
    def description(self) -> str:
        """The device, in words."""
        return self.runtime.description

    # -- planning (worker creation) --------------------------------------------------------------
    def prepare(self, layer: Layer, op: Op, types: ValueTypes) -> Kernel | None:
        cls = kernel_class(layer)
        if cls is None or not all(can_fuse(f.op_type) and f.domain in ("", "ai.onnx") for f in layer.fused):
            return None
        host = frozenset(op.value_inputs) | cls.host_inputs
        if not cls.accepts(layer, op, types, host):
            return None
        kernel = cls(layer, op)
        kernel.host_inputs = host  # the inputs this layer reads on the host: the op's and the kernel's own
        return kernel

    def prepare_constant(self, kernel: Kernel, input_index: int, array: np.ndarray) -> DeviceTensorData:
        """A device copy of a constant, made once (and shared by every layer reading it)."""
        cached = self._constants.get(id(array))
        if cached is not None and cached[0] is array:
            return cached[1]
        data = self.upload(array)
        self._constants[id(array)] = (array, data)  # holding the array keeps its id unique
        return data

    def upload(self, array: np.ndarray) -> DeviceTensorData:
        return self._wrap(self._ctx.to_device(np.asarray(_host_array(array))))

    # -- running (dispatcher thread) ---------------------------------------------------------------
    def run_layer(self, step: Step, args: list) -> list:
        kernel: Kernel = step.kernel
        host = kernel.host_inputs
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

    def _wrap(self, array: Any) -> DeviceTensorData:
        xp = self._ctx.xp
        return DeviceTensorData(array if isinstance(array, xp.ndarray) else xp.asarray(array), self)

    def holds(self, value: Any) -> bool:
        return isinstance(value, DeviceTensorData) and value._owner is self

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
