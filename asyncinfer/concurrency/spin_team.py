"""A team of helper threads that take parts of a compiled kernel without touching the GIL.

Splitting a decode step's GEMV across the pool (`parallel.run_parts`) costs 60-100 µs a call on
2 cores, as much as a third of the GEMV: the helper wakes from a lock, then waits for the GIL
(another wake-up) while the caller runs Python, then runs executor and closure code of its own
before its kernel starts. A decode step makes ~70 such calls. OpenBLAS's threads avoid this by
spinning, and so does this team: each helper runs a compiled **serve loop** (``nogil``) that
spins on its row of a shared control array, yielding the core to anything runnable, for
`SPIN_ROUNDS` rounds (about a millisecond) after its last part; a caller posts a part by writing
its arguments (integers: sizes and buffer addresses) into the row, then bumping the row's
sequence number. The helper runs it and marks it done without ever returning to Python, so the
caller, spinning GIL-free too, sees it finish within microseconds. Only a helper idle that long
goes back to Python, to sleep on a condition (and a caller wakes it the slow way).

A serve loop is written with the kernel it serves (``ops/compiled/few_rows.py``): it calls
`next_post`, reads its arguments from ``control[ARGS:]``, runs, and calls `mark_done`. A caller
keeps every buffer whose address it posts alive until `SpinTeam.try_run` returns.

Memory order: sequence numbers are written and read with a full fence on either side
(`_fence`), so the arguments stored before a post are seen by the helper and the results
written by a part are seen by the caller, on x86 and ARM alike.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

#: Rounds a helper spins after a part (a yield of the core each, past the first few) before it sleeps.
SPIN_ROUNDS = 4000
#: Rounds a caller spins waiting for its helpers before it looks whether they still live.
WAIT_ROUNDS = 1 << 16
# A control row per helper: the posted sequence number, the done one and the stop flag on cache
# lines of their own, then the part's arguments.
_POSTED, _DONE, _STOP, ARGS, _ROW = 0, 8, 16, 24, 40

_sched_yield = types.ExternalFunction("sched_yield", types.int32())


@intrinsic
def _fence(typingctx: Any) -> Any:
    """A sequentially consistent memory fence (compiled code only)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def address_as_pointer(typingctx: Any, address: Any, dtype: Any) -> Any:
    """A typed pointer to a posted buffer address (``numba.carray(address_as_pointer(a, np.float32), shape)``)."""
    element = dtype.dtype

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return types.CPointer(element)(types.int64, dtype), codegen


@numba.njit(inline="always")
def next_post(control: np.ndarray, seen: int, rounds: int) -> int:
    """(serve loops) The next posted sequence number; ``seen`` when none came within ``rounds``
    rounds, -1 when the team stops."""
    for i in range(rounds):
        _fence()
        value = control[_POSTED]
        if value != seen:
            return -1 if control[_STOP] else value
        if i >= 32:
            _sched_yield()
    return seen


@numba.njit(inline="always")
def mark_done(control: np.ndarray, seq: int) -> None:
    """(serve loops) The part's results are visible, then it counts as done."""
    _fence()
    control[_DONE] = seq


@numba.njit(cache=True, nogil=True)
def _post(control: np.ndarray) -> int:
    _fence()
    seq = control[_POSTED] + 1
    control[_POSTED] = seq
    _fence()
    return seq


@numba.njit(cache=True)
def _load(control: np.ndarray, index: int) -> int:
    """``control[index]`` read after a fence (after this thread's earlier stores are visible)."""
    _fence()
    return control[index]


@numba.njit(cache=True, nogil=True)
def _wait_done(control: np.ndarray, seq: int, rounds: int) -> bool:
    for i in range(rounds):
        _fence()
        if control[_DONE] >= seq:
            return True
        if i >= 32:
            _sched_yield()
    return False


class SpinTeam:
    """``helpers`` threads running ``serve`` (a compiled serve loop) for one caller at a time."""

    def __init__(self, helpers: int, serve: Callable[[np.ndarray, int, int], int], name: str = "asyncinfer-team"):
        self.helpers = helpers
        self._serve = serve
        self._control = np.zeros((helpers, _ROW), dtype=np.int64)
        self._busy = threading.Lock()
        self._cond = threading.Condition()
        self._sleeping = [False] * helpers
        self._stopped = False
        self._name = name
        self._threads: list[threading.Thread] = []

    def try_run(self, parts: list[Sequence[int]], own: Callable[[], None]) -> bool:
        """Post each of ``parts`` (the integer arguments of one part) to a helper, run ``own()``
        on this thread meanwhile, and return once every part is done; False, having run nothing,
        when another caller has the team or there are more parts than helpers."""
        if len(parts) > self.helpers or self._stopped or not self._busy.acquire(blocking=False):
            return False
        try:
            self._start_threads()
            seqs = []
            for i, arguments in enumerate(parts):
                self._control[i, ARGS:ARGS + len(arguments)] = arguments
                seqs.append(_post(self._control[i]))
            if any(self._sleeping[: len(parts)]):
                with self._cond:
                    self._cond.notify_all()
            try:
                own()
            finally:
                for i, seq in enumerate(seqs):
                    self._wait(i, seq)
            return True
        finally:
            self._busy.release()

    def _wait(self, helper: int, seq: int) -> None:
        while not _wait_done(self._control[helper], seq, WAIT_ROUNDS):
            with self._cond:  # (a wake-up lost to a race would cost this much, never a hang)
                self._cond.notify_all()
            if not self._threads[helper].is_alive():  # (interpreter shutdown): never wait forever
                raise RuntimeError(f"{self._threads[helper].name} stopped before its part ran")

    def _start_threads(self) -> None:
        while len(self._threads) < self.helpers:
            index = len(self._threads)
            # the helper starts from the sequence number as it is now, before any post it must see
            seen = int(self._control[index, _POSTED])
            thread = threading.Thread(target=self._loop, args=(index, seen), name=f"{self._name}_{index}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()

    def _loop(self, index: int, seen: int) -> None:
        control = self._control[index]
        while True:
            last = self._serve(control, seen, SPIN_ROUNDS)
            if last < 0 or self._stopped:
                return
            seen = last
            with self._cond:  # idle for a while: sleep until a caller posts
                self._sleeping[index] = True
                # the fence in _load orders our store to _sleeping before this read; a caller
                # stores its post before reading _sleeping: one of us sees the other
                while _load(control, _POSTED) == seen and not self._stopped:
                    self._cond.wait()
                self._sleeping[index] = False

    def close(self) -> None:
        """Stop the helpers (parts in progress finish first)."""
        with self._busy:
            self._stopped = True
            for row in self._control:
                row[_STOP] = 1
                _post(row)
            with self._cond:
                self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
