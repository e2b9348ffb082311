"""What a backend provides to the runtime."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from ..model.ir import Layer

if TYPE_CHECKING:
    from ..runtime.execution import Execution, Step


class Backend(ABC):
    """Runs layers whose inputs are ready. One backend instance belongs to one worker."""

    name: str = ""

    @abstractmethod
    def supports(self, layer: Layer) -> bool:
        """Whether this backend has a kernel for ``layer`` (else it falls back to the CPU)."""

    @abstractmethod
    def dispatch(self, execution: "Execution", step: "Step") -> None:
        """Run ``step`` of ``execution`` soon; its inputs are all complete. Must not block."""

    @abstractmethod
    def close(self) -> None:
        """Release threads and device resources; waits for kernels already running."""
