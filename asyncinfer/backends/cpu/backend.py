"""The CPU backend: NumPy kernels on a thread pool, driven by dependency callbacks.

No thread ever waits for another: a layer is handed to the pool only once its inputs are done.
When a finishing layer makes others ready, the finishing thread keeps the first of them and
runs it next (no pool hand-off, so a chain of small layers costs little), and hands the rest
to the pool; a *serial* run's (``Job.serial``) it keeps too, to run in turn.

Layers run on ``lanes`` threads: by default one per core, so independent layers and concurrent
runs proceed in parallel (DESIGN.md). Large kernels also split into parts that the backend's
helper threads take (``concurrency/parallel.py``). ``ASYNCINFER_CPU_LANES=1`` runs layers on one
thread and leaves the cores to those splits: most kernels of a model are small NumPy calls that
hold the GIL, and run side by side they mostly wait for each other. Measured on 2 cores
(bench/real_models.py, bench/concurrency.py), one lane was faster for a single stream on every
model (BERT-tiny 4.25 -> 3.34 ms, the LSTM VAD 1.12 -> 0.92, MobileNetV3 7.15 -> 6.56,
ResNet-18 33.1 -> 31.8, squeezenet 15.9 -> 12.5) and halved the event loop's p99 lag under 8
concurrent tasks (2.65 -> 1.1 ms), for 10-15% less throughput of those 8 tasks (squeezenet 92 ->
83 runs/s).

BLAS runs one thread per call while a CPU backend exists (``blas.py`` says why): GEMM-based
kernels (``Op.multithreaded``) run side by side on the pool like any other, and split a large
GEMM across the pool's idle threads themselves (``concurrency/parallel.py``). If the user keeps
BLAS multi-threaded (ASYNCINFER_BLAS_THREADS), two such kernels at once would oversubscribe the
cores (measured: Inception-v2 30% slower), so they then go through a *lane*: one runs at a time,
later ones queue (without blocking any thread) and are picked up by the thread that finishes the
current one. Light kernels still run beside them.
"""
from __future__ import annotations

import functools
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from typing import Union

import numpy as np

from ...concurrency import parallel
from ...concurrency.lanes import LanePool
from ...concurrency.priority import lower_this_thread
from ...concurrency.spin_team import SpinTeam
from ...errors import AsyncInferError, DisposedError, ExecutionError
from ...model.ir import Layer
from ...ops.base import Op
from ...ops.compiled.team_parts import prepare_part, serve_parts
from ...ops.epilogue import apply_activations
from ..base import Backend, Job, Step, StepDone, ValueTypes, run_kernel
from . import blas
from .memory import release_free_memory, tune_allocator

Task = tuple[Step, list, StepDone]
Work = Union[Task, Job]  # what the pool runs: one step, or a job of consecutive steps

#: Seconds after a run ended while another thread ran this backend's work during which kernels
#: still leave the spin team alone (`CPUBackend._crowded`): longer than an awaited run's
#: hand-back to the event loop and the next run's start (tens of microseconds, up to a
#: millisecond when the loop is busy), short beside a request's gap in a single stream.
CROWDED_HOLD_S = 0.005


def _thread_count(threads: int | None) -> int:
    """``threads`` checked (a positive integer; a NumPy one will do), or the core count for None."""
    if threads is None:
        return max(1, os.cpu_count() or 1)
    if isinstance(threads, bool):
        raise TypeError(f"threads must be a positive integer or None (the core count), got {threads!r}")
    try:
        count = operator.index(threads)
    except TypeError:
        raise TypeError(f"threads must be a positive integer or None (the core count), "
                        f"got {type(threads).__name__} {threads!r}") from None
    if count < 1:
        raise ValueError(f"threads must be at least 1, got {count}")
    return count


def lanes_requested() -> int | None:
    """The lane count asked for with ASYNCINFER_CPU_LANES (None: one per thread)."""
    value = os.environ.get("ASYNCINFER_CPU_LANES", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


class CPUBackend(Backend):
    """Thread-pool executor of the NumPy kernels (``threads`` defaults to the core count)."""

    name = "cpu"
    runs_jobs = True

    def __init__(self, threads: int | None = None):
        self.threads = _thread_count(threads)
        self.lanes = min(self.threads, lanes_requested() or self.threads)
        tune_allocator()
        self._blas_single = blas.acquire()
        # the threads that take parts of large kernels: with the lane thread that splits, every core
        self._helpers = ThreadPoolExecutor(max_workers=max(1, self.threads - 1), thread_name_prefix="asyncinfer-part",
                                           initializer=self._start_thread)
        # compiled parts (a decode step's GEMVs) go to spinning helpers that start them in microseconds
        self._team = (SpinTeam(self.threads - 1, serve_parts, prepare_part, busy_here=self._lanes_busy)
                      if self._blas_single and self.threads > 1 else None)
        # the lanes: the most recently idle takes the next work, warm (`concurrency/lanes.py`)
        self._pool = LanePool(self.lanes, "asyncinfer-cpu", self._start_thread)
        # chain: work queued on this thread; caller: in `submit_here`; counted: in `_working`
        self._local = threading.local()
        # Threads running this backend's work now (pool threads and blocking callers): from two
        # on, and for `CROWDED_HOLD_S` after, kernels leave the spin team alone (`crowded`)
        self._working = 0
        self._crowded_until = 0.0
        self._working_lock = threading.Lock()
        self._closed = False
        self._lane_lock = threading.Lock()
        self._lane_busy = False
        self._lane_queue: deque[Task] = deque()
        # GEMM-based kernels take turns only when BLAS itself uses several threads (see above)
        self._uses_lane = self.threads > 1 and not self._blas_single

    def _start_thread(self) -> None:
        """(each pool thread, once) ONNX semantics: inf and nan are results, not warnings; a
        background priority, so an event loop is not kept waiting for a core
        (`concurrency/priority.py`); and kernels may split large work across this pool when
        BLAS is single-threaded."""
        np.seterr(all="ignore")
        lower_this_thread()
        if self._blas_single and self.threads > 1:
            parallel.bind_pool(self._helpers.submit, self.threads, self._team, self._crowded)

    def _crowded(self) -> bool:
        """Whether another thread runs this backend's work too (concurrent requests, a parallel
        run's branches), or did less than `CROWDED_HOLD_S` ago: it has a core's worth of work,
        which a spinning helper would only take turns with. Measured with 8 concurrent SqueezeNet
        requests on 2 cores: 129 runs/s with one core per request, 94 with the team shared
        besides. The hold, after a run ended while another thread worked, covers the moment
        between two runs of concurrent requests, when one lane has handed its result to the
        event loop and not yet taken the next run: a kernel on the other lane that took the team
        then found its helper sharing a core with that next run (2 SqueezeNet requests at a
        time: 300 runs/s, 440 with the hold). And work waiting in the pool's queue is a request
        waiting for a core: with 8 awaited SqueezeNet requests the other lane, back from handing
        its run to the event loop at a lower priority than the loop's thread, took longer than
        the hold now and then, and kernels took the team ~35 times a second with 6-7 runs queued
        (now ~6, at moments nothing is queued; runs/s within the noise, 0.99x)."""
        return self._working > 1 or self._pool.queued > 0 or time.monotonic() < self._crowded_until

    def _lanes_busy(self) -> bool:
        """Whether this backend's other threads use cores now: working (`_crowded`) or spinning
        for work after it (a parallel run's lanes): the spin team's helper missing parts then
        is no sign of another process on its core (`SpinTeam._take_over`)."""
        return self._crowded() or self._pool.spinning > 0

    def prepare(self, layer: Layer, op: Op, types: ValueTypes) -> Op:
        return op  # the reference op is the CPU kernel (load_model checked every op has one)

    def dispatch(self, step: Step, args: list, done: StepDone) -> None:
        task = (step, args, done)
        chain = getattr(self._local, "chain", None)
        if chain is not None:  # called while this pool thread finishes a layer: keep the work here
            chain.append(task)
            return
        self._submit(task)

    def submit_job(self, job: Job) -> None:
        chain = getattr(self._local, "chain", None)
        if chain is not None and (_serial(job) or getattr(self._local, "caller", False)):  # after this work, here
            chain.append(job)
            return
        self._submit(job)

    def submit_here(self, submit: Callable[[], None]) -> None:
        """The blocking caller takes the pool's place for the run it waits for: the work
        ``submit`` makes ready queues on the calling thread, the first item runs here and the
        rest goes to the pool, then the layers and jobs that each finishing item makes ready
        follow as on a pool thread (`_run_chain`). A small model's blocking run then costs no
        thread hand-off at all (two wake-ups, 30-50 µs each on a small VM). Nested calls (a
        blocking run inside a kernel, on a pool thread) hand everything over as usual. A backend
        of one lane (``threads=1``, a one-core machine, ``ASYNCINFER_CPU_LANES=1``) runs its layers
        on one thread at a time: the caller works in place of its lane while that lane is idle
        (`LanePool.claim_idle`; the rest waits for the lane until the caller is done), and hands
        the run over when it is not: a one-layer model's blocking run on one thread took 87-135
        µs, handed over, against 19-21 on two lanes."""
        if getattr(self._local, "chain", None) is not None or self._closed:
            submit()
            return
        lane = self._pool.claim_idle() if self.lanes == 1 else None
        if self.lanes == 1 and lane is None:
            submit()
            return
        try:
            self._run_here(submit)
        finally:
            if lane is not None:
                self._pool.give_back(lane)

    def _run_here(self, submit: Callable[[], None]) -> None:
        """`submit_here`'s work on the calling thread."""
        chain: list[Work] = []
        self._local.chain, self._local.caller = chain, True
        try:
            submit()
        except BaseException:
            for work in chain:  # dispatched already: it must still run
                self._submit(work)
            raise
        finally:
            self._local.chain, self._local.caller = None, False
        if not chain:
            return
        first, rest = chain[0], chain[1:]
        for other in rest:
            self._submit(other)
        # as a pool thread runs it: ONNX's float semantics, and large kernels split across the pool
        with np.errstate(all="ignore"), (parallel.pool_bound(self._helpers.submit, self.threads, self._team,
                                                             self._crowded)
                                         if self._blas_single and self.threads > 1 else nullcontext()):
            self._run_chain(first)

    def job_may_hold(self, kernel: Op) -> bool:
        # Every kernel but the GEMM-based ones while they go through the lane (`_uses_lane`).
        return not (kernel.multithreaded and self._uses_lane)

    def inline_compute(self, step: Step, donated: tuple[int, ...] = ()) -> Callable[[list], list]:
        # (the kernel is the op: `prepare`)
        if donated and (not step.activations or step.kernel.takes_activations):
            donating = step.kernel.donating_run(step.activations, donated)
            if donating is not None:
                return donating
        if not step.activations:
            return step.kernel.bound_run()
        if step.kernel.takes_activations:
            return step.kernel.bound_run(step.activations)
        return functools.partial(_compute, step)

    def run_now(self, step: Step, args: list, done: StepDone) -> None:
        # Jobs hold no kernel that needs the lane (`job_may_hold`).
        run_kernel(step, args, done, _compute)

    def _submit(self, work: Work) -> None:
        try:
            self._pool.submit(self._run_chain, work)
        except RuntimeError as exc:
            if self._closed:  # the pool was shut down by dispose()
                _fail(work, DisposedError("the worker was disposed before this layer could run"))
            elif not self._pool.started:  # the OS refused the pool's first thread
                # The work stays queued in the pool and may run once a thread starts: first
                # completion wins, so failing it now loses nothing and strands no one.
                _fail(work, ExecutionError(f"the CPU backend cannot start a thread ({exc})"))
            # else: the pool's running threads pick the queued work up

    def job_finishing(self, run_over: bool = False) -> None:
        # The loop that the job's last future wakes often takes the GIL before this thread can
        # leave `_run_chain`, and starts the next run on the other lane: counted as working still,
        # this thread would make that run's first layers leave the spin team alone (measured on
        # SqueezeNet: 4 awaited runs in 10 found the team "crowded", their stem 1.2 against 0.65 ms).
        # A whole run over while another thread runs another: concurrent requests, whose next
        # run follows in a moment (the hold, `_crowded`); a parallel run's branch ending is not.
        self._count_out(hold=run_over)
        # ... and with nothing else queued here, that next run comes to this lane, warm, not to
        # the idle one (`LanePool.finishing`; `_run_chain` takes it back if more work comes)
        if not getattr(self._local, "chain", None):
            self._pool.finishing()

    def _count_in(self) -> None:
        local = self._local
        if not getattr(local, "counted", False):
            with self._working_lock:
                self._working += 1
            local.counted = True

    def _count_out(self, hold: bool = False) -> None:
        """This thread no longer runs this backend's work; ``hold``: if another thread still
        does, kernels leave the spin team alone for `CROWDED_HOLD_S` more (`_crowded`)."""
        local = self._local
        if getattr(local, "counted", False):
            with self._working_lock:
                if hold and self._working > 1:
                    self._crowded_until = time.monotonic() + CROWDED_HOLD_S
                self._working -= 1
            local.counted = False

    def _run_chain(self, work: Work) -> None:
        self._count_in()
        try:
            if not isinstance(work, tuple) and not _serial(work):
                # A job: layers it makes ready go to the pool at once, where idle threads take
                # them, rather than waiting for the whole job to end.
                work.run()
                return
            # Layers (and a serial run's jobs) made ready here queue on this thread: the first
            # runs next, without a hand-off; the others go to the pool, unless their run is serial.
            chain: list[Work] = []
            self._local.chain = chain
            try:
                self._run_one(work)
                while chain:
                    item, rest = chain[0], chain[1:]
                    chain.clear()
                    for other in rest:
                        if _serial(other):
                            chain.append(other)
                        else:
                            self._submit(other)
                    self._count_in()  # (a job that ran before may have counted this thread out)
                    self._pool.busy_again()  # (and said it was finishing)
                    self._run_one(item)
            finally:
                self._local.chain = None
        finally:
            self._count_out()

    def _run_one(self, work: Work) -> None:
        if isinstance(work, tuple):
            self._execute(work)
        else:
            work.run()

    def _execute(self, task: Task) -> None:
        if not (task[0].kernel.multithreaded and self._uses_lane):
            run_kernel(*task, _compute)
            return
        with self._lane_lock:
            if self._lane_busy:
                self._lane_queue.append(task)  # the lane holder will run it
                return
            self._lane_busy = True
        next_task: Task | None = task
        while next_task is not None:
            run_kernel(*next_task, _compute)
            with self._lane_lock:
                next_task = self._lane_queue.popleft() if self._lane_queue else None
                self._lane_busy = next_task is not None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._helpers.shutdown(wait=True, cancel_futures=False)
            if self._team is not None:
                self._team.close()
            blas.release()
            release_free_memory()


def _serial(work: Work) -> bool:
    return bool(getattr(work[2] if isinstance(work, tuple) else work, "serial", False))


def _fail(work: Work, error: AsyncInferError) -> None:
    if isinstance(work, tuple):
        step = work[0]
        if isinstance(error, ExecutionError):  # name the layer that could not run
            error = ExecutionError(f"{step.layer.describe()} could not run: {error}",
                                   layer=step.layer.name, op_type=step.layer.op_type)
        work[2].fail(error)
    else:
        work.fail(error)


def _compute(step: Step, args: list) -> list:
    """One layer's NumPy kernel, then its fused activations (unless the kernel applies them
    itself). (Pool threads run with NumPy's floating-point warnings off: inf/nan are values in ONNX.)"""
    if step.activations and step.kernel.takes_activations:
        return list(step.kernel(*args, activations=step.activations))
    out = step.kernel.run(*args)  # (Op.__call__, one call less: this runs for every layer)
    outputs = list(out) if isinstance(out, tuple) else [out]
    if step.activations:
        outputs[0] = apply_activations(outputs[0], step.activations, args)
    return outputs
