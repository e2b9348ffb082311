"""One scheduled run of a model: a future per layer, wired by dependency callbacks."""
from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from ..backends.base import HOST, StepKind, kernel_error, run_kernel
from ..concurrency.bridge import wait_done
from ..concurrency.future import TaskFuture
from ..errors import AsyncInferError, DisposedError, ExecutionError
from ..tensor import Tensor, copy_value, reraise
from .handover import sole_array
from .plan import Node, Plan, Segment
from .profiling import RunRecorder


class Owner(Protocol):
    """The worker a run belongs to (the Worker, which creates runs): its peeked outputs check
    ``disposed``, and runs whose outputs the caller took are kept until done."""

    @property
    def disposed(self) -> bool: ...

    def _keep_until_done(self, execution: "Execution") -> None: ...


class _Released:
    """Marks a value freed after its last reader (None is a legitimate value: an empty optional)."""

    def __repr__(self) -> str:
        return "<released>"


RELEASED = _Released()


class _Lazy:
    """Marks the future of a segment-private step (`Segment.private`) in a run's list of futures:
    submitted, its future made only if someone asks (`Execution.step_future`)."""

    def __repr__(self) -> str:
        return "<made on demand>"


LAZY = _Lazy()


@functools.lru_cache(maxsize=64)
def _lazies(count: int) -> list[_Lazy]:
    """``count`` LAZY marks, to assign to a slice of a run's futures (read only)."""
    return [LAZY] * count


class _Failure:
    """A failed step's entry in a run's list of values (None: not done yet)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class _StepDone:
    """How a backend reports one dispatched step of this run (the ``StepDone`` of backends/base).

    Its methods do the execution's work inline: they run once per layer per run, on the hot path.
    """

    __slots__ = ("_execution", "_node", "_last")

    def __init__(self, execution: "Execution", node: Node, last: bool = False):
        self._execution = execution
        self._node = node
        self._last = last  # the last step of a job: its backend hears `job_finishing` first

    def begin(self) -> bool:
        if not self._execution._cancelled:
            return True
        self.fail(self._execution._cancelled_error(self._node))
        return False

    def __call__(self, outputs: list) -> None:
        execution, node = self._execution, self._node
        if node.release:
            execution._release_inputs(node)
        if self._last:
            node.backend.job_finishing(execution.serial)
        # The value first, then the future if there is one (`Execution.step_future` makes one
        # concurrently in the other order: one of the two completes it, or both, harmlessly)
        execution.values[node.index] = outputs
        future = execution.futures[node.index]
        if future is not LAZY:
            future.set_result(outputs)  # type: ignore[union-attr]

    def fail(self, error: BaseException) -> None:
        execution, node = self._execution, self._node
        if node.release:
            execution._release_inputs(node)
        execution.values[node.index] = _Failure(error)
        future = execution.futures[node.index]
        if future is not LAZY:
            future.set_exception(error)  # type: ignore[union-attr]

    def cancelled(self) -> bool:
        return self._execution._cancelled

    @property
    def serial(self) -> bool:
        return self._execution.serial


class _ProfiledStepDone(_StepDone):
    """A step completion that also records the step (queued, start, end, thread) for a profile.
    Profiled runs use it instead of `_StepDone`: unprofiled runs pay nothing per step."""

    __slots__ = ("_queued", "_start", "_thread")

    def __init__(self, execution: "Execution", node: Node, last: bool = False):
        self._execution = execution
        self._node = node
        self._last = last
        # The first layer of a segment was queued when its job was; any other step, now.
        self._queued = execution._queued.pop(node.index, 0) or time.perf_counter_ns()
        self._start = 0
        self._thread: threading.Thread | None = None

    def begin(self) -> bool:
        if not _StepDone.begin(self):
            return False
        self._thread = threading.current_thread()
        self._start = time.perf_counter_ns()
        return True

    def __call__(self, outputs: list) -> None:
        self._record(outputs, False)  # before the future completes: awaiting outputs sees the record
        _StepDone.__call__(self, outputs)

    def fail(self, error: BaseException) -> None:
        if self._start:  # a step that never began (cancelled, failed input) did not run: no slice
            self._record((), True)
        _StepDone.fail(self, error)

    def _record(self, outputs: list | tuple, failed: bool) -> None:
        end = time.perf_counter_ns()
        execution, node = self._execution, self._node
        step, layer = node.step, node.layer
        nbytes = 0
        if step.kind is StepKind.UPLOAD:  # its input is still held: released after this
            ref = node.inputs[0]
            nbytes = getattr(execution.values[ref[0]][ref[1]], "nbytes", 0)
        elif step.kind is StepKind.DOWNLOAD and outputs:
            nbytes = getattr(outputs[0], "nbytes", 0)
        shapes = tuple(s for s in (getattr(o, "shape", None) for o in outputs) if isinstance(s, tuple))
        execution._recorder.record(layer.name, layer.kind, node.backend.name, step.kind.value,  # type: ignore[union-attr]
                                   self._queued, self._start, end, self._thread, nbytes, failed, shapes)  # type: ignore[arg-type]


class _SegmentJob:
    """A segment of one run, as the backend's job: its steps in order on the job's thread, each
    completing its own layer future (so every layer stays observable)."""

    __slots__ = ("_execution", "segment")

    def __init__(self, execution: "Execution", segment: Segment):
        self._execution = execution
        self.segment = segment

    def run(self) -> None:
        # The loop of Execution._arguments + dispatch + `backends.base.run_kernel`, unrolled for
        # speed: it runs per layer (a decode step runs ~350 of them), and a step of an unprofiled
        # run whose inputs are all there is computed here, without a `_StepDone` of its own.
        execution = self._execution
        futures, values = execution.futures, execution.values
        done_type = execution._done_type
        inline = done_type is _StepDone
        last = self.segment.nodes[-1]
        for node in self.segment.nodes:
            # (a loop, not a list comprehension and a second pass for RELEASED: 0.1 µs less a layer)
            args: list = []
            released = False
            try:
                for r in node.inputs:
                    if r is None:
                        args.append(None)
                        continue
                    value = values[r[0]][r[1]]  # type: ignore[index]
                    if value is RELEASED:
                        released = True
                    args.append(value)
            except TypeError:  # a failed input has no value: let the general path report it
                execution._arguments(node)
                continue
            compute = node.inline if inline else None
            if node.donated and execution.private and compute is not None:
                compute = node.donating
            if compute is not None and not released and not execution._cancelled:
                step = node.step
                try:
                    outputs = compute(args)
                    if len(outputs) < step.n_outputs:
                        raise ValueError(f"kernel returned {len(outputs)} outputs for {step.n_outputs}")
                except Exception as exc:  # noqa: BLE001 - any kernel failure becomes an ExecutionError
                    _StepDone(execution, node).fail(kernel_error(step, exc, args))
                    continue
                if node.release:  # (`_release_inputs`, its lock-free half here: it runs per layer)
                    for ref in node.release_sole:
                        read = values[ref[0]]
                        if type(read) is list:
                            read[ref[1]] = RELEASED
                    if node.release_shared:
                        execution._release_shared(node)
                if node is last:
                    node.backend.job_finishing(execution.serial)
                values[node.index] = outputs  # (`_StepDone.__call__`: the value, then the future)
                future = futures[node.index]
                if future is not LAZY:
                    future.set_result(outputs)  # type: ignore[union-attr]
                continue
            done = done_type(execution, node, node is last)
            if released:
                done.fail(DisposedError("an input of this layer was released (the worker or a tensor was disposed)"))
            else:
                self._run_step(node, args, done)

    @staticmethod
    def _run_step(node: Node, args: list, done: _StepDone) -> None:
        """A step that is not computed inline: its backend runs it (`run_kernel`: skipped if cancelled)."""
        node.backend.run_now(node.step, args, done)

    @property
    def serial(self) -> bool:
        return self._execution.serial

    def submit(self) -> None:
        """Hand the job to its backend (its sources are done)."""
        self.segment.nodes[0].backend.submit_job(self)

    def fail(self, error: BaseException) -> None:
        for node in self.segment.nodes:
            _StepDone(self._execution, node).fail(error)


class _ProfiledSegmentJob(_SegmentJob):
    """A segment job of a profiled run: its first layer's queue time starts when it is submitted."""

    __slots__ = ()

    def submit(self) -> None:
        self._execution._queued[self.segment.nodes[0].index] = time.perf_counter_ns()
        _SegmentJob.submit(self)

    @staticmethod
    def _run_step(node: Node, args: list, done: _StepDone) -> None:
        """Each step timed in the callable an unprofiled run computes it with (`Node.inline`, an
        op's `bound_run`), not the backend's general path: the LSTM VAD's reflect Pad read
        17.8 µs in a profile that way, 3.1 this way, and small layers looked slow."""
        compute = node.donating if node.donated and done._execution.private else node.inline
        if compute is None:
            node.backend.run_now(node.step, args, done)
        else:
            run_kernel(node.step, args, done, lambda _step, values: compute(values))


class Execution:
    """The task graph of one ``schedule`` call. Its layers run as their inputs become ready.

    Its life: ``submit_all``/``submit_iter`` give every step a future and wire it to its inputs'
    futures; a step whose inputs are done is *dispatched* to its backend with their values; the
    backend *begins* it (skipped if the run was cancelled), runs it and *ends* it (or fails it);
    ending releases values no later step reads and completes the step's future, which may make
    other steps ready. A failure completes the step's future with the error, and every step that
    reads it fails in turn when it becomes ready.
    """

    # Unprofiled runs: the plain step completion and segment job (a profiled run swaps them, so
    # the hot path has no "is it profiled?" test).
    _done_type: type[_StepDone] = _StepDone
    _job_type: type[_SegmentJob] = _SegmentJob
    _recorder: RunRecorder | None = None

    def __init__(self, plan: Plan, inputs: dict[str, TaskFuture], worker: Owner | None = None,
                 recorder: RunRecorder | None = None, serial: bool = False, private: bool = False,
                 signature: tuple | None = None):
        self.plan = plan
        self.worker = worker
        #: The input shapes and types (`specialise.signature`) where the worker computed them, else None.
        self.signature = signature
        #: Steps one after another, on the thread that made each ready where the backend can
        #: (`backends.base.Job.serial`): for runs whose parallel branches are too small to pay.
        self.serial = serial
        #: A run whose caller sees only its outputs (`Worker.run`, `run_blocking`), never this
        #: execution and its layers' futures: its steps may write over the values the plan gives
        #: them up (`Node.donated`).
        self.private = private
        n_steps = len(plan.nodes)
        # Per source (`plan.py`): its future (None: not submitted yet; LAZY: made on demand, see
        # `step_future`) and its list of values (None: not done yet; a `_Failure` if it failed),
        # which the steps read. The precomputed steps' are in place already (`submit_iter`
        # replaces them).
        self.futures: list[TaskFuture | _Lazy | None]
        self.futures, self.values = plan.run_state()
        for name, source in plan.input_sources.items():
            future = self.futures[source] = inputs[name]
            if future.done():
                self._input_arrived(source, future)
            else:  # (before any step's callback on it: the value is in place when they run)
                future.add_done_callback(functools.partial(self._input_arrived, source))
        self._missing = [0] * n_steps
        self._readers = dict(plan.reader_counts)
        self._lock = threading.Lock()
        self._futures_lock = threading.Lock()  # the lock this run's layer futures share
        self._cancelled = False
        self._submitted = 0
        self._outputs: dict[str, Tensor] = {}
        self._taken: set[str] = set()
        self._taken_tensors: list[Tensor] = []
        self._submitted_hooks: list[Callable[[], None]] = []
        if recorder is not None:
            self._recorder = recorder
            self._done_type, self._job_type = _ProfiledStepDone, _ProfiledSegmentJob
            self._queued: dict[int, int] = {}  # first layer of a segment -> when its job was submitted

    # -- scheduling ----------------------------------------------------------------------------------
    def submit_all(self) -> "Execution":
        """Submit every step: a segment of light layers (see ``Plan.segments``) as one job."""
        try:
            self._submitted += len(self.plan.precomputed_futures)  # in place (Plan.run_futures)
            for segment in self.plan.segments:
                if len(segment.nodes) == 1:
                    self._submit(segment.nodes[0])
                else:
                    self._submit_segment(segment)
        finally:
            self.abandon_unsubmitted()
            self._run_submitted_hooks()
        return self

    def _input_arrived(self, source: int, future: TaskFuture) -> None:
        """Model input ``source``'s future is done: its value (or failure) in the run's values."""
        self.values[source] = _Failure(future.exception()) if future.failed() else future.peek()  # type: ignore[arg-type]

    def on_submitted(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once every step has a future (after ``submit_all`` or ``submit_iter``)."""
        self._submitted_hooks.append(fn)

    def _run_submitted_hooks(self) -> None:
        hooks, self._submitted_hooks = self._submitted_hooks, []
        for fn in hooks:
            fn()

    def submit_iter(self) -> Iterator[Node]:
        """Submit the steps in order, yielding after each (Sentis's ``ScheduleIterable``).

        If the iteration stops early (``break``, an exception, garbage collection), the steps not
        yet submitted fail at once, so nothing waits forever on an output that will never come.
        """
        try:
            for node in self.plan.nodes:
                self._submit(node)
                yield node
        finally:
            self.abandon_unsubmitted()
            self._run_submitted_hooks()

    def abandon_unsubmitted(self) -> None:
        """Fail every step not submitted yet (and with it everything downstream)."""
        if self._submitted >= len(self.plan.nodes):
            return
        for node in self.plan.nodes:
            if self.futures[node.index] is not None:
                continue
            fut = TaskFuture(label=node.layer.name)
            error = ExecutionError(
                f"{node.layer.describe()} was never scheduled: the schedule_iterable loop stopped before it",
                layer=node.layer.name, op_type=node.layer.op_type)
            self.futures[node.index] = fut
            self.values[node.index] = _Failure(error)
            fut.set_exception(error)
        self._submitted = len(self.plan.nodes)

    def _submit(self, node: Node) -> None:
        fut = TaskFuture(node.layer.name, self._futures_lock)
        self.futures[node.index] = fut
        self._submitted += 1
        pending = [d for d in (self.futures[s] for s in node.sources) if not d.done()]  # type: ignore[union-attr]
        if not pending:
            self._ready(node)
            return
        self._missing[node.index] = len(pending)
        for dep in pending:
            dep.add_done_callback(lambda _f, node=node: self._input_done(node))  # type: ignore[union-attr]

    def _submit_segment(self, segment: Segment) -> None:
        futures, lock = self.futures, self._futures_lock
        for index, label in segment.labels:
            futures[index] = TaskFuture(label, lock)
        for start, stop in segment.private_spans:
            futures[start:stop] = _lazies(stop - start)
        self._submitted += len(segment.nodes)
        job = self._job_type(self, segment)
        pending = [d for d in [futures[s] for s in segment.sources] if not d.done()]  # type: ignore[union-attr]
        if not pending:
            job.submit()
            return
        first = segment.nodes[0].index
        self._missing[first] = len(pending)
        for dep in pending:
            dep.add_done_callback(lambda _f, job=job: self._segment_input_done(job))  # type: ignore[union-attr]

    def _segment_input_done(self, job: "_SegmentJob") -> None:
        first = job.segment.nodes[0]
        with self._lock:
            self._missing[first.index] -= 1
            ready = self._missing[first.index] == 0
        if ready:
            job.submit()

    def _input_done(self, node: Node) -> None:
        with self._lock:
            self._missing[node.index] -= 1
            ready = self._missing[node.index] == 0
        if ready:
            self._ready(node)

    def _ready(self, node: Node) -> None:
        """Every input of ``node`` is done: dispatch it to its backend with their values."""
        prepared = self._arguments(node)
        if prepared is not None:
            node.backend.dispatch(node.step, *prepared)

    def _arguments(self, node: Node) -> tuple[list, _StepDone] | None:
        """The input values of a ready ``node`` and its completion; None when the node is failed
        instead (a failed input, a cancelled run, a released value)."""
        done = self._done_type(self, node)
        values = self.values
        for ref in node.inputs:
            if ref is not None and type(values[ref[0]]) is _Failure:
                done.fail(values[ref[0]].error)  # type: ignore[union-attr]
                return None
        if self._cancelled:
            done.fail(self._cancelled_error(node))
            return None
        args = [None if r is None else values[r[0]][r[1]] for r in node.inputs]  # type: ignore[index]
        if any(a is RELEASED for a in args):
            done.fail(DisposedError("an input of this layer was released (the worker or a tensor was disposed)"))
            return None
        return args, done

    @staticmethod
    def _cancelled_error(node: Node) -> ExecutionError:
        return ExecutionError(f"run cancelled before {node.layer.describe()} started",
                              layer=node.layer.name, op_type=node.layer.op_type)

    def _release_inputs(self, node: Node) -> None:
        for ref in node.release_sole:  # this step is the value's only reader: nothing to count
            values = self.values[ref[0]]
            if type(values) is list:  # (not a failure)
                values[ref[1]] = RELEASED
        if node.release_shared:
            self._release_shared(node)

    def _release_shared(self, node: Node) -> None:
        """Count down the readers of the values ``node`` shares with other steps; release those
        it read last."""
        with self._lock:
            for ref in node.release_shared:
                left = self._readers[ref] - 1
                self._readers[ref] = left
                if left == 0:
                    values = self.values[ref[0]]
                    if type(values) is list:
                        values[ref[1]] = RELEASED

    def layer_future(self, layer: str) -> TaskFuture:
        """The future of one layer of this run (its value: the list of the layer's outputs)."""
        for node in self.plan.nodes:
            if node.layer.name == layer:
                future = self.step_future(node.index)
                if future is None:
                    raise AsyncInferError(f"layer {layer!r} is not scheduled yet")
                return future
        raise AsyncInferError(f"the model has no layer {layer!r} (layers are listed in worker.placement)")

    def step_future(self, index: int) -> TaskFuture | None:
        """The future of step ``index`` of this run (None: not submitted yet), made now if it is a
        segment-private step's (`Segment.private`): a run of 1000 small layers made and completed
        a future for each, 0.3-0.6 µs a layer, that nobody but the layer after it read."""
        future = self.futures[index]
        if future is not LAZY:
            return future  # type: ignore[return-value]
        with self._lock:
            future = self.futures[index]
            if future is LAZY:
                future = self.futures[index] = TaskFuture(self.plan.nodes[index].layer.name, self._futures_lock)
        value = self.values[index]  # (read after the future is in place: see `_StepDone.__call__`)
        if type(value) is _Failure:
            future.set_exception(value.error)  # type: ignore[union-attr]
        elif value is not None:
            future.set_result(value)  # type: ignore[union-attr]
        return future  # type: ignore[return-value]

    def cancel(self) -> None:
        """Skip every layer that has not started; started kernels finish and are discarded."""
        self._cancelled = True

    # -- outputs ---------------------------------------------------------------------------------
    def _tensor(self, name: str, owner: Any) -> Tensor:
        ref = self.plan.refs[name]
        info = self.plan.info(name)
        future = self.futures[ref[0]]
        if future is None:
            raise AsyncInferError(f"output {name!r} is not scheduled yet (schedule_iterable not finished)")
        backend = self.plan.nodes[ref[0]].backend if ref[0] < len(self.plan.nodes) else None
        on_device = backend is not None and backend.device != HOST
        return Tensor(_future=future, _index=ref[1], name=name, _shape=None if info is None else info.shape,
                      _dtype=None if info is None else info.dtype,
                      _backend=backend.name if backend is not None else "cpu",
                      _device=backend if on_device else None, _owner=owner)

    def _output_name(self, name: str | None) -> str:
        names = self.plan.output_names
        if name is None:
            return names[0]
        if name not in names and not any(o.name == name for o in self.plan.model.outputs):
            model_outputs = [o.name for o in self.plan.model.outputs]
            asked = [n for n in names if n not in model_outputs]
            raise AsyncInferError(f"model has no output {name!r}; outputs are {model_outputs}"
                                  + (f", and this run keeps {asked}" if asked else "")
                                  + " (ask for any other value with schedule(..., outputs=[...]))")
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
        """Every output of this run by name (peeked: they belong to the worker): the model's
        outputs, or the values the run asked for with ``outputs=[...]``."""
        return {name: self.peek_output(name) for name in self.plan.output_names}

    def done(self) -> bool:
        """True once every output is computed (or failed)."""
        return all(self.futures[r[0]] is not None and self.futures[r[0]].done() for r in self.plan.output_refs)  # type: ignore[union-attr]

    async def wait(self) -> None:
        """Await every output (never blocks the loop); raises the first failure."""
        for ref in self.plan.output_refs:
            fut = self.futures[ref[0]]
            await wait_done(fut)  # type: ignore[arg-type]
            if fut.failed():  # type: ignore[union-attr]
                raise reraise(fut.exception(), "output")  # type: ignore[union-attr]

    async def read_outputs(self) -> dict[str, np.ndarray]:
        """Await every output and its download to the host (never blocks the loop); caller-owned
        NumPy arrays by name. Raises the first failure."""
        plan = self.plan
        on_host = plan.host_outputs()
        if len(on_host) < len(plan.output_names):  # some on a device: downloaded through tensors
            tensors = [self._tensor(name, None) for name in plan.output_names]
            for tensor in self.last_first(tensors):
                await wait_done(tensor._readback_future())
            return {t.name: t._storage_now(t._readback_future()).download() for t in tensors}
        # In host memory: each output is its step's value (what a tensor's readback would give)
        for future in self._host_output_futures(on_host):
            if not future.done():
                await wait_done(future)
        return self._host_arrays(on_host)

    def read_outputs_blocking(self) -> dict[str, np.ndarray]:
        """Blocking twin of [`read_outputs`][asyncinfer.Execution.read_outputs]: the outputs as caller-owned NumPy
        arrays (downloaded from a device if needed). Do not call it on an event loop."""
        on_host = self.plan.host_outputs()
        if len(on_host) < len(self.plan.output_names):
            tensors = [self._tensor(name, None) for name in self.plan.output_names]
            arrays = {t.name: t.download_to_array() for t in self.last_first(tensors)}
            return {t.name: arrays[t.name] for t in tensors}
        for future in self._host_output_futures(on_host):
            future.wait()
        return self._host_arrays(on_host)

    def _host_output_futures(self, on_host: list) -> list[TaskFuture]:
        """The futures of the outputs in host memory (`Plan.host_outputs`, the last one's first)."""
        futures = []
        for name, ref in on_host:
            future = self.futures[ref[0]]
            if future is None:
                raise AsyncInferError(f"output {name!r} is not scheduled yet (schedule_iterable not finished)")
            futures.append(future)
        return futures

    def _host_arrays(self, on_host: list) -> dict[str, np.ndarray]:
        """The done outputs in host memory as the caller's own arrays, by name in the plan's
        order; raises the first failure. A private run (whose caller reads its outputs once, here)
        hands over an array a step made and nothing else holds (`handover.sole_array`), any
        other output is copied. (A tensor's readback, without one: a blocking run spent 15 µs in
        taking and downloading tensors.)"""
        arrays = {}
        plan = self.plan
        for name, ref in on_host:
            future = self.futures[ref[0]]
            if future.failed():  # type: ignore[union-attr]
                raise reraise(future.exception(), name)  # type: ignore[union-attr]
            values = future.peek()  # type: ignore[union-attr]
            # (a step's own list: a precomputed step's is the plan's, shared by every run)
            if (self.private and ref[0] < len(plan.nodes) and ref[0] not in plan.precomputed
                    and sole_array(values, ref[1])):
                arrays[name] = values[ref[1]]
            else:
                arrays[name] = copy_value(values[ref[1]])
        return {name: arrays[name] for name in plan.output_names}

    def last_first(self, tensors: list[Tensor]) -> list[Tensor]:
        """``tensors`` (outputs of this run) in the order to wait for them: the one whose layer comes
        last in the plan first, so the waiting thread usually wakes once, when all are done, and not
        once per output while the pool still runs (a wake-up takes the GIL from the layers)."""
        return sorted(tensors, key=lambda t: -self.plan.refs[t.name][0])


    def output_arrays(self) -> dict[str, np.ndarray]:
        """Deprecated alias of [`read_outputs_blocking`][asyncinfer.Execution.read_outputs_blocking] (removed in the
        next release)."""
        warnings.warn("Execution.output_arrays() is deprecated: use read_outputs_blocking()",
                      DeprecationWarning, stacklevel=2)
        return self.read_outputs_blocking()
