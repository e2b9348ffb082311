"""The CPU backend: NumPy kernels on a thread pool, driven by dependency callbacks.

No thread ever waits for another: a layer is handed to the pool only once its inputs are done.
When a finishing layer makes others ready, the finishing thread keeps the first of them and
runs it next (no pool hand-off, so a chain of small layers costs little), and hands the rest
to the pool, where idle threads pick independent branches up in parallel.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ...errors import DisposedError
from ...model.ir import Layer
from ..base import Backend

if TYPE_CHECKING:
    from ...runtime.execution import Execution, Step


class CPUBackend(Backend):
    """Thread-pool executor of the NumPy kernels (``threads`` defaults to the core count)."""

    name = "cpu"

    def __init__(self, threads: int | None = None):
        self.threads = max(1, threads or os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="asyncinfer-cpu")
        self._local = threading.local()
        self._closed = False

    def supports(self, layer: Layer) -> bool:
        return True  # the op registry is the CPU backend's kernel table; load_model checked support

    def dispatch(self, execution: "Execution", step: "Step") -> None:
        chain = getattr(self._local, "chain", None)
        if chain is not None:  # called while this pool thread finishes a layer: keep the work here
            chain.append((execution, step))
            return
        self._submit(execution, step)

    def _submit(self, execution: "Execution", step: "Step") -> None:
        try:
            self._pool.submit(self._run_chain, execution, step)
        except RuntimeError:  # pool shut down by dispose()
            execution.fail_step(step, DisposedError("the worker was disposed before this layer could run"))

    def _run_chain(self, execution: "Execution", step: "Step") -> None:
        chain: list = []
        self._local.chain = chain
        try:
            execution.run_step(step)
            while chain:
                (execution, step), rest = chain[0], chain[1:]
                chain.clear()
                for other in rest:
                    self._submit(*other)
                execution.run_step(step)
        finally:
            self._local.chain = None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True, cancel_futures=False)
