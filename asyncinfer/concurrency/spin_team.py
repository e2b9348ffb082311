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

A serve loop is written with the kernels it serves (``ops/compiled/team_parts.py``): it calls
`next_post`, reads the part's kind from ``control[KIND]`` and its arguments from
``control[ARGS:]``, takes it (`take_part`), runs it, and calls `mark_done`. A caller
keeps every buffer whose address it posts alive until `SpinTeam.try_run` returns.

A caller may also post and wait in compiled code, where a decode step's ~70 GEMMs each save tens
of microseconds of Python (which, after a GEMM has streamed megabytes through the caches, runs
cold): it `claim`s the team's control rows, calls a kernel that writes each helper's arguments,
`post`s them and counts the helpers that were `asleep`, `wake`s them if any were, calls a kernel
that runs its own part and `wait_done`s, and `release`s the team.

A part is run once, by whoever *takes* it first (`take_part`, an atomic compare-and-swap):
its helper, or the caller once it has run its own part and the helper has not started within
`START_ROUNDS` spins. A helper another process keeps off the cores (a busy neighbour, a
spinning thread pool, the low priority of `priority.py`) then costs the caller its part's time
at most, never the wait for the OS to run the helper: with one of 2 cores kept busy by another
process, MobileNetV3-small took 1.9 s a run where every part waited for its helper.

Memory order: sequence numbers are written and read with a full fence on either side
(`_fence`), so the arguments stored before a post are seen by the helper and the results
written by a part are seen by the caller, on x86 and ARM alike.
"""
from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import placement
from .aligned import aligned_bytes
from .priority import lower_this_thread

#: Rounds a helper spins after a part (a yield of the core each, past the first few) before it sleeps.
SPIN_ROUNDS = 4000
#: Rounds a caller spins waiting for its helpers before it looks whether they still live.
WAIT_ROUNDS = 1 << 16
#: Rounds a caller that has run its own part waits for a helper to start its part before it
#: takes the part over (`SpinTeam.wait`): a spinning helper starts within a round or two of a
#: post, so only a helper the OS is not running (asleep, or its core given to another thread)
#: is still not there.
START_ROUNDS = 16
#: A helper found absent (`SpinTeam._take_over`) this many times within this window makes the
#: team decline callers for the hold: absences come on a quiet VM too (its hypervisor or another
#: thread holding the helper's core a moment: a hold on each single one held the team 3-12 times
#: in 300 runs of a model, 3 in 20 ms 0 in a quiet phase and 1-4 in a noisy one, 8 in 20 ms 1-4).
ABSENT_COUNT, ABSENT_WINDOW_S, ABSENT_HOLD_S = 8, 0.02, 0.1
#: What a caller's compiled post-and-finish call (`compiled.depthwise_parts.post_and_finish_depthwise`...)
#: returns: a helper was asleep (its part posted, nothing run yet: `SpinTeam.settle` wakes the team,
#: then runs its own part and waits, the call's two halves), every part done, or a helper not
#: done within the rounds (the caller waits the slow way, `wait_posted`). One compiled call a
#: layer instead of two saves the second's dispatch (about a microsecond of Python in a run).
HELPERS_ASLEEP, PARTS_DONE, PARTS_RUNNING = 2, 1, 0
# A control row per helper: the posted sequence number, the done one, the stop flag and the
# asleep flag on cache lines of their own, then the part's kind and its arguments (room for 95).
_POSTED, _DONE, _STOP, _ASLEEP, KIND, ARGS, _ROW = 0, 8, 16, 24, 32, 33, 128
ROW = _ROW  # (the length of a control row, for code that reads one by its address)
# The core the last post came from (beside the sequence number the poster writes with it),
# whether the helper moved off a poster's core since it last slept (`keep_off_poster`), and the
# sequence number of the last part taken to run (`take_part`)
_POSTER_CPU, _MOVED, _TAKEN = 1, 2, 3

_sched_yield = types.ExternalFunction("sched_yield", types.int32())
if sys.platform.startswith("linux"):
    _sched_getcpu = types.ExternalFunction("sched_getcpu", types.int32())
    _sched_setaffinity = types.ExternalFunction("sched_setaffinity",
                                                types.int32(types.int32, types.uint64, types.CPointer(types.uint64)))

    @numba.njit(inline="always")
    def current_cpu() -> int:
        """The core the calling thread runs on (compiled code; -1 where the OS does not say)."""
        return _sched_getcpu()

    @numba.njit(inline="always")
    def _bind_to(mask: np.ndarray) -> bool:
        return _sched_setaffinity(0, mask.shape[0] * 8, address_as_pointer(mask.ctypes.data, np.uint64)) == 0
else:
    @numba.njit(inline="always")
    def current_cpu() -> int:
        """The core the calling thread runs on (compiled code; -1 where the OS does not say)."""
        return -1

    @numba.njit(inline="always")
    def _bind_to(mask: np.ndarray) -> bool:
        return False


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


@intrinsic
def _compare_and_swap(typingctx: Any, array: Any, index: Any, expected: Any, new: Any) -> Any:
    """``array[index] = new`` if it holds ``expected``, atomically (int64 arrays, compiled code
    only); whether it did."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        kind = signature.args[0]
        item = cgutils.get_item_pointer(context, builder, kind, context.make_array(kind)(context, builder, args[0]),
                                        [args[1]])
        return builder.extract_value(builder.cmpxchg(item, args[2], args[3], "seq_cst", "seq_cst"), 1)
    return types.boolean(array, types.int64, types.int64, types.int64), codegen


@numba.njit(inline="always")
def _address(array: Any) -> int:
    return np.int64(0) if array is None else np.int64(array.ctypes.data)


@numba.njit(cache=True, nogil=True)
def addresses(a: np.ndarray, b: Any = None, c: Any = None, d: Any = None, e: Any = None, f: Any = None,
              g: Any = None, h: Any = None, i: Any = None, j: Any = None) -> tuple[int, ...]:
    """The data addresses of up to 10 arrays, 0 for each left out (for the integers of a posted
    part): one compiled call, about 0.2 µs an array, where each ``array.ctypes.data`` costs a
    microsecond of Python. Take the first ones: ``x_at, y_at = addresses(x, y)[:2]``."""
    return (_address(a), _address(b), _address(c), _address(d), _address(e), _address(f), _address(g),
            _address(h), _address(i), _address(j))


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


def signal_row() -> np.ndarray:
    """A control row for one thread to `post` to and another to `wait_for_post` on, GIL-free
    (`lanes.LanePool`'s idle threads; a post is seen within the waiter's spin)."""
    return np.zeros(_ROW, np.int64)


@numba.njit(cache=True, nogil=True)
def wait_for_post(control: np.ndarray, rounds: int) -> bool:
    """`next_post` on a `signal_row` from Python: spin, GIL-free, for at most ``rounds`` rounds
    until another thread posts to ``control`` (its first post: the row starts at 0); whether one did."""
    return next_post(control, 0, rounds) != 0


@numba.njit(inline="always")
def keep_off_poster(control: np.ndarray, masks: np.ndarray) -> None:
    """(serve loops, a post just seen) Where this helper runs on the core the post came from, so
    that the two would take turns on it, bind it to the other cores first (``masks[c]``: the
    affinity mask of every allowed core but ``c``, `placement.off_core_masks`; none: the moves
    are off). A system call without the GIL, made only when the two met (`placement.py`)."""
    cpu = control[_POSTER_CPU]
    if 0 <= cpu < masks.shape[0] - 1 and cpu == current_cpu() and _bind_to(masks[cpu]):
        control[_MOVED] = 1


@numba.njit(inline="always")
def take_part(control: np.ndarray, seq: int) -> bool:
    """(serve loops) Take part ``seq`` of ``control``'s helper to run: True for the one thread
    that takes it (the helper, or its poster taking it over, `SpinTeam.wait`), which then runs
    it and `mark_done`s it; False for the other, which leaves it alone."""
    return _compare_and_swap(control, _TAKEN, seq - 1, seq)


@numba.njit(inline="always")
def mark_done(control: np.ndarray, seq: int) -> None:
    """(serve loops) The part's results are visible, then it counts as done."""
    _fence()
    control[_DONE] = seq


@numba.njit(cache=True, nogil=True)
def post(control: np.ndarray) -> int:
    """(callers) Post the part written in ``control[KIND]`` and ``control[ARGS:]`` to its helper;
    the part's sequence number. The post carries the caller's core (see `keep_off_poster`)."""
    control[_POSTER_CPU] = current_cpu()
    _fence()
    seq = control[_POSTED] + 1
    control[_POSTED] = seq
    _fence()
    return seq


@numba.njit(inline="always")
def flag_asleep(control: np.ndarray, value: int) -> None:
    """(serve loops, a helper's own) Raise (1) or lower (0) the helper's asleep flag, GIL-free:
    raised as the loop returns for want of parts, lowered as it starts again. The helper's way
    to sleep and back (`SpinTeam._loop`) is Python, which waits for the GIL (up to the
    interpreter's switch interval while a caller runs Python): a caller posting meanwhile must
    wake it (`asleep`), not count it kept off the cores by another process
    (`SpinTeam._take_over`). The helper looks for a post again before it sleeps."""
    control[_ASLEEP] = value
    _fence()


@numba.njit(cache=True, nogil=True)
def asleep(control: np.ndarray) -> bool:
    """(callers, after `post`) Whether the helper went to sleep and must be woken (`SpinTeam.wake`):
    it raises the flag, then looks for a post; a caller posts, then looks at the flag, so one of
    them sees the other."""
    _fence()
    return control[_ASLEEP] != 0


@numba.njit(inline="always")
def last_post(control: np.ndarray) -> int:
    """(callers holding a claim, the only ones posting) The sequence number of their last `post`."""
    return control[_POSTED]


@numba.njit(inline="always")
def post_and_count_asleep(row: np.ndarray) -> int:
    """(callers, in compiled code) `post` the part written in ``row``; 1 if its helper was asleep
    (the caller wakes it, `SpinTeam.wake`), else 0."""
    post(row)
    return 1 if asleep(row) else 0


@numba.njit(cache=True, nogil=True)
def wait_done(control: np.ndarray, seq: int, rounds: int) -> bool:
    """(callers) Spin until part ``seq`` of ``control``'s helper is done; False after ``rounds``
    rounds without, or after `START_ROUNDS` if the helper has not taken it yet (then
    `SpinTeam.wait` takes it over, or wakes and checks the helper)."""
    for i in range(rounds):
        _fence()
        if control[_DONE] >= seq:
            return True
        if i >= START_ROUNDS and control[_TAKEN] < seq:
            return False
        if i >= 32:
            _sched_yield()
    return False


@numba.njit(inline="always")
def wait_all(control: np.ndarray, helpers: int, rounds: int) -> bool:
    """(callers holding a claim, in compiled code) Spin until the last part posted to each of the
    first ``helpers`` helpers is done; False after ``rounds`` rounds without (then
    `SpinTeam.wait` each, which wakes and checks them)."""
    for i in range(helpers):
        if not wait_done(control[i], last_post(control[i]), rounds):
            return False
    return True


@numba.njit(cache=True, nogil=True)
def wait_parts(control: np.ndarray, helpers: int, rounds: int) -> bool:
    """`wait_all` called from Python (a caller that ran its own share there)."""
    return wait_all(control, helpers, rounds)


@numba.njit(cache=True)
def _load(control: np.ndarray, index: int) -> int:
    """``control[index]`` read after a fence (after this thread's earlier stores are visible)."""
    _fence()
    return control[index]


@functools.lru_cache(maxsize=256)
def range_cuts(n: int, count: int, align: int) -> np.ndarray:
    """The bounds of ``count`` ranges of ``[0, n)`` for a caller and its helpers, each but the
    first starting on a multiple of ``align`` (int64, ``count + 1`` values; for the compiled
    ``post_...``/``finish_...`` pairs), kept per size: a layer sees the same size run after run.
    Shared: never written."""
    return np.array([0] + [n * i // count // align * align for i in range(1, count)] + [n], np.int64)


class SpinTeam:
    """``helpers`` threads running ``serve`` (a compiled serve loop) for one caller at a time."""

    def __init__(self, helpers: int, serve: Callable[[np.ndarray, int, int, np.ndarray, bool], int],
                 prepare: Callable[[int], None], name: str = "asyncinfer-team",
                 busy_here: Callable[[], bool] | None = None):
        """``prepare(kind)`` makes ``serve`` able to run parts of that kind (compiles what it runs
        them with: `ready`). ``busy_here``: whether threads of this process other than the caller
        have work now (a CPU backend's other lanes): a helper absent then was kept off the cores
        by them, which the caller's kernels already heed (`parallel.team`), not by a neighbour,
        and counts for no hold (`_take_over`)."""
        self.helpers = helpers
        self._serve = serve
        self._prepare = prepare
        self._ready: set[int] = set()  # the kinds prepared
        self._busy_here = busy_here
        # the cores a helper may run on, and the affinity masks it moves off its poster's core with
        # (`placement.py`); none where it never moves
        self._cores = placement.allowed_cores() if placement.enabled() else []
        self._masks = placement.off_core_masks(self._cores)
        self._no_moves = placement.off_core_masks([])  # (a caller running a part in `_take_over`)
        self._control = np.zeros((helpers, _ROW), dtype=np.int64)
        self._busy = threading.Lock()
        self._cond = threading.Condition()
        self._sleeping = [False] * helpers
        self._serving = [False] * helpers  # (a helper thread still starting is not absent)
        self._stopped = False
        self._absent_until = self._absent_since = 0.0  # (`_take_over`)
        self._absences = 0
        self._name = name
        self._threads: list[threading.Thread] = []
        self._scratch = np.empty(0, np.uint8)
        self._scratch_views: dict[tuple, np.ndarray] = {}  # by (shape, dtype), of _scratch

    def try_run(self, parts: list[Sequence[int]], own: Callable[[], None]) -> bool:
        """Post each of ``parts`` (the integers of one part: its kind, then its arguments) to a helper, run ``own()``
        on this thread meanwhile, and return once every part is done; False, having run nothing,
        when another caller has the team or there are more parts than helpers."""
        if len(parts) > self.helpers:
            return False
        for arguments in parts:
            self.ready(int(arguments[0]))
        control = self.claim()
        if control is None:
            return False
        try:
            seqs = []
            sleeping = False
            for i, arguments in enumerate(parts):
                control[i, KIND:KIND + len(arguments)] = arguments
                seqs.append(post(control[i]))
                sleeping = sleeping or asleep(control[i])
            if sleeping:
                self.wake()
            try:
                own()
            finally:
                for i, seq in enumerate(seqs):
                    self.wait(i, seq)
            return True
        finally:
            self.release()

    def ready(self, kind: int) -> None:
        """Make the helpers able to run parts of ``kind`` (before one is posted): the first time,
        ``prepare(kind)``, which compiles or loads that kind's code."""
        if kind not in self._ready:
            self._prepare(kind)
            self._ready.add(kind)

    def claim(self) -> np.ndarray | None:
        """The control rows (one per helper) for this caller alone until `release`; None when
        another caller holds the team or it is closed (the caller runs its parts itself)."""
        if self._stopped or time.monotonic() < self._absent_until or not self._busy.acquire(blocking=False):
            return None
        try:
            self._start_threads()
        except BaseException:
            self._busy.release()
            raise
        return self._control

    def release(self) -> None:
        """End a `claim` (every part posted since is done)."""
        self._busy.release()

    def wake(self) -> None:
        """Wake the helpers that went to sleep (a caller saw `asleep` after its post)."""
        with self._cond:
            self._cond.notify_all()

    def wait(self, helper: int, seq: int | None = None) -> None:
        """Wait until part ``seq`` of ``helper`` (default: the last posted) is done: run here if
        the helper has not started it (`take_part`), else waited for, waking the helper if a
        wake-up was lost."""
        row = self._control[helper]
        if seq is None:
            seq = int(row[_POSTED])
        if not wait_done(row, seq, START_ROUNDS + 1):
            self._take_over(helper, seq)
        while not wait_done(row, seq, WAIT_ROUNDS):
            with self._cond:  # (a wake-up lost to a race would cost this much, never a hang)
                self._cond.notify_all()
            if not self._threads[helper].is_alive():  # (interpreter shutdown): never wait forever
                raise RuntimeError(f"{self._threads[helper].name} stopped before its part ran")

    def _take_over(self, helper: int, seq: int) -> None:
        """Run part ``seq`` of ``helper`` here unless the helper takes it first: one round of the
        helper's own serve loop (`take_part` inside; the same compiled code, no second copy of
        it in memory), kept where it runs. A helper serving already and not asleep, yet not
        started on its part while the caller ran its own, was kept off the cores by other work:
        after `ABSENT_COUNT` such parts within `ABSENT_WINDOW_S`, the team declines every caller
        (`claim`) for `ABSENT_HOLD_S`, so that their kernels run whole rather than post parts
        for a helper that may be preempted halfway through one. A helper not bound off the
        caller's core may be waiting on that very core at its low priority (woken there, or left
        only that core by an earlier poster): it is bound off it too (`placement.py`), and runs
        the next parts on the other cores if nothing else holds them; left waiting, after a
        worker's tuning runs, it missed part after part and held the team off the first requests
        after ``warmup()`` (GPT-2 decode's first runs 17-18 ms against 12-13). Absences while
        this process's other threads work or spin (``busy_here``) do not count: they, not a
        neighbour, kept it off."""
        row = self._control[helper]
        if row[_TAKEN] >= seq:  # the helper has it (a part longer than the caller's): wait for it
            return
        if self._serving[helper] and not row[_ASLEEP] and not (self._busy_here is not None and self._busy_here()):
            thread_id, core = self._threads[helper].native_id, placement.current_core()
            if (self._cores and thread_id and core is not None and not placement.bound_off(thread_id, self._cores, core)
                    and placement.bind_off(thread_id, self._cores, core)):
                row[_MOVED] = 1  # it may wait on this caller's core: moved off it (unbound when idle)
            self._count_absence()
        self._serve(row, seq - 1, 1, self._no_moves, False)

    def _count_absence(self) -> None:
        """A helper kept off the cores (`_take_over`): the `ABSENT_COUNT`-th within the window
        holds the team off callers."""
        now = time.monotonic()
        if now - self._absent_since > ABSENT_WINDOW_S:
            self._absent_since, self._absences = now, 0
        self._absences += 1
        if self._absences >= ABSENT_COUNT:
            self._absent_until = now + ABSENT_HOLD_S

    def wait_posted(self, helpers: int) -> None:
        """`wait` for the last part posted to each of the first ``helpers`` helpers: after a
        compiled `wait_all` gave up spinning."""
        for i in range(helpers):
            self.wait(i)

    def settle(self, status: int, finish: Callable[..., bool], arguments: Sequence[Any], helpers: int) -> None:
        """Complete a layer whose compiled post-and-finish call returned ``status``: where a helper
        was asleep, `wake` the team and run the caller's half, ``finish(*arguments)`` (False: a
        helper not done within its rounds); where a helper is still running, `wait_posted`."""
        if status == HELPERS_ASLEEP:
            self.wake()
            status = PARTS_DONE if finish(*arguments) else PARTS_RUNNING
        if status == PARTS_RUNNING:
            self.wait_posted(helpers)

    def scratch(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A buffer for the helpers' partial results, reused by every claim: grown as needed,
        never shrunk, starting on a cache line. Only the parts of the caller holding the claim
        write to it, so a caller may also take its view just before `try_run` claims the team (a
        view keeps its buffer alive if the buffer grows meanwhile)."""
        key = (shape, dtype)
        view = self._scratch_views.get(key)
        if view is None:
            count = 1
            for size in shape:
                count *= size
            nbytes = count * np.dtype(dtype).itemsize
            if self._scratch.nbytes < nbytes:
                self._scratch = aligned_bytes(max(nbytes, 2 * self._scratch.nbytes))
                self._scratch_views.clear()  # views of the old buffer
            if len(self._scratch_views) >= 64:
                self._scratch_views.clear()
            view = self._scratch_views[key] = self._scratch[:nbytes].view(dtype).reshape(shape)
        return view

    def _start_threads(self) -> None:
        if not self._threads:
            # The serve loop loaded here first, from numba's cache (half a second for one that runs
            # every kind of part): a helper loading it itself could still be at it when a later
            # run comes, whose caller then waits for it (a Llama block's first run after
            # `warmup()` 16x its steady time, now and then).
            self._serve(np.zeros(_ROW, np.int64), 0, 0, self._no_moves, False)
        while len(self._threads) < self.helpers:
            index = len(self._threads)
            # the helper starts from the sequence number as it is now, before any post it must see
            seen = int(self._control[index, _POSTED])
            thread = threading.Thread(target=self._loop, args=(index, seen), name=f"{self._name}_{index}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()

    def _loop(self, index: int, seen: int) -> None:
        lower_this_thread()  # a compute thread: see concurrency/priority.py
        control = self._control[index]
        self._serving[index] = True
        while True:
            last = self._serve(control, seen, SPIN_ROUNDS, self._masks, True)
            if last < 0 or self._stopped:
                return
            seen = last
            if control[_MOVED]:  # idle: free to run anywhere again (8 concurrent requests: more runs/s)
                control[_MOVED] = 0
                placement.bind_all(self._cores)
            with self._cond:  # idle for a while: sleep until a caller posts
                self._sleeping[index] = True
                # (the serve loop raised the asleep flag as it returned, and lowers it when it
                # starts again: look for a post now, see `asleep`)
                while _load(control, _POSTED) == seen and not self._stopped:
                    self._cond.wait()
                self._sleeping[index] = False

    def close(self) -> None:
        """Stop the helpers (parts in progress finish first)."""
        with self._busy:
            self._stopped = True
            for row in self._control:
                row[_STOP] = 1
                post(row)
            with self._cond:
                self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
