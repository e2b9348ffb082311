"""A pool of lane threads where the most recently idle thread takes the next piece of work.

`concurrent.futures.ThreadPoolExecutor` hands work to whichever idle thread its queue wakes,
and its threads take turns: a model awaited run after run went to one lane, then the other.
Each lane keeps its own warm state (the kernels' per-thread scratch and padded buffers, its
malloc arena, what its core's caches still hold), so alternating lanes ran every layer on the
colder one. On the 2-core VM, SqueezeNet in one process, blocks of 4 runs after 50 ms pauses,
awaited and blocking blocks in turn: the awaited runs were 0.48-1.25 ms slower than the blocking
ones on the caller's thread in four processes, 0.19-0.35 ms with the most recently idle lane
taking the next run (0.06 with a single lane), the layers themselves slower on the colder lane
(a stem conv 1.08 against 0.55 ms). (`bench latency`'s own await-blocking gaps move 0-1.3 ms
from run to run either way: too noisy to show it.)

`LanePool` keeps its idle threads on a stack: `submit` wakes the one that finished last, and
only when none is idle does work queue (first in, first out) for the next thread to finish.

A thread out of work spins a while (`spin_team.SPIN_ROUNDS` rounds, about a millisecond,
GIL-free, yielding the core each round) before it sleeps on its event: work handed to it
meanwhile is posted to a row it polls (`spin_team.wait_for_post`). Waking a sleeping thread cost its submitter a system call
(`submit` on a small VM: 20 µs, against 6) and the thread a wake-up, on every awaited run of a
model run back to back: MobileNetV3-small, BERT-tiny and SqueezeNet 1-3% faster in one process,
spinning and sleeping in turn.

A thread about to finish its work can say so (`finishing`), and then work submitted by another
thread goes to it rather than to an idle one. An awaited run's last layer wakes the event loop,
which often schedules the next run before that lane is back in the pool (the loop holds the
GIL the lane needs to get there): the run went to the other, colder lane, and awaited runs
alternated lanes run after run. On the 2-core VM, one worker, blocks of 5 awaited runs after
50 ms pauses, the lane saying so or not in turn: MobileNetV3-small 3.2-3.7 -> 2.4-3.0 ms, SSDlite
11.3 -> 9.2, BERT-tiny 2.36 -> 2.12; SqueezeNet, ShuffleNet, ResNet-18 and EfficientNet-B0 the same.

Threads start on demand, up to ``max_workers``, each running ``initializer`` first. Work
must not raise (the CPU backend's runs report their own errors); an exception that escapes
is logged and the thread goes on. Threads are daemons: a worker never disposed does not keep
the interpreter from exiting.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from .spin_team import SPIN_ROUNDS, post, signal_row, wait_for_post

_log = logging.getLogger("asyncinfer")

_Item = tuple[Callable[..., Any], tuple[Any, ...]]


class _Idle:
    """A pool thread's hand-off: the work handed to it (None: nothing, or the pool shut down),
    the event that wakes it when idle, the row posted to instead while it spins (``spinning``),
    and whether it is among the `LanePool.finishing` ones."""

    __slots__ = ("event", "signal", "item", "spinning", "finishing")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal = signal_row()
        self.item: _Item | None = None
        self.spinning = False
        self.finishing = False

    def wake(self) -> None:
        """(Holding the pool's lock, its item set.) A spinning thread sees a post; a sleeping one
        needs the event (a system call that wakes it: 20 µs on a small VM)."""
        if self.spinning:
            post(self.signal)
        else:
            self.event.set()


class LanePool:
    """Threads taking work most-recently-idle first (see the module docstring)."""

    def __init__(self, max_workers: int, thread_name_prefix: str,
                 initializer: Callable[[], None] | None = None) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, not {max_workers}")
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._initializer = initializer
        self._lock = threading.Lock()
        self._idle: list[_Idle] = []      # a stack: the last to go idle is woken first
        self._claimed: list[_Idle] = []   # idle threads another thread works in place of (`claim_idle`)
        self._finishing: list[_Idle] = []  # about to come back for work: preferred to the idle
        self._queue: deque[_Item] = deque()
        self._own = threading.local()      # on a pool thread: its `_Idle`
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def started(self) -> int:
        """Threads started so far (0: none could be, or none was needed yet)."""
        return len(self._threads)

    @property
    def idle(self) -> int:
        """Threads waiting for work now."""
        return len(self._idle)

    @property
    def spinning(self) -> int:
        """Idle threads spinning for work now, a core each (read without the lock: a moment's count)."""
        return sum(1 for idle in list(self._idle) if idle.spinning)

    @property
    def queued(self) -> int:
        """Pieces of work waiting for a thread now (read without the lock: a moment's count)."""
        return len(self._queue)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a thread that said it is `finishing` (but for the calling thread
        itself), else on the most recently idle thread, else on the next to finish (a thread is
        started for it while fewer than ``max_workers`` run). Raises RuntimeError after
        `shutdown`, or when the OS refuses a new thread (the work then stays queued for the
        running threads)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit work to a lane pool that was shut down")
            if self._hand_over((fn, args), getattr(self._own, "idle", None)):
                return
            if len(self._threads) >= self._max:
                return
            if not self._threads:
                # `post` typed with the first thread, on a throwaway row (the first run pays numba's
                # start-up anyway): a process's first hand-off to a spinning thread otherwise typed
                # it on numba's slow path (about 80 µs) in the middle of some later run
                post(signal_row())
            thread = threading.Thread(target=self._work, name=f"{self._prefix}_{len(self._threads)}", daemon=True)
            thread.start()  # (RuntimeError if refused: not counted as started)
            self._threads.append(thread)

    def claim_idle(self) -> _Idle | None:
        """Take the most recently idle thread out of the pool, so that the calling thread can do
        work in its place (a blocking caller running its own run on a pool of one lane): work
        submitted meanwhile that no other thread takes queues for it. None, having taken
        nothing, when no thread is idle or work is queued. Every claim is handed back with
        `give_back`."""
        with self._lock:
            if self._closed or self._queue or not self._idle:
                return None
            claimed = self._idle.pop()
            self._claimed.append(claimed)
            return claimed

    def give_back(self, claimed: _Idle) -> None:
        """Return a thread `claim_idle` took: it takes the work queued meanwhile, else it is idle
        again (the most recently idle). After `shutdown` nothing: that woke it to exit."""
        with self._lock:
            self._claimed.remove(claimed)
            if self._closed:
                return
            if self._queue:
                claimed.item = self._queue.popleft()
                claimed.wake()
            else:
                self._idle.append(claimed)

    def finishing(self) -> None:
        """(On a pool thread, its work's result about to be handed over, nothing else queued on
        it.) Until it is back for more work, work that other threads submit goes to it: see the
        module docstring. Elsewhere nothing."""
        me = getattr(self._own, "idle", None)
        if me is None:
            return
        with self._lock:
            if not me.finishing and me.item is None:
                me.finishing = True
                self._finishing.append(me)

    def busy_again(self) -> None:
        """(On a pool thread that said it was `finishing`, and has more work of its own after
        all.) It no longer takes work that way: any handed to it meanwhile is submitted anew."""
        me = getattr(self._own, "idle", None)
        if me is None or not me.finishing:
            return
        with self._lock:
            handed, me.item, me.finishing = me.item, None, False
            if handed is None:
                self._finishing.remove(me)
            else:
                self._hand_over(handed, me)  # (or queued: this thread comes back for it)

    def _hand_over(self, item: _Item, me: _Idle | None) -> bool:
        """(Holding the lock.) Give ``item`` to a `finishing` thread other than ``me`` while no
        work waits in the queue, else to the most recently idle thread: True. Else queue it."""
        if not self._queue:
            for i in range(len(self._finishing) - 1, -1, -1):
                if self._finishing[i] is not me:
                    self._finishing.pop(i).item = item  # it takes it on its way back (`_work`)
                    return True
        if self._idle:
            idle = self._idle.pop()
            idle.item = item
            idle.wake()
            return True
        self._queue.append(item)
        return False

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new work; threads finish what is queued, then exit (joined with ``wait``,
        but for the calling thread itself)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle + self._claimed, []
            threads = list(self._threads)
        for sleeper in idle:
            post(sleeper.signal)
            sleeper.event.set()  # (item None: exit)
        if wait:
            me = threading.current_thread()
            for thread in threads:
                if thread is not me:
                    thread.join()

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        idle = self._own.idle = _Idle()
        while True:
            with self._lock:
                item: _Item | None = idle.item  # handed to it while `finishing`
                if item is not None:
                    idle.item = None
                else:
                    if idle.finishing:
                        self._finishing.remove(idle)
                    if self._queue:
                        item = self._queue.popleft()
                    elif self._closed:
                        return
                    else:
                        idle.event.clear()
                        idle.signal[:] = 0  # (no post yet: `wait_for_post` waits for the first)
                        idle.spinning = True
                        self._idle.append(idle)
                idle.finishing = False
            if item is None:
                # Spin a while first (GIL-free): the next run of an awaited model back to back
                # comes within a millisecond, and a sleeping thread costs its submitter a system
                # call and itself a wake-up
                wait_for_post(idle.signal, SPIN_ROUNDS)
                with self._lock:
                    idle.spinning = False
                    handed = idle.item is not None or self._closed
                if not handed:
                    idle.event.wait()
                item, idle.item = idle.item, None
                if item is None:
                    return
            fn, args = item
            del item  # (held while idle, the last work would keep its run's graph alive)
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a lane outlives one piece of work gone wrong
                _log.exception("work on %s raised", threading.current_thread().name)
            del fn, args
