"""The dispatcher thread: the one thread that owns the device, its stream, and every CUDA call.

A `DeviceThread`: work arrives on a queue (layers to
enqueue, downloads to start, constants to upload) from any thread, without ever blocking the
sender; between work items the thread polls the events of the copies in flight and runs their
completions.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import BackendUnavailableError
from ...concurrency.device_thread import DeviceThread
from .device import DeviceRuntime
from .kernels.base import KernelContext


class Dispatcher(DeviceThread):
    """Runs jobs in order on one thread that owns ``runtime``; polls CUDA events between them."""

    def __init__(self, runtime: DeviceRuntime, name: str = "asyncinfer-gpu_compute"):
        self.runtime = runtime
        self.context: KernelContext | None = None
        super().__init__(name)

    def start_device(self) -> None:
        self.context = self.runtime.start()

    def stop_device(self) -> None:
        self.runtime.stop()

    def poll_device(self) -> None:
        self.runtime.poll()  # release finished staging buffers

    def start_failed(self, error: BaseException) -> BaseException:
        failure = BackendUnavailableError(f"gpu_compute could not start on {self.runtime.description}: "
                                          f"{type(error).__name__}: {error}")
        failure.__cause__ = error
        return failure

    def closed_error(self) -> BaseException:
        return BackendUnavailableError("the gpu_compute backend is closed")

    def watch(self, fence: Any, on_done: Callable[[], None]) -> None:  # type: ignore[override]
        """(dispatcher thread) Call ``on_done()`` once ``fence.done()`` (an event's query) is True."""
        super().watch(fence.done, on_done)
