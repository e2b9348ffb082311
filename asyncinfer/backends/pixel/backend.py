"""``gpu_pixel``: each layer a fragment shader drawn into a texture, on one GL thread.

``dispatch`` only queues: the GL thread runs the layer's draws in order. A layer's future
completes once its draws are *issued*: GL executes one context's commands in order, so later
draws that read its texture are correct without waiting. The host only waits for GPU work at a
download (a transfer step, or reading an output back), which completes from a GL fence polled
by the GL thread: nobody blocks, the event loop least of all.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ... import ops
from ...errors import DisposedError
from ...model.ir import Layer
from ...runtime.future import TaskFuture
from ..base import DeviceBackend, ValueTypes
from .device import PixelDevice
from .kernels import KERNELS, PixelKernel
from .kernels.elementwise import UNARY, activation_chain
from .storage import PixelTensor

if TYPE_CHECKING:
    from ...runtime.execution import Execution, Step


class PixelBackend(DeviceBackend):
    """Runs layers as GLSL fragment shaders; layers without a shader fall back to the CPU."""

    name = "gpu_pixel"
    device = "gl"

    def __init__(self) -> None:
        self.gpu = PixelDevice()  # raises BackendUnavailableError naming what is missing
        self._kernels: dict[int, PixelKernel] = {}
        self._closed = False

    # -- planning ------------------------------------------------------------------------------------
    def supports(self, layer: Layer, types: ValueTypes) -> bool:
        kernel_class = KERNELS.get(layer.op_type) if layer.domain in ("", "ai.onnx") else None
        if kernel_class is None:
            return False
        if any(f.op_type not in UNARY and f.op_type != "Clip" for f in layer.fused):
            return False
        try:
            kernel = kernel_class(layer, ops.create(layer))
            if not kernel.supports(types):
                return False
        except Exception:  # noqa: BLE001 - an attribute combination this kernel does not parse
            return False
        self._kernels[id(layer)] = kernel
        return True

    def kernel(self, layer: Layer) -> PixelKernel | None:
        """The kernel planned for ``layer`` (None when it falls back)."""
        return self._kernels.get(id(layer))

    def host_inputs(self, layer: Layer) -> frozenset[int]:
        kernel = self.kernel(layer)
        return kernel.host_inputs if kernel is not None else super().host_inputs(layer)

    def upload_constant(self, layer: Layer, input_index: int, array: np.ndarray) -> Any:
        kernel = self.kernel(layer)

        def upload() -> PixelTensor:
            prepared = kernel.prepare_constant(self.gpu, input_index, array) if kernel else None
            return prepared if prepared is not None else self.gpu.upload(array)

        return self.gpu.gl.call(upload)

    def start_download(self, value: Any) -> TaskFuture:
        return self.gpu.start_download(value)

    # -- running ---------------------------------------------------------------------------------------
    def dispatch(self, execution: "Execution", step: "Step") -> None:
        try:
            self.gpu.gl.submit(lambda: self._run(execution, step))
        except DisposedError as exc:
            execution.fail_step(step, exc)

    def _run(self, execution: "Execution", step: "Step") -> None:
        """(GL thread) Issue one step's GL work."""
        args = execution.begin_step(step)
        if args is None:
            return
        try:
            if step.transfer == "download":
                self._download(execution, step, args[0])
                return
            if step.transfer == "upload":
                outputs: list = [self.gpu.upload(args[0])]
            else:
                outputs = self._run_layer(step, args)
            self.gpu.check_errors()
        except Exception as exc:  # noqa: BLE001 - GL and kernel errors name the layer
            execution.fail_step(step, execution.kernel_error(step, exc, args))
            return
        execution.end_step(step, outputs)

    def _run_layer(self, step: "Step", args: list) -> list:
        kernel = self._kernels[id(step.layer)]
        post = activation_chain(step.activations) if step.activations else None
        if post is None or kernel.fuses_activation:
            return kernel.run(self.gpu, args, post)
        outputs = list(kernel.run(self.gpu, args, None))
        first: PixelTensor = outputs[0]
        outputs[0] = self.gpu.draw(first.shape, "vec4 texel(int t, int outer, int block, int inner) { return A_texel(t); }",
                                   {"A": first}, mode="texel", layout=first.layout, post=post)
        return outputs

    def _download(self, execution: "Execution", step: "Step", value: PixelTensor) -> None:
        def done(download: TaskFuture) -> None:
            if download.failed():
                execution.fail_step(step, execution.kernel_error(step, download.exception(), [value]))  # type: ignore[arg-type]
            else:
                execution.end_step(step, [download.peek()])

        self.gpu.start_download(value).add_done_callback(done)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._kernels.clear()
            self.gpu.close()
