"""``gpu_pixel``: each layer a fragment shader drawn into a texture, on one GL thread.

``dispatch`` only queues: the GL thread runs the layer's draws in order. A layer's future
completes once its draws are *issued*: GL executes one context's commands in order, so later
draws that read its texture are correct without waiting. The host only waits for GPU work at a
download (a transfer step, or reading an output back), which completes from a GL fence polled
by the GL thread: nobody blocks, the event loop least of all.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...concurrency.future import TaskFuture
from ...model.ir import Layer
from ...ops.base import Op
from ..base import KERNELS, Step, ValueTypes
from ..device import DeviceBackend
from .device import PixelDevice
from .kernels import PixelKernel
from .kernels.elementwise import UNARY, activation_chain
from .storage import PixelTensor


class PixelBackend(DeviceBackend):
    """Runs layers as GLSL fragment shaders; layers without a shader fall back to the CPU."""

    name = "gpu_pixel"
    device = "gl"

    def __init__(self) -> None:
        self.gpu = PixelDevice()  # raises BackendUnavailableError naming what is missing
        self.thread = self.gpu.gl
        self._closed = False

    def prepare(self, layer: Layer, op: Op, types: ValueTypes) -> PixelKernel | None:
        kernel_class = KERNELS.lookup(self.name, layer)
        if kernel_class is None or any(f.op_type not in UNARY and f.op_type != "Clip" for f in layer.fused):
            return None
        try:
            kernel = kernel_class(layer, op)
            return kernel if kernel.supports(types) else None
        except Exception:  # noqa: BLE001 - an attribute combination this kernel does not parse
            return None

    def prepare_constant(self, kernel: PixelKernel, input_index: int, array: np.ndarray) -> PixelTensor:
        try:
            prepared = kernel.prepare_constant(self.gpu, input_index, array)
            return prepared if prepared is not None else self.gpu.upload(array)
        except Exception:
            self.gpu.clear_errors()  # a failed allocation's GL error must not fail a later step
            raise

    def upload(self, array: np.ndarray) -> PixelTensor:
        try:
            return self.gpu.upload(array)
        except Exception:
            self.gpu.clear_errors()
            raise

    def start_download(self, value: Any) -> TaskFuture:
        return self.gpu.start_download(value)

    def holds(self, value: Any) -> bool:
        return isinstance(value, PixelTensor) and value._device is self.gpu

    def check_errors(self) -> None:
        self.gpu.check_errors()

    def run_layer(self, step: Step, args: list) -> list:
        try:
            return self._run_layer(step, args)
        except Exception:
            self.gpu.clear_errors()  # a failed layer's GL error must not fail the next step
            raise

    def _run_layer(self, step: Step, args: list) -> list:
        kernel: PixelKernel = step.kernel
        post = activation_chain(step.activations) if step.activations else None
        if post is None or kernel.fuses_activation:
            return kernel.run(self.gpu, args, post)
        outputs = list(kernel.run(self.gpu, args, None))
        first: PixelTensor = outputs[0]
        outputs[0] = self.gpu.draw(first.shape, "vec4 texel(int t, int outer, int block, int inner) { return A_texel(t); }",
                                   {"A": first}, mode="texel", layout=first.layout, post=post)
        return outputs

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.gpu.close()
