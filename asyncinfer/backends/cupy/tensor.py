"""The storage of a tensor on the gpu_compute backend: a device array and the backend owning it."""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ...tensor import TensorData


class _Owner(Protocol):
    """The backend holding a value (the CuPy backend): it describes its device and downloads."""

    description: str

    def download_blocking(self, value: "DeviceTensorData") -> np.ndarray: ...


class DeviceTensorData(TensorData):
    """A value in device memory. Its buffer returns to CuPy's memory pool when the last reference
    (this object, or a view made from it) is dropped."""

    backend = "gpu_compute"
    __slots__ = ("array", "_owner")

    def __init__(self, array: Any, owner: _Owner):
        self.array = array
        self._owner = owner

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.array.shape)

    @property
    def ndim(self) -> int:
        return len(self.array.shape)

    @property
    def size(self) -> int:
        """The element count (what a CPU Shape/Size layer reads of a device value, never downloading it)."""
        return int(self.array.size)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.array.dtype)

    def download(self) -> np.ndarray:
        """Blocking: copy the value to the host (a NumPy array). Not callable on the dispatcher thread."""
        return self._owner.download_blocking(self)

    def __repr__(self) -> str:
        return f"<DeviceTensorData {self.dtype.name}{list(self.shape)} on {self._owner.description}>"
