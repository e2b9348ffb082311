"""How a worker's runs take their steps: independent branches side by side, or one after another.

A run's layers normally start as soon as their inputs are done, so a model's independent
branches run side by side on the CPU backend's lanes (*parallel* runs). On a few cores this pays
only when the branches are long single-threaded kernels (Inception's convolution towers); when
they are small kernels that take turns at the GIL, or GEMMs that split across every core anyway,
each branch handed to another thread costs a wake-up there and back (30-50 µs on a small VM) and
gains nothing. A *serial* run takes its steps in plan order as one job on one thread
(``Execution(serial=True)`` on ``Plan.for_serial_runs``), each layer still completing its own
future; large kernels still split across the cores. Measured on 2 cores (``bench/``): BERT-tiny
4.05 -> 2.84 ms a run, the LSTM VAD 0.81 -> 0.68 ms (blocking 0.76 -> 0.38), squeezenet 12.7 ->
11.3 ms; but Inception-v2 42 -> 49 ms.

Which one a model wants depends on its kernels and the machine, so the worker measures it
(`RunModeTuner`): its first ``run``/``run_blocking`` calls alternate the two, timing those that
ran alone (no other run of the worker began or was in flight meanwhile), and after `SAMPLES`
clean timings of each it keeps serial runs if their fastest is at most `MARGIN` (1.25) times
the parallel runs' fastest, else parallel ones. The fastest, not the median: on a shared machine
noise only adds time, in bursts (SqueezeNet's serial runs 5.5 ms, 9-11 in a burst), and a burst
over three of five runs lets medians pick the slower mode for the rest of the process (twice a
process A/B ran SqueezeNet 1.35x slower, the speed of its parallel runs). Until then, runs that
overlap others are parallel, as before tuning existed.
``ASYNCINFER_RUN_MODE`` = ``serial`` or ``parallel`` fixes the choice (default ``auto``). A model
that is one path (its plan one segment: SqueezeNet, DenseNet-121, MobileNetV3, the digits CNN)
has no branches to start apart, so its runs are serial from the first (`run_mode`): tuning
alternated the same steps in the same order for a dozen runs (DenseNet-121: most of a second of
`warmup()`), and always kept serial ones.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan

#: Clean timings of each mode before the choice.
SAMPLES = 5
#: Runs not timed at first: a worker's first runs page in its memory and record shape plans.
SKIPPED = 2
#: Serial runs are kept when their fastest time is at most this multiple of the parallel runs'.
#: Near-ties go to serial runs: their GEMMs and convs still use every core (the spin team takes a
#: part of each from about 20 µs of work on), while the side-by-side branches of parallel runs
#: take turns at the team and wake pool threads. In the tuning runs, back to back and alternating,
#: the two modes measured closer than in steady use (ShuffleNet 9.1 against 9.5 ms while
#: tuning, 7.8 against 11.7 ms after; ResNet-18 24.2 against 25.2, then 23 against 28;
#: Inception-v2, once parallel's, now 23.4 serial against 35.8 parallel in steady use). At 1.1,
#: ShuffleNet's fastest tuning runs (serial 4.3-4.7 ms, parallel 4.9-5.5 in eight workers) let
#: a worker whose five serial runs all met a burst of noise keep parallel runs, 1.28x slower in
#: steady use (5.83 against 4.56 ms): parallel runs must now be a fifth faster.
MARGIN = 1.25
#: ``ASYNCINFER_RUN_MODE``'s values.
MODES = ("auto", "serial", "parallel")


def mode_requested() -> str:
    """``ASYNCINFER_RUN_MODE`` (``auto`` when unset or not one of `MODES`)."""
    value = os.environ.get("ASYNCINFER_RUN_MODE", "").strip().lower()
    return value if value in MODES else "auto"


def run_mode(requested: str, plan: "Plan") -> str:
    """The mode a CPU worker's tuner starts from: ``requested`` (`mode_requested`), except that
    ``auto`` on a plan of one segment is ``serial`` (nothing to run side by side)."""
    return "serial" if requested == "auto" and len(plan.segments) == 1 else requested


@dataclass(frozen=True)
class Trial:
    """One run's mode, and whether (from which start) it is timed for the choice."""

    serial: bool
    start: int | None = None  # the tuner's start count when this run began; None: not timed


class RunModeTuner:
    """Chooses serial or parallel runs for one worker by timing both (see the module docstring)."""

    def __init__(self, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"run mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._lock = threading.Lock()
        self._chosen: bool | None = None if mode == "auto" else mode == "serial"
        # Once chosen, every run's trial: `begin` and `end` then take no lock (runs after the
        # choice are neither counted nor timed; a cold lock and two objects cost ~20 µs a run)
        self._chosen_trial: Trial | None = None if self._chosen is None else Trial(self._chosen)
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self._started = 0  # runs begun (timed or not): a timed run is clean if none began after it
        self._in_flight = 0
        self._skipped = 0

    @property
    def mode(self) -> str:
        """``serial`` or ``parallel`` once chosen, else ``deciding``."""
        chosen = self._chosen
        return "deciding" if chosen is None else "serial" if chosen else "parallel"

    @property
    def deciding(self) -> bool:
        return self._chosen is None

    def begin(self, timed: bool = True) -> Trial:
        """A run begins: its mode. ``timed``: the caller will report its time with `end` (a
        run it cannot time, ``schedule()``'s, is parallel until the choice and spoils the
        timing of any run in flight)."""
        chosen = self._chosen_trial
        if chosen is not None:
            return chosen
        with self._lock:
            self._started += 1
            busy = self._in_flight > 0
            if timed:
                self._in_flight += 1
            if self._chosen is not None:
                return Trial(self._chosen)
            if busy or not timed:
                return Trial(False)
            serial = len(self._times[True]) < len(self._times[False])  # (parallel first)
            return Trial(serial, self._started)

    def timed(self) -> "TimedRun":
        """`begin` a run, and `end` it with its time when the block leaves (ok if it did not raise)."""
        return TimedRun(self)

    def end(self, trial: Trial, seconds: float, ok: bool) -> None:
        """A run begun with ``timed=True`` ended after ``seconds`` (``ok``: it succeeded)."""
        if trial is self._chosen_trial:  # begun after the choice: nothing counted
            return
        with self._lock:
            self._in_flight -= 1
            if trial.start is None or self._chosen is not None or not ok or self._started != trial.start:
                return
            if self._skipped < SKIPPED:
                self._skipped += 1
                return
            self._times[trial.serial].append(seconds)
            if min(len(times) for times in self._times.values()) >= SAMPLES:
                self._choose()

    def settle(self) -> bool:
        """Choose now from the clean timings so far, by the same rule, if each mode has one
        (``warmup()``'s time ran out before `SAMPLES` of each: its caller wants the steady state
        next, not more alternating runs; a model slow enough to run out of that time is one whose
        runs vary least, relative to their length). Returns whether a mode is chosen."""
        with self._lock:
            if self._chosen is None and all(self._times.values()):
                self._choose()
            return self._chosen is not None

    def _choose(self) -> None:  # (under the lock)
        serial, parallel = (min(self._times[mode]) for mode in (True, False))
        self._chosen = serial <= MARGIN * parallel
        self._chosen_trial = Trial(self._chosen)

    def timings(self) -> dict[str, list[float]]:
        """The clean timings so far, in seconds, by mode."""
        with self._lock:
            return {"serial": list(self._times[True]), "parallel": list(self._times[False])}


#: An awaited run that takes at most this long on one thread runs on the event loop's thread
#: (`QuickRuns`); ``ASYNCINFER_QUICK_RUN_US`` sets it in µs, 0 turns quick runs off.
QUICK_RUN_S = 1e-3
#: Runs of a signature left on the pool after a run on the loop's thread took too long, before
#: the next try there; doubled for each miss in a row (up to `MAX_BACKOFF` doublings).
BACKOFF_RUNS = 16
MAX_BACKOFF = 8
#: Runs on the loop's thread in a row over the limit (each within twice it) that send a signature
#: back to the pool.
SLOW_RUNS = 3
#: Signatures remembered (the oldest is forgotten first).
MAX_QUICK_SIGNATURES = 64


def quick_run_limit() -> float:
    """`QUICK_RUN_S`, or ``ASYNCINFER_QUICK_RUN_US`` when set (in µs; 0: no quick runs)."""
    value = os.environ.get("ASYNCINFER_QUICK_RUN_US", "").strip()
    try:
        return max(0.0, float(value)) * 1e-6 if value else QUICK_RUN_S
    except ValueError:
        return QUICK_RUN_S


@dataclass
class _QuickState:
    here: bool = False  # the next run of this signature runs on the loop's thread
    confirmed: bool = False  # a run there took at most the limit since `here` was last set
    wait: int = 0  # quick-enough runs on the pool still to go before the next try there
    slow: int = 0  # runs there in a row over the limit
    misses: int = 0  # times in a row its runs there were too slow


class QuickRuns:
    """Which of a worker's awaited runs take their steps on the event loop's own thread.

    An awaited run normally goes to a pool thread, and its completion comes back to the loop:
    two thread wake-ups and GIL hand-offs, 80-250 µs on a small VM (ONNX Runtime's session run
    through ``loop.run_in_executor`` pays the same there: 160-230 µs for a one-``Add`` model). For
    a model of small layers that is most of the run, and the hand-off buys the loop nothing: small
    layers hold the GIL (NumPy on small arrays, the per-layer dispatch), so the loop could not
    run meanwhile anyway. So a quick run takes its steps on the loop's thread, as
    ``run_blocking`` does on its caller's (`CPUBackend.submit_here`), and its caller has the
    outputs without a hand-off.

    Quick is measured, per input signature (and ``outputs=`` choice): after an awaited run on the
    pool took at most twice the `limit` from call to outputs (hand-offs included), the next run
    of that signature tries the loop's thread, and stays there if it took at most `limit`. Later
    runs there may take up to twice the `limit` now and then (another thread's burst of work,
    ONNX Runtime's threads spinning in the same process); `SLOW_RUNS` in a row over the limit, or
    one over twice it, send the signature back to the pool for `BACKOFF_RUNS` runs, twice as many
    after each miss in a row. So one run holds the loop for at most twice the `limit`. Runs wait
    for the worker's serial or parallel choice (`RunModeTuner`) before any tries the loop's thread.
    """

    def __init__(self, limit: float | None = None):
        self.limit = quick_run_limit() if limit is None else limit
        self._states: dict[tuple, _QuickState] = {}
        self._lock = threading.Lock()

    def here(self, key: tuple | None) -> bool:
        """Whether the run of ``key`` (None: not a candidate) takes its steps on the loop's thread."""
        if key is None or not self.limit:
            return False
        state = self._states.get(key)
        return state is not None and state.here

    def settled(self) -> bool:
        """Whether the runs seen know where they run: False while some signature's next run
        would be its first try on the loop's thread (`Worker.warmup` runs until True)."""
        with self._lock:
            return all(state.confirmed or not state.here for state in self._states.values())

    def ran(self, key: tuple | None, here: bool, seconds: float) -> None:
        """A run of ``key`` succeeded in ``seconds`` from call to outputs (``here``: on the loop's thread)."""
        if key is None or not self.limit:
            return
        with self._lock:
            state = self._states.get(key)
            if state is None:
                if len(self._states) >= MAX_QUICK_SIGNATURES:
                    del self._states[next(iter(self._states))]
                state = self._states[key] = _QuickState()
            if here:
                if seconds <= self.limit:
                    state.misses, state.slow, state.confirmed = 0, 0, True
                    return
                state.slow += 1
                if state.confirmed and seconds <= 2 * self.limit and state.slow < SLOW_RUNS:
                    return  # (a slow run now and then: stay)
                state.here = state.confirmed = False
                state.slow = 0
                state.misses = min(state.misses + 1, MAX_BACKOFF)
                state.wait = BACKOFF_RUNS << (state.misses - 1)
            elif seconds <= 2 * self.limit:
                state.wait = max(0, state.wait - 1)
                state.here = not state.wait


class TimedRun:
    """``with tuner.timed() as trial:`` (`RunModeTuner.timed`): a class rather than a generator-based
    context manager, which costs about a microsecond more on every run."""

    __slots__ = ("_mode", "_trial", "_start")

    def __init__(self, mode: RunModeTuner):
        self._mode = mode

    def __enter__(self) -> Trial:
        self._trial = self._mode.begin()
        self._start = time.perf_counter()
        return self._trial

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        self._mode.end(self._trial, time.perf_counter() - self._start, kind is None)
