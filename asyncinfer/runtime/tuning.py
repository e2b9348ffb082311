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
clean timings of each it keeps serial runs if their median is at least `MARGIN` faster, else
parallel ones. Until then, runs that overlap others are parallel, as before tuning existed.
``ASYNCINFER_RUN_MODE`` = ``serial`` or ``parallel`` fixes the choice (default ``auto``).
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Clean timings of each mode before the choice.
SAMPLES = 5
#: Runs not timed at first: a worker's first runs page in its memory and record shape plans.
SKIPPED = 2
#: Serial runs are kept when their median time is at most this fraction of the parallel runs'.
#: A tie goes to serial runs: their GEMMs and convs still use every core (the spin team takes a
#: part of each from about 20 µs of work on), while the side-by-side branches of parallel runs
#: take turns at the team and wake pool threads. In the tuning runs, back to back and alternating,
#: the two modes measured closer than in steady use (ShuffleNet 9.1 against 9.5 ms while
#: tuning, 7.8 against 11.7 ms after; ResNet-18 24.2 against 25.2, then 23 against 28).
MARGIN = 1.0
#: ``ASYNCINFER_RUN_MODE``'s values.
MODES = ("auto", "serial", "parallel")


def mode_requested() -> str:
    """``ASYNCINFER_RUN_MODE`` (``auto`` when unset or not one of `MODES`)."""
    value = os.environ.get("ASYNCINFER_RUN_MODE", "").strip().lower()
    return value if value in MODES else "auto"


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

    @contextmanager
    def timed(self) -> Iterator[Trial]:
        """`begin` a run, and `end` it with its time when the block leaves (ok if it did not raise)."""
        trial, start, ok = self.begin(), time.perf_counter(), False
        try:
            yield trial
            ok = True
        finally:
            self.end(trial, time.perf_counter() - start, ok)

    def end(self, trial: Trial, seconds: float, ok: bool) -> None:
        """A run begun with ``timed=True`` ended after ``seconds`` (``ok``: it succeeded)."""
        with self._lock:
            self._in_flight -= 1
            if trial.start is None or self._chosen is not None or not ok or self._started != trial.start:
                return
            if self._skipped < SKIPPED:
                self._skipped += 1
                return
            self._times[trial.serial].append(seconds)
            if min(len(times) for times in self._times.values()) >= SAMPLES:
                serial, parallel = (statistics.median(self._times[mode]) for mode in (True, False))
                self._chosen = serial <= MARGIN * parallel

    def timings(self) -> dict[str, list[float]]:
        """The clean timings so far, in seconds, by mode."""
        with self._lock:
            return {"serial": list(self._times[True]), "parallel": list(self._times[False])}
