"""What a backend provides to the runtime.

There are two kinds of backend:

- a *host* backend (``device == "cpu"``) computes on NumPy arrays: the values in its layers'
  futures are arrays, readable at once;
- a *device* backend (:class:`DeviceBackend`, e.g. ``gpu_pixel``, ``gpu_compute``) keeps values in
  device memory: its layers' futures hold :class:`~asyncinfer.tensor.TensorData` handles, and
  getting a value to the host is an asynchronous download that completes from a device fence.

The plan (``runtime/plan.py``) inserts explicit ``Upload``/``Download`` steps wherever a value
crosses between the host and a device, and asks the device backend to upload each constant it
needs once, when the worker is created.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..model.ir import Layer

if TYPE_CHECKING:
    from ..runtime.execution import Execution, Step
    from ..runtime.future import TaskFuture

#: Element type of each value of a model, as far as shape inference knows it (None: unknown).
ValueTypes = Mapping[str, "np.dtype | None"]


class Backend(ABC):
    """Runs layers whose inputs are ready. One backend instance belongs to one worker."""

    name: str = ""
    #: Where this backend's values live: ``"cpu"`` (NumPy arrays) or a device name.
    device: str = "cpu"

    @abstractmethod
    def supports(self, layer: Layer, types: ValueTypes) -> bool:
        """Whether this backend has a kernel for ``layer`` with the value types ``types``
        (else the layer falls back to the CPU)."""

    @abstractmethod
    def dispatch(self, execution: "Execution", step: "Step") -> None:
        """Run ``step`` of ``execution`` soon; its inputs are all complete. Must not block."""

    @abstractmethod
    def close(self) -> None:
        """Release threads and device resources; waits for kernels already running."""


class DeviceBackend(Backend):
    """A backend whose values live in device memory.

    ``dispatch`` receives three kinds of step: the model's layers, and the transfer steps the
    plan inserted (``step.transfer`` is ``"upload"`` or ``"download"``). Uploads turn a host array
    into a device value; downloads must complete from a device fence or event, never by waiting.
    """

    device = "device"

    def host_inputs(self, layer: Layer) -> frozenset[int]:
        """Input indices of ``layer`` that the kernel reads on the host (shape-like values, such
        as Reshape's ``shape``): they are never uploaded. Default: the op's ``value_inputs``."""
        from ..ops.registry import lookup

        return frozenset(lookup(layer.op_type, layer.version, layer.domain).value_inputs)

    @abstractmethod
    def upload_constant(self, layer: Layer, input_index: int, array: np.ndarray) -> Any:
        """The device form of constant input ``input_index`` of ``layer``, made once when the
        worker is created (it may block then). A kernel may choose a special layout for it."""

    @abstractmethod
    def start_download(self, value: Any) -> "TaskFuture":
        """Start copying a device value to the host; the returned future completes with a NumPy
        array (or fails). Callable from any thread; never blocks."""
