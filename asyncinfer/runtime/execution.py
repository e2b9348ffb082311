"""One scheduled run of a model: a future per layer, wired by dependency callbacks."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..backends.base import DeviceBackend
from ..errors import AsyncInferError, DisposedError, ExecutionError
from ..tensor import Tensor
from .bridge import wait_done
from .future import TaskFuture
from .plan import Plan, Step

if TYPE_CHECKING:
    from .worker import Worker


class _Released:
    """Marks a value freed after its last reader (None is a legitimate value: an empty optional)."""

    def __repr__(self) -> str:
        return "<released>"


RELEASED = _Released()


class Execution:
    """The task graph of one ``schedule`` call. Its layers run as their inputs become ready."""

    def __init__(self, plan: Plan, inputs: dict[str, TaskFuture], worker: "Worker | None" = None):
        self.plan = plan
        self.worker = worker
        n_layers = len(plan.steps)
        self.futures: list[TaskFuture | None] = [None] * plan.n_sources
        for name, source in plan.input_sources.items():
            self.futures[source] = inputs[name]
        self.futures[n_layers + len(plan.input_sources):] = plan.constant_futures
        self._missing = [0] * n_layers
        self._readers = dict(plan.reader_counts)
        self._lock = threading.Lock()
        self._cancelled = False
        self._submitted = 0
        self._outputs: dict[str, Tensor] = {}
        self._taken: set[str] = set()
        self._taken_tensors: list[Tensor] = []

    # -- scheduling ----------------------------------------------------------------------------------
    def submit_all(self) -> "Execution":
        for _ in self.submit_iter():
            pass
        return self

    def submit_iter(self) -> Iterator[Step]:
        """Submit the layers in order, yielding after each (Sentis's ``ScheduleIterable``).

        If the iteration stops early (``break``, an exception, garbage collection), the layers not
        yet submitted fail at once, so nothing waits forever on an output that will never come.
        """
        try:
            for step in self.plan.steps:
                self._submit(step)
                yield step
        finally:
            self.abandon_unsubmitted()

    def abandon_unsubmitted(self) -> None:
        """Fail every layer not submitted yet (and with it everything downstream)."""
        for step in self.plan.steps[self._submitted:]:
            fut = TaskFuture(label=step.layer.name)
            self.futures[step.index] = fut
            fut.set_exception(ExecutionError(
                f"{step.layer.describe()} was never scheduled: the schedule_iterable loop stopped before it",
                layer=step.layer.name, op_type=step.layer.op_type))
        self._submitted = len(self.plan.steps)

    def _submit(self, step: Step) -> None:
        fut = TaskFuture(label=step.layer.name)
        self.futures[step.index] = fut
        self._submitted += 1
        deps = [self.futures[s] for s in step.sources]
        pending = [d for d in deps if not d.done()]  # type: ignore[union-attr]
        if not pending:
            self._ready(step)
            return
        self._missing[step.index] = len(pending)
        for dep in pending:
            dep.add_done_callback(lambda _f, step=step: self._input_done(step))  # type: ignore[union-attr]

    def _input_done(self, step: Step) -> None:
        with self._lock:
            self._missing[step.index] -= 1
            ready = self._missing[step.index] == 0
        if ready:
            self._ready(step)

    def _ready(self, step: Step) -> None:
        for ref in step.inputs:
            if ref is not None:
                dep = self.futures[ref[0]]
                if dep.failed():  # type: ignore[union-attr]
                    self.fail_step(step, dep.exception())  # type: ignore[union-attr,arg-type]
                    return
        if self._cancelled:
            self.fail_step(step, ExecutionError(f"run cancelled before {step.layer.describe()} started",
                                                layer=step.layer.name, op_type=step.layer.op_type))
            return
        step.backend.dispatch(self, step)

    # -- running (called by backends, on their threads) --------------------------------------------
    def run_step(self, step: Step) -> None:
        """Run a ready step's host kernel and complete its future. Never raises."""
        args = self.begin_step(step)
        if args is None:
            return
        try:
            # (backend threads run with NumPy's floating-point warnings off: inf/nan are values in ONNX)
            outputs = list(step.op(*args))  # type: ignore[misc]
            if step.activations:
                outputs[0] = _apply_activations(step, outputs[0], args)
        except Exception as exc:  # noqa: BLE001 - any kernel failure becomes an ExecutionError
            self.fail_step(step, self.kernel_error(step, exc, args))
            return
        self.end_step(step, outputs)

    def begin_step(self, step: Step) -> list | None:
        """The input values of a ready step, or None if the step was failed instead (its run was
        cancelled, or an input was released). Device backends call this, run their kernel, then
        :meth:`end_step` (or :meth:`fail_step` with :meth:`kernel_error`)."""
        if self._cancelled:
            self.fail_step(step, ExecutionError(f"run cancelled before {step.layer.describe()} started",
                                                layer=step.layer.name, op_type=step.layer.op_type))
            return None
        args = [None if r is None else self.futures[r[0]].peek()[r[1]] for r in step.inputs]  # type: ignore[union-attr]
        if any(a is RELEASED for a in args):
            self.fail_step(step, DisposedError(
                "an input of this layer was released (the worker or a tensor was disposed)"))
            return None
        return args

    def end_step(self, step: Step, outputs: list) -> None:
        """Complete a step with its output values (host arrays or device values)."""
        if len(outputs) < step.n_outputs:
            self.fail_step(step, self.kernel_error(step, ValueError(
                f"kernel returned {len(outputs)} outputs for {len(step.layer.outputs)}"), []))
            return
        self._release_inputs(step)
        self.futures[step.index].set_result(outputs)  # type: ignore[union-attr]

    @staticmethod
    def kernel_error(step: Step, exc: BaseException, args: list) -> BaseException:
        """The error a failed kernel reports: an ExecutionError naming the layer and op."""
        return _execution_error(step, exc, args)  # type: ignore[arg-type]

    def fail_step(self, step: Step, error: BaseException) -> None:
        self._release_inputs(step)
        self.futures[step.index].set_exception(error)  # type: ignore[union-attr]

    def _release_inputs(self, step: Step) -> None:
        if not step.release:
            return
        with self._lock:
            for ref in step.release:
                left = self._readers[ref] - 1
                self._readers[ref] = left
                if left == 0:
                    values = self.futures[ref[0]].peek()  # type: ignore[union-attr]
                    if values is not None:
                        values[ref[1]] = RELEASED

    def layer_future(self, layer: str) -> TaskFuture:
        """The future of one layer of this run (its value: the list of the layer's outputs)."""
        for step in self.plan.steps:
            if step.layer.name == layer:
                future = self.futures[step.index]
                if future is None:
                    raise AsyncInferError(f"layer {layer!r} is not scheduled yet")
                return future
        raise AsyncInferError(f"the model has no layer {layer!r} (layers are listed in worker.placement)")

    def cancel(self) -> None:
        """Skip every layer that has not started; started kernels finish and are discarded."""
        self._cancelled = True

    # -- outputs ---------------------------------------------------------------------------------
    def _tensor(self, name: str, owner: Any) -> Tensor:
        ref = self.plan.refs[name]
        info = next(o for o in self.plan.model.outputs if o.name == name)
        future = self.futures[ref[0]]
        if future is None:
            raise AsyncInferError(f"output {name!r} is not scheduled yet (schedule_iterable not finished)")
        backend = self.plan.steps[ref[0]].backend if ref[0] < len(self.plan.steps) else None
        on_device = isinstance(backend, DeviceBackend)
        return Tensor(_future=future, _index=ref[1], name=name, _shape=info.shape, _dtype=info.dtype,
                      _backend=backend.name if backend is not None else "cpu",
                      _device=backend if on_device else None, _owner=owner)

    def _output_name(self, name: str | None) -> str:
        names = [o.name for o in self.plan.model.outputs]
        if name is None:
            return names[0]
        if name not in names:
            raise AsyncInferError(f"model has no output {name!r}; outputs are {names}")
        return name

    def peek_output(self, name: str | None = None) -> Tensor:
        """The (possibly pending) output tensor; it belongs to the worker."""
        name = self._output_name(name)
        if name not in self._outputs:
            self._outputs[name] = self._tensor(name, self.worker)
        return self._outputs[name]

    def take_output(self, name: str | None = None) -> Tensor:
        """The output tensor, owned by the caller: it stays valid after the worker is disposed
        (disposal lets a run whose outputs were taken finish first)."""
        name = self._output_name(name)
        self._taken.add(name)
        if self.worker is not None:
            self.worker._keep_until_done(self)
        tensor = self._tensor(name, None)
        self._taken_tensors.append(tensor)
        return tensor

    @property
    def has_taken_outputs(self) -> bool:
        """True once ``take_output`` handed one of this run's outputs to the caller."""
        return bool(self._taken)

    def wait_blocking(self, timeout: float | None = None) -> bool:
        """Block until every output is computed or failed, and the outputs taken by the caller are
        on the host (a device is closed after this); True if all are done."""
        for ref in self.plan.output_refs:
            fut = self.futures[ref[0]]
            if fut is None or not fut.wait(timeout):
                return False
        return all(t.disposed or t._readback_future().wait(timeout) for t in self._taken_tensors)

    @property
    def outputs(self) -> dict[str, Tensor]:
        """Every output of this run by name (peeked: they belong to the worker)."""
        return {o.name: self.peek_output(o.name) for o in self.plan.model.outputs}

    def done(self) -> bool:
        """True once every output is computed (or failed)."""
        return all(self.futures[r[0]] is not None and self.futures[r[0]].done() for r in self.plan.output_refs)  # type: ignore[union-attr]

    async def wait(self) -> None:
        """Await every output (never blocks the loop); raises the first failure."""
        for ref in self.plan.output_refs:
            fut = self.futures[ref[0]]
            await wait_done(fut)  # type: ignore[arg-type]
            if fut.failed():  # type: ignore[union-attr]
                from ..tensor import _reraise

                raise _reraise(fut.exception(), "output")  # type: ignore[union-attr]

    async def read_outputs(self) -> dict[str, np.ndarray]:
        """Await every output and its download to the host (never blocks the loop); caller-owned
        NumPy arrays by name. Raises the first failure."""
        tensors = [self._tensor(info.name, None) for info in self.plan.model.outputs]
        for tensor in tensors:
            await wait_done(tensor._readback_future())
        return {t.name: t._storage_now(t._readback_future()).download() for t in tensors}

    def output_arrays(self) -> dict[str, np.ndarray]:
        """Blocking: the outputs as caller-owned NumPy arrays (downloaded from a device if needed)."""
        return {info.name: self._tensor(info.name, None).download_to_array() for info in self.plan.model.outputs}


def _apply_activations(step: Step, y: np.ndarray, args: list) -> np.ndarray:
    """Run the fused activations on ``y``, in place when ``y`` is a buffer the kernel just made."""
    fresh = (isinstance(y, np.ndarray) and y.flags.writeable and y.dtype.kind == "f"
             and not any(isinstance(a, np.ndarray) and np.may_share_memory(y, a) for a in args))
    for act, extra in step.activations:
        y = act.run_inplace(y, *extra) if fresh else act(y, *extra)[0]
        fresh = True
    return y


def _execution_error(step: Step, exc: Exception, args: list) -> BaseException:
    if isinstance(exc, AsyncInferError) and not isinstance(exc, ExecutionError):
        return exc
    layer = step.layer
    seen = ", ".join("None" if a is None else f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', []))}"
                     for a in args)
    return ExecutionError(f"{layer.describe()} failed: {type(exc).__name__}: {exc} (inputs: {seen})",
                          layer=layer.name, op_type=layer.op_type)
