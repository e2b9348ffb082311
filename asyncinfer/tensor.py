"""Tensors: values that may still be pending in a task graph, and their readback.

A `Tensor` returned by a worker wraps the future of the layer that produces it. Reading it
(`readback_and_clone`, `download_to_array`, `numpy()`) waits for that layer; the async and polling
forms never block. `TensorData` is the storage on a backend: NumPy arrays on the CPU;
device backends subclass it for their device tensors, and a tensor computed on a device is
read back by an asynchronous download that completes from a device fence or event.
"""
from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import AsyncInferError, DisposedError, ExecutionError
from .model.ir import Dim
from .concurrency.bridge import loop_dispatcher, wait_done
from .concurrency.future import TaskFuture
from .concurrency.holding_gil import copy_array

ReadbackCallback = Callable[[bool], Any]


class TensorState(enum.Enum):
    """Where a tensor is in its life: computing, computed, failed, or disposed by its owner."""

    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"
    DISPOSED = "disposed"


class TensorData:
    """A tensor's storage on its backend. ``download()`` returns a NumPy copy and may block.

    Device storage also has ``shape`` and ``dtype`` (the logical NumPy dtype of its values).
    """

    backend: str = "cpu"

    def download(self) -> np.ndarray:
        raise NotImplementedError


class CPUTensorData(TensorData):
    """Storage of a tensor on the CPU backend: a NumPy array."""

    backend = "cpu"

    def __init__(self, array: np.ndarray):
        self.array = array

    def download(self) -> np.ndarray:
        return copy_value(self.array)


def copy_value(value):
    """A caller-owned copy of a value: an array, a sequence of arrays, or None (an empty optional)."""
    if value is None:
        return None
    if isinstance(value, list):
        return [copy_value(v) for v in value]
    if type(value) is np.ndarray and value.flags.c_contiguous:
        return copy_array(value)  # (on an event loop's thread: see concurrency/holding_gil.py)
    return np.array(value, copy=True)


class _PendingData(TensorData):
    """``data_on_backend`` of a tensor that may still be computing: download() waits for it."""

    def __init__(self, tensor: "Tensor"):
        self._tensor = tensor
        self.backend = tensor.backend

    def download(self) -> np.ndarray:
        return self._tensor._storage().download()


class Tensor:
    """An n-dimensional array that may still be computing on a backend.

    Build one from data with ``Tensor(array)``; workers return pending ones from ``peek_output``.
    """

    __slots__ = ("_future", "_index", "_declared_shape", "_declared_dtype", "name", "backend",
                 "_readback", "_lock", "_disposed", "_owner", "_device", "__weakref__")

    def __init__(self, data: Any = None, *, name: str = "", _future: TaskFuture | None = None, _index: int = 0,
                 _shape: tuple[Dim, ...] | None = None, _dtype: np.dtype | None = None, _backend: str = "cpu",
                 _owner: Any = None, _device: Any = None):
        if _future is None:
            if data is None:
                raise TypeError("Tensor() needs an array-like")
            array = np.array(data.numpy() if isinstance(data, Tensor) else data, copy=True)
            _future = TaskFuture.completed([array], label=name)
            _shape, _dtype = array.shape, array.dtype
        self._future = _future
        self._index = _index
        self._declared_shape = _shape
        self._declared_dtype = None if _dtype is None else np.dtype(_dtype)
        self.name = name
        self.backend = _backend
        self._readback: TaskFuture | None = None
        self._lock = threading.Lock()
        self._disposed = False
        self._owner = _owner  # the Worker a peeked tensor belongs to (None: caller-owned)
        self._device = _device  # the DeviceBackend holding the value (None: host memory)

    @classmethod
    def from_numpy(cls, array: np.ndarray, name: str = "") -> "Tensor":
        """A CPU tensor holding a copy of ``array``."""
        return cls(array, name=name)

    # -- metadata -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[Dim, ...] | None:
        """The concrete shape once computed; before that the declared (maybe symbolic) shape."""
        if self._future.done() and not self._future.failed():
            value = self._value_or_none()
            if value is not None:
                return tuple(value.shape)
        return self._declared_shape

    @property
    def dtype(self) -> np.dtype | None:
        """The element type: declared by the model, or the computed value's once known."""
        if self._declared_dtype is not None:
            return self._declared_dtype
        value = self._value_or_none() if self._future.done() and not self._future.failed() else None
        return None if value is None else value.dtype

    @property
    def state(self) -> TensorState:
        """Pending while its layer computes; then ready or failed; disposed after
        [`dispose`][asyncinfer.Tensor.dispose]."""
        if self._disposed:
            return TensorState.DISPOSED
        if not self._future.done():
            return TensorState.PENDING
        return TensorState.FAILED if self._future.failed() else TensorState.READY

    @property
    def is_pending(self) -> bool:
        """True while the layer producing this tensor has not finished."""
        return not self._future.done()

    def _value_or_none(self) -> Any:
        values = self._future.peek()
        return None if values is None else values[self._index]

    # -- readback -------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._disposed:
            raise DisposedError(f"tensor {self.name!r} was disposed")
        owner = self._owner
        if owner is not None and owner.disposed:
            raise DisposedError(f"tensor {self.name!r} belongs to a disposed worker; "
                                "use take_output() or readback_and_clone() to keep outputs")

    def _readback_future(self) -> TaskFuture:
        """The download of this tensor to host memory, started on first use."""
        with self._lock:
            if self._readback is None:
                self._readback = self._start_readback()
            return self._readback

    def _start_readback(self) -> TaskFuture:
        if self._device is None:
            # Host memory already: the readback is complete when the layer is.
            return self._future
        # A device value: once the layer is done, the device copies it to the host and completes
        # the readback from its own fence/event. Nothing here waits.
        readback = TaskFuture(label=f"readback {self.name}")
        device, index = self._device, self._index

        def downloaded(download: TaskFuture) -> None:
            if download.failed():
                readback.set_exception(download.exception())  # type: ignore[arg-type]
            else:
                readback.set_result(download.peek())

        def computed(layer: TaskFuture) -> None:
            if layer.failed():
                readback.set_exception(layer.exception())  # type: ignore[arg-type]
                return
            try:
                device.start_download(layer.peek()[index]).add_done_callback(downloaded)
            except Exception as exc:  # noqa: BLE001 - e.g. the device was closed
                readback.set_exception(exc)

        self._future.add_done_callback(computed)
        return readback

    def _host_value(self, fut: TaskFuture) -> Any:
        """The host value a completed readback future carries."""
        return fut.peek()[self._index] if fut is self._future else fut.peek()

    def readback_request(self, callback: ReadbackCallback | None = None) -> None:
        """Start a non-blocking download; ``callback(success)`` runs when it is done.

        The callback runs on the event loop that was running when the request was made (via a
        thread-safe call), or, outside any loop, on the thread that completes the readback.
        """
        self._check_alive()
        fut = self._readback_future()
        if callback is None:
            return
        dispatch = loop_dispatcher()

        def deliver(f: TaskFuture) -> None:
            ok = not f.failed()
            if dispatch is None:
                callback(ok)
            else:
                dispatch(callback, ok)

        fut.add_done_callback(deliver)

    def is_readback_request_done(self) -> bool:
        """Poll the readback (starting it if needed); once True, ``readback_and_clone()`` is immediate.

        A failed computation also counts as done: reading it back then raises its error.
        """
        self._check_alive()
        return self._readback_future().done()

    def _storage(self) -> TensorData:
        """Block until computed, then the backend storage; raises the computation's error."""
        self._check_alive()
        fut = self._readback_future()
        fut.wait()
        return self._storage_now(fut)

    def _storage_now(self, fut: TaskFuture) -> TensorData:
        if fut.failed():
            raise reraise(fut.exception(), self.name)
        return CPUTensorData(self._host_value(fut))

    def readback_and_clone(self) -> "Tensor":
        """Blocking: wait for the value and return a caller-owned CPU copy."""
        return Tensor(self._storage().download(), name=self.name)

    async def readback_and_clone_async(self) -> "Tensor":
        """Await the value without blocking the event loop; a caller-owned CPU copy."""
        self._check_alive()
        fut = self._readback_future()
        await wait_done(fut)
        self._check_alive()
        return Tensor(self._storage_now(fut).download(), name=self.name)

    def download_to_array(self) -> np.ndarray:
        """Blocking: a NumPy copy of the value."""
        return self._storage().download()

    @property
    def data_on_backend(self) -> TensorData:
        """The storage on the backend; its ``download()`` waits for the value and copies it."""
        self._check_alive()
        fut = self._future
        if fut.done():
            if self._device is not None and not fut.failed():
                return fut.peek()[self._index]  # the device storage itself
            return self._storage_now(fut)
        return _PendingData(self)

    def numpy(self) -> np.ndarray:
        """Blocking: the value as a NumPy array (a copy for worker-owned tensors)."""
        if self._owner is None and self._device is None and self._future.done() and not self._future.failed():
            self._check_alive()
            return self._future.peek()[self._index]
        return self.download_to_array()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    def dispose(self) -> None:
        """Release the tensor's storage; later use raises DisposedError."""
        self._disposed = True
        self._future = TaskFuture.completed(None, label=self.name)
        self._readback = None

    @property
    def disposed(self) -> bool:
        """True after [`dispose`][asyncinfer.Tensor.dispose]; any further use raises
        [`DisposedError`][asyncinfer.DisposedError]."""
        return self._disposed

    def __repr__(self) -> str:
        dtype = "?" if self.dtype is None else self.dtype.name
        return f"<Tensor {self.name!r} {dtype}{list(self.shape or [])} on {self.backend}, {self.state.value}>"


def reraise(error: BaseException | None, name: str) -> AsyncInferError:
    """A fresh error for this reader (the original is shared by every dependent tensor)."""
    if isinstance(error, ExecutionError):
        fresh = ExecutionError(str(error), layer=error.layer, op_type=error.op_type)
    elif isinstance(error, AsyncInferError):
        fresh = type(error)(str(error)) if type(error).__init__ is AsyncInferError.__init__ else error
    else:
        fresh = ExecutionError(f"computing tensor {name!r} failed: {error!r}")
    if fresh is not error:
        fresh.__cause__ = error
    return fresh
