"""The base of every device backend (``gpu_pixel``, ``gpu_compute``): what they share, written once.

A device backend keeps its values in device memory and owns one
`DeviceThread` (the GL thread, the CUDA dispatcher):
every device call runs there, in order. Dispatching a step only queues it on that thread; there
the step is begun, run (a layer's kernel, an upload, or a download), and ended. A layer's step
ends as soon as its work is *issued*: the device runs one queue's work in order, so later work
reading its output is correct without waiting. Only a download waits for the device, and it
completes from a fence or an event that the device thread polls: nothing ever blocks.

A subclass supplies its device thread (``self.thread``), `prepare` (its kernel table
lookup), `run_layer`, `upload`, `start_download`, and optionally
`check_errors` and `prepare_constant`.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np

from ..concurrency.device_thread import DeviceThread
from ..concurrency.future import TaskFuture
from ..errors import DisposedError
from .base import Backend, Step, StepDone, StepKind, kernel_error, run_kernel


class DeviceBackend(Backend):
    """A backend whose values live in device memory, driven from its one device thread."""

    device = "device"
    thread: DeviceThread

    # -- to supply --------------------------------------------------------------------------------
    @abstractmethod
    def run_layer(self, step: Step, args: list) -> list:
        """(device thread) Issue ``step``'s layer on ``args`` (device values; host arrays for the
        kernel's ``host_inputs``; None for omitted inputs); the outputs, one per layer output."""

    @abstractmethod
    def upload(self, array: np.ndarray) -> Any:
        """(device thread) A device copy of a host array."""

    @abstractmethod
    def start_download(self, value: Any) -> TaskFuture:
        """(any thread) Start copying a device value to the host; the future completes with a
        NumPy array (or fails). Never blocks."""

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is already a value of this backend's device (an upload of it is
        then no copy at all): a model input fed with an output of an earlier run."""
        return False

    def check_errors(self) -> None:
        """(device thread) Raise the device's pending error after a step, if it has such a notion."""

    def prepare_constant(self, kernel: Any, input_index: int, array: np.ndarray) -> Any:
        """(device thread) The device form of constant input ``input_index`` of a layer run by
        ``kernel``; by default a plain upload (a kernel may want its own layout)."""
        return self.upload(array)

    # -- written once -------------------------------------------------------------------------------
    def host_inputs(self, kernel: Any) -> frozenset[int]:
        """Input indices ``kernel`` reads on the host (shape-like values): never uploaded."""
        return kernel.host_inputs

    def upload_constant(self, kernel: Any, input_index: int, array: np.ndarray) -> Any:
        """The device form of a constant, made once when the worker is built (this may block)."""
        return self.thread.call(lambda: self.prepare_constant(kernel, input_index, array))

    def dispatch(self, step: Step, args: list, done: StepDone) -> None:
        if not self.thread.submit(lambda: self._run(step, args, done)):
            done.fail(DisposedError(f"the {self.name} backend was closed before {step.layer.describe()} could run"))

    def _run(self, step: Step, args: list, done: StepDone) -> None:
        """(device thread) Begin, issue and end one step."""
        if step.kind is StepKind.DOWNLOAD:
            self._download(step, args, done)
        else:
            run_kernel(step, args, done, self._issue)

    def _issue(self, step: Step, args: list) -> list:
        """(device thread) Issue an upload or a layer; the device's pending error fails it."""
        if step.kind is StepKind.UPLOAD:  # a value already on this device (a KV cache fed back) passes through
            outputs = [args[0] if self.holds(args[0]) else self.upload(args[0])]
        else:
            outputs = self.run_layer(step, args)
        self.check_errors()
        return outputs

    def _download(self, step: Step, args: list, done: StepDone) -> None:
        """A download step ends when its copy lands (from the device's fence or event)."""
        if not done.begin():
            return

        def landed(download: TaskFuture) -> None:
            if download.failed():
                done.fail(kernel_error(step, download.exception(), args))  # type: ignore[arg-type]
            else:
                done([download.peek()])

        try:
            self.start_download(args[0]).add_done_callback(landed)
        except Exception as exc:  # noqa: BLE001 - e.g. not a device value: a placement bug, reported
            done.fail(kernel_error(step, exc, args))
