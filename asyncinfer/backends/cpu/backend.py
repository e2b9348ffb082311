"""The CPU backend: NumPy kernels on a thread pool, driven by dependency callbacks.

No thread ever waits for another: a layer is handed to the pool only once its inputs are done.
When a finishing layer makes others ready, the finishing thread keeps the first of them and
runs it next (no pool hand-off, so a chain of small layers costs little), and hands the rest
to the pool, where idle threads pick independent branches up in parallel.

GEMM-based kernels (``Op.multithreaded``) already spread over every core inside BLAS; two of
them at once would only oversubscribe the cores (measured: Inception-v2 runs 30% slower). They
go through a *lane*: one runs at a time, later ones queue (without blocking any thread) and are
picked up by the thread that finishes the current one. Light kernels still run beside them.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from ...errors import DisposedError
from ...model.ir import Layer
from ..base import Backend, ValueTypes
from .memory import tune_allocator

if TYPE_CHECKING:
    from ...runtime.execution import Execution, Step

Task = tuple["Execution", "Step"]


def _quiet_floating_point() -> None:
    """Pool threads compute ONNX semantics: inf and nan are results, not warnings (set once per thread)."""
    np.seterr(all="ignore")


class CPUBackend(Backend):
    """Thread-pool executor of the NumPy kernels (``threads`` defaults to the core count)."""

    name = "cpu"

    def __init__(self, threads: int | None = None):
        self.threads = max(1, threads or os.cpu_count() or 1)
        tune_allocator()
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="asyncinfer-cpu",
                                        initializer=_quiet_floating_point)
        self._local = threading.local()
        self._closed = False
        self._lane_lock = threading.Lock()
        self._lane_busy = False
        self._lane_queue: deque[Task] = deque()

    def supports(self, layer: Layer, types: ValueTypes) -> bool:
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
        chain: list[Task] = []
        self._local.chain = chain
        try:
            self._execute(execution, step)
            while chain:
                (execution, step), rest = chain[0], chain[1:]
                chain.clear()
                for other in rest:
                    self._submit(*other)
                self._execute(execution, step)
        finally:
            self._local.chain = None

    def _execute(self, execution: "Execution", step: "Step") -> None:
        if not step.op.multithreaded or self.threads == 1:
            execution.run_step(step)
            return
        with self._lane_lock:
            if self._lane_busy:
                self._lane_queue.append((execution, step))  # the lane holder will run it
                return
            self._lane_busy = True
        task: Task | None = (execution, step)
        while task is not None:
            task[0].run_step(task[1])
            with self._lane_lock:
                task = self._lane_queue.popleft() if self._lane_queue else None
                self._lane_busy = task is not None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True, cancel_futures=False)
