"""What a backend provides to the runtime, the step it is handed, and the one kernel table.

A backend sees only what is defined here (and the layers below: the IR, the ops, tensors): it
never sees the runtime's objects. The runtime hands it a `Step` whose inputs are ready,
the input values, and a `StepDone` to report back through::

    backend.dispatch(step, args, done)   # must not block
    # ... later, on any thread:
    if done.begin():                      # False: the run was cancelled (the step is failed already)
        done(outputs)                     # or done.fail(error)

`run_kernel` is that sequence for a kernel that computes synchronously; every backend uses it.

**The kernel table.** `KERNELS` maps ``(backend, domain, op_type, since_version)`` to a
kernel class. The CPU's column is the operator registry itself (``asyncinfer.ops``: every op's
reference kernel); a device backend registers only the ops it overrides, and a layer it has no
kernel for falls back to the CPU. Lookups happen once per layer, when the worker's plan is built.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..concurrency.cancellation import cancel_scope
from ..errors import AsyncInferError, ExecutionError
from ..model.ir import Layer
from ..ops.base import Op
from ..ops.schema import normalise_domain, schema_version

#: Element type of each value of a model, as far as shape inference knows it (None: unknown).
ValueTypes = Mapping[str, "np.dtype | None"]

#: Where host (NumPy) values live; a device backend names its own device.
HOST = "cpu"


class StepKind(enum.Enum):
    """What a step does: run a layer, or move a value between the host and a device."""

    LAYER = "layer"
    UPLOAD = "upload"      # host array -> device value
    DOWNLOAD = "download"  # device value -> host array


@dataclass(eq=False)
class Step:
    """One unit of work as a backend sees it.

    ``op`` is the layer's reference op (its attributes parsed once; None for transfers) and
    ``kernel`` what the backend's `Backend.prepare` chose for the layer (on the CPU, the op
    itself). ``activations`` are the activations the optimizer fused into the layer, each with its
    constant extra inputs. ``n_outputs`` counts the outputs the model uses.
    """

    index: int
    layer: Layer
    kind: StepKind = StepKind.LAYER
    op: Op | None = None
    kernel: Any = None
    activations: tuple[tuple[Op, list], ...] = ()
    n_outputs: int = 0

    def __post_init__(self) -> None:
        self.n_outputs = len([o for o in self.layer.outputs if o])


class StepDone(Protocol):
    """How a backend reports a dispatched step back to the runtime (callable from any thread)."""

    #: True when the step's run asked for its steps one after another on one thread at a time
    #: (see `Job.serial`).
    serial: bool

    def begin(self) -> bool:
        """Call right before the step's work starts: False if its run was cancelled meanwhile (the
        step has then been failed, and the work must be skipped)."""

    def __call__(self, outputs: list) -> None:
        """The step finished with ``outputs`` (host arrays or device values, one per output)."""

    def fail(self, error: BaseException) -> None:
        """The step failed with ``error``."""

    def cancelled(self) -> bool:
        """True once the step's run has been cancelled (long kernels poll it between iterations)."""


class Job(Protocol):
    """Work the runtime hands a backend as one unit: a *segment* of consecutive steps, each run
    with `Backend.run_now` on the thread that runs the job."""

    #: True when the job's run asked for its steps one after another, each on the thread that
    #: made it ready where it can (a decode step: its branches are too small to gain from a
    #: second thread, and two threads running small kernels only contend for the GIL).
    serial: bool

    def run(self) -> None:
        """Run the job (on one of the backend's threads). Never raises."""

    def fail(self, error: BaseException) -> None:
        """The backend cannot run the job (it was disposed, or a thread could not start)."""


class Backend(ABC):
    """Runs steps whose inputs are ready. One backend instance belongs to one worker."""

    name: str = ""
    #: Where this backend's values live: `HOST` (NumPy arrays) or a device name.
    device: str = HOST
    #: True for backends that run a `Job` of consecutive steps on one of their threads
    #: (`submit_job` and `run_now`); the runtime then schedules paths of light layers
    #: as one job, instead of one dispatch per layer.
    runs_jobs: bool = False

    @abstractmethod
    def prepare(self, layer: Layer, op: Op, types: ValueTypes) -> Any:
        """The kernel that runs ``layer`` here (``op`` is its reference op, ``types`` the value
        types), or None when this backend cannot run it (the layer then falls back to the CPU).
        Called once per layer while the plan is built; it keeps no state."""

    @abstractmethod
    def dispatch(self, step: Step, args: list, done: StepDone) -> None:
        """Run ``step`` on ``args`` (its input values, all ready) soon, and report through
        ``done``. Must not block."""

    def submit_job(self, job: Job) -> None:
        """Run ``job`` on one of this backend's threads soon (only if `runs_jobs`). Must not block."""
        raise NotImplementedError(f"the {self.name} backend does not run jobs")

    def run_now(self, step: Step, args: list, done: StepDone) -> None:
        """Run ``step`` synchronously on the calling thread, from inside a job this backend runs."""
        raise NotImplementedError(f"the {self.name} backend does not run jobs")

    def inline_compute(self, step: Step, donated: tuple[int, ...] = ()) -> Callable[[list], list] | None:
        """For a backend that runs jobs: the function computing ``step``'s outputs from its
        inputs on the job's thread (raising on failure), or None. The runtime then runs a job's
        plain steps through it directly, without the `StepDone` calls of `run_now`. Asked once
        per step when a plan is built. ``donated``: inputs (by position) whose arrays the
        function may write over (values no later step reads, sharing memory with no other:
        `Op.donatable_inputs`)."""
        return None

    def job_finishing(self, run_over: bool = False) -> None:
        """(Called on the thread that runs a job, before it completes its last layer's future.)
        The job's computing is over (``run_over``: the job was a serial run's, the whole run's
        computing is): a waiter that future wakes may schedule the next run before this thread
        has left the job. By default nothing."""

    def job_may_hold(self, kernel: Any) -> bool:
        """Whether a job (see `runs_jobs`) may run ``kernel`` with `run_now`, or the kernel needs a
        dispatch of its own. By default only kernels that do not use every core themselves."""
        return not getattr(kernel, "multithreaded", False)

    def submit_here(self, submit: Callable[[], None]) -> None:
        """Call ``submit`` (which dispatches a run's ready steps and jobs), for a caller that is
        going to block until the run is done anyway (``run_blocking``): a backend may run some of
        that work on the calling thread instead of handing it to its own. By default it hands
        everything over."""
        submit()

    @abstractmethod
    def close(self) -> None:
        """Release threads and device resources; waits for kernels already running."""


def run_kernel(step: Step, args: list, done: StepDone, compute: Callable[[Step, list], list]) -> None:
    """Run ``compute(step, args)`` and report it: its outputs, or its failure as an
    `ExecutionError` naming the layer. Skipped when the run was cancelled. Never raises."""
    if not done.begin():
        return
    try:
        if step.op is not None and step.op.cancellable:
            with cancel_scope(done.cancelled):
                outputs = compute(step, args)
        else:
            outputs = compute(step, args)
    except Exception as exc:  # noqa: BLE001 - any kernel failure becomes an ExecutionError
        done.fail(kernel_error(step, exc, args))
        return
    if len(outputs) < step.n_outputs:
        done.fail(kernel_error(step, ValueError(
            f"kernel returned {len(outputs)} outputs for {step.n_outputs}"), args))
        return
    done(outputs)


def kernel_error(step: Step, exc: BaseException, args: list) -> BaseException:
    """The error a failed kernel reports: an ExecutionError naming the layer, its op and the
    inputs it saw (asyncinfer's own errors other than ExecutionError pass through as they are)."""
    if isinstance(exc, AsyncInferError) and not isinstance(exc, ExecutionError):
        return exc
    layer = step.layer
    seen = ", ".join("None" if a is None else f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', []))}"
                     for a in args)
    error = ExecutionError(f"{layer.describe()} failed: {type(exc).__name__}: {exc} (inputs: {seen})",
                           layer=layer.name, op_type=layer.op_type)
    error.__cause__ = exc
    return error


class KernelTable:
    """``(backend, domain, op_type, since_version)`` → kernel class, for the backends that override
    the reference ops. A registration without versions covers every version the reference op has."""

    _ANY_VERSION = 0

    def __init__(self) -> None:
        self._table: dict[tuple[str, str, str], dict[int, type]] = {}

    def register(self, backend: str, op_types: Iterable[str], *, domain: str = "",
                 versions: Iterable[int] | None = None) -> Callable[[type], type]:
        """Class decorator: ``cls`` is ``backend``'s kernel for each of ``op_types``."""
        def decorate(cls: type) -> type:
            for op_type in op_types:
                entry = self._table.setdefault((backend, normalise_domain(domain), op_type), {})
                for version in (self._ANY_VERSION,) if versions is None else versions:
                    if version in entry and entry[version] is not cls:
                        raise ValueError(f"two {backend} kernels for {op_type} version {version}: "
                                         f"{entry[version].__name__} and {cls.__name__}")
                    entry[version] = cls
            return cls

        return decorate

    def lookup(self, backend: str, layer: Layer) -> type | None:
        """``backend``'s kernel class for ``layer`` at the layer's opset, or None (CPU fallback)."""
        domain = normalise_domain(layer.domain)
        entry = self._table.get((backend, domain, layer.op_type))
        if not entry:
            return None
        if self._ANY_VERSION in entry:
            return entry[self._ANY_VERSION]
        return entry.get(schema_version(layer.op_type, layer.version, domain) or layer.version)

    def op_types(self, backend: str) -> list[tuple[str, str]]:
        """Every ``(domain, op_type)`` for which ``backend`` registered a kernel, sorted."""
        return sorted({(domain, op_type) for (name, domain, op_type) in self._table if name == backend})


#: The one kernel table (the device backends' kernel packages register into it when imported).
KERNELS = KernelTable()
