"""``Worker``: runs a model on a backend (Sentis's ``Worker``), with sync and async lifecycles."""
from __future__ import annotations

import enum
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio.lowlevel
import numpy as np

from ..backends import Backend, BackendType, CPUBackend, create_backend, parse_backend_type
from ..errors import AsyncInferError, DisposedError
from ..model.ir import Model
from ..tensor import Tensor
from .execution import Execution
from .inputs import bind_inputs, example_inputs
from .plan import Placement, Plan


class WorkerState(enum.Enum):
    """A worker's lifecycle: open until :meth:`Worker.dispose`, then disposed for good."""

    OPEN = "open"
    DISPOSED = "disposed"


class Worker:
    """Runs ``model`` on ``backend``; layers the backend lacks fall back to the CPU.

    Scheduling returns at once; outputs are read back when the caller awaits, polls or is called
    back. ``run`` is safe to call concurrently: each call has its own task graph.

    Args:
        model: a model from :func:`asyncinfer.load_model`.
        backend: a :class:`BackendType` or its name (``"cpu"``, ``"gpu_compute"``, ``"gpu_pixel"``),
            or a backend instance built with options (e.g. ``CuPyBackend(device_id=1)``); the worker
            owns it from then on and closes it when disposed.
        threads: CPU thread-pool size (default: the core count).
        warmup: run the model once now, on inputs built from its declared shapes, so the first
            real request runs at steady-state speed (this blocks; see :meth:`warmup`).

    Raises:
        BackendUnavailableError: the backend cannot run on this machine (says what is missing).
    """

    def __init__(self, model: Model, backend: BackendType | str | Backend = BackendType.CPU, *,
                 threads: int | None = None, warmup: bool = False):
        self.model = model
        if isinstance(backend, Backend):
            self.backend_type = parse_backend_type(backend.name)
            self._backend = backend
        else:
            self.backend_type = parse_backend_type(backend)
            self._backend = create_backend(self.backend_type, threads=threads)
        self._fallback = None if isinstance(self._backend, CPUBackend) else CPUBackend(threads)
        try:
            self._plan = Plan(model, self._backend, self._fallback)
        except BaseException:
            self._close_backends()
            raise
        self._latest: Execution | None = None
        self._owned_runs: weakref.WeakSet[Execution] = weakref.WeakSet()
        self._state_lock = threading.Lock()
        self._state = WorkerState.OPEN
        if warmup:
            self.warmup_blocking()

    # -- introspection -------------------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        """Which backend runs each layer, the CPU-fallback layers and the transfers they cost."""
        return self._plan.placement

    @property
    def state(self) -> WorkerState:
        """Where the worker is in its lifecycle."""
        return self._state

    @property
    def disposed(self) -> bool:
        """True once :meth:`dispose` (or :meth:`dispose_async`) ran; the worker then refuses all calls."""
        return self._state is WorkerState.DISPOSED

    def _check_open(self) -> None:
        if self._state is WorkerState.DISPOSED:
            raise DisposedError("this worker was disposed")

    # -- scheduling -----------------------------------------------------------------------------------
    def schedule(self, *inputs: Any, **named: Any) -> Execution:
        """Schedule a run and return at once.

        Inputs are positional in model order, one mapping ``{name: array | Tensor}``, or keywords.
        They are checked against the model's declared (symbolic) shapes before anything is scheduled.

        Raises:
            InputError: a missing, extra, wrongly typed or wrongly shaped input.
        """
        execution = self._new_execution(inputs, named)
        execution.submit_all()
        self._latest = execution
        return execution

    def schedule_iterable(self, *inputs: Any, **named: Any) -> Iterator[str]:
        """Schedule one layer per step, yielding the name of the layer just scheduled.

        Inputs are checked when this is called, before the first step. Outputs can be peeked once
        the iteration is over.
        """
        execution = self._new_execution(inputs, named)

        def steps() -> Iterator[str]:
            self._latest = execution
            for step in execution.submit_iter():
                yield step.layer.name

        return steps()

    def schedule_iterable_async(self, *inputs: Any, **named: Any) -> AsyncIterator[str]:
        """Async form of :meth:`schedule_iterable`: ``async for name in ...`` schedules one layer
        per step and lets the event loop run other tasks between layers. Stopping early (``break``,
        cancellation) fails the layers never scheduled, so no output is left pending forever."""
        execution = self._new_execution(inputs, named)

        async def steps() -> AsyncIterator[str]:
            self._latest = execution
            iterator = execution.submit_iter()
            try:
                for step in iterator:
                    yield step.layer.name
                    await anyio.lowlevel.checkpoint()
            finally:
                iterator.close()

        return steps()

    def _new_execution(self, inputs: tuple, named: dict) -> Execution:
        self._check_open()
        futures = bind_inputs(self.model, inputs, named)
        return Execution(self._plan, futures, worker=self)

    def _latest_execution(self) -> Execution:
        self._check_open()
        if self._latest is None:
            raise AsyncInferError("nothing scheduled yet: call schedule() first")
        return self._latest

    def peek_output(self, name: str | None = None) -> Tensor:
        """An output of the latest ``schedule`` (the first by default), possibly pending.

        It belongs to the worker: valid until the worker's next ``schedule`` or its disposal.
        """
        return self._latest_execution().peek_output(name)

    def take_output(self, name: str | None = None) -> Tensor:
        """Like ``peek_output``, but the caller owns the tensor (it survives the worker)."""
        return self._latest_execution().take_output(name)

    async def run(self, *inputs: Any, **named: Any) -> dict[str, np.ndarray]:
        """Schedule a run, await every output without blocking the loop, and return them as arrays.

        Cancelling the awaiting task skips the layers that have not started.
        """
        execution = self._new_execution(inputs, named)
        execution.submit_all()
        try:
            return await execution.read_outputs()
        except BaseException:
            execution.cancel()
            raise

    def run_blocking(self, *inputs: Any, **named: Any) -> dict[str, np.ndarray]:
        """Blocking twin of :meth:`run`: waits on the calling thread. Do not call it on an event loop."""
        execution = self._new_execution(inputs, named)
        execution.submit_all()
        outputs = {}
        for info in self.model.outputs:
            outputs[info.name] = execution.take_output(info.name).download_to_array()
        return outputs

    async def warmup(self, *inputs: Any, **named: Any) -> None:
        """Run the model once and discard the result, so the first real request finds the thread
        pool started, the allocator's pages warm and the kernels' scratch buffers made.

        With no inputs, zeros of each input's declared shape are used (a symbolic or unknown
        dimension counts as 1); give example inputs for models whose layers depend on input values.

        Raises:
            InputError: the example inputs do not fit the model.
            ExecutionError: the model failed on them (give example inputs that it accepts).
        """
        await self.run(*(inputs or (example_inputs(self.model),)), **named)

    def warmup_blocking(self, *inputs: Any, **named: Any) -> None:
        """Blocking twin of :meth:`warmup`. Do not call it on an event loop."""
        self.run_blocking(*(inputs or (example_inputs(self.model),)), **named)

    # -- lifecycle ------------------------------------------------------------------------------------
    def dispose(self) -> None:
        """Stop the worker: threads end and worker-owned outputs are released.

        Layers of the latest run that have not started are skipped, unless the caller took one of
        its outputs with ``take_output``: runs with caller-owned outputs are finished first, so
        nothing the caller owns is lost (this may block until they complete; :meth:`dispose_async`
        waits on a helper thread instead).
        """
        with self._state_lock:
            if self._state is WorkerState.DISPOSED:
                return
            self._state = WorkerState.DISPOSED
            owned = list(self._owned_runs)
        if self._latest is not None and not self._latest.has_taken_outputs:
            self._latest.cancel()
        self._latest = None
        for execution in owned:
            execution.wait_blocking()
        self._close_backends()

    def _keep_until_done(self, execution: Execution) -> None:
        """Remember a run with caller-owned outputs: disposal finishes it instead of cancelling it."""
        with self._state_lock:
            self._owned_runs.add(execution)

    def _close_backends(self) -> None:
        self._backend.close()
        if self._fallback is not None:
            self._fallback.close()

    async def dispose_async(self) -> None:
        """Awaitable twin of :meth:`dispose`: never blocks the event loop (threads are joined on a
        helper thread)."""
        import anyio.to_thread

        await anyio.to_thread.run_sync(self.dispose)

    async def aclose(self) -> None:
        """Deprecated alias of :meth:`dispose_async` (removed in the next release)."""
        warnings.warn("Worker.aclose() is deprecated: use `await worker.dispose_async()`",
                      DeprecationWarning, stacklevel=2)
        await self.dispose_async()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.dispose()

    async def __aenter__(self) -> "Worker":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.dispose_async()

    def __repr__(self) -> str:
        return (f"<Worker {self.model.name!r} on {self.backend_type.value}, {len(self._plan.nodes)} layers, "
                f"{self._state.value}>")
