"""Keeping a spinning helper off the core of the thread that posts its parts (Linux).

A lane thread running a layer posts parts of it to the spinning helpers (`spin_team.py`) and
runs its own part meanwhile. A helper that had gone to sleep is woken by the lane, and Linux
places a woken thread near its waker, often on the waker's very core: the lane and the helper
then take turns on one core while another sits idle, until the load balancer moves one of
them, milliseconds later, and the next wake-up may put them together again. On the 2-core Zen 5
VM each of the two took about 70 involuntary context switches a MobileNetV3-small run, and the
run took 1.6-2.3 ms where the lane and the helper happened to share a core, against 1.4-1.5
where they did not (BERT-tiny 1.19 against 0.89 ms).

So each post carries the poster's core (`spin_team.post`), and a helper that finds itself on
that core binds itself to the process's other cores before it runs the part
(`spin_team.keep_off_poster`: a system call from compiled code, made only when the two met;
made from Python it first waited for the GIL, which the lanes hold under load). The OS can then
no longer put them together until the poster itself moves. A helper going to sleep (idle a
millisecond) is unbound again: kept bound, it spun on its one core beside a busy lane under 8
concurrent requests (8-10% fewer runs/s). A helper woken onto its poster's core, or left only
that core by an earlier poster, waits there at its low priority (`priority.py`) while the poster
runs, and misses every part: it cannot move itself, and the OS's balancer takes milliseconds
to. So a poster that finds its helper absent binds it off the poster's own core
(`spin_team.SpinTeam._take_over`, two system calls, only then): after a worker's tuning runs the
spin team otherwise sat out the first requests after ``warmup()`` (GPT-2 decode 17-18 ms a run
for 100 ms, against 12-13).

Binding every compute thread to a fixed core instead stacked a parallel run's second lane on
the helper's core (ResNet-18 10.6 -> 20 ms); binding the lanes alone (lane ``i`` to the
``i``-th core), 8 tasks awaiting SqueezeNet ran no faster (354 against 366 runs/s) and the event
loop, which must then wait for the core a lane holds, lagged more (p99 4.9 against 1.8 ms): the
lanes are left to the OS.

``ASYNCINFER_PIN_THREADS=0`` leaves the helpers where the OS puts them. Elsewhere than Linux,
or with a single core to run on, nothing is bound.
"""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np


def enabled() -> bool:
    """Whether helpers move off their poster's core (``ASYNCINFER_PIN_THREADS``, default on)."""
    return os.environ.get("ASYNCINFER_PIN_THREADS", "").strip() != "0"


def allowed_cores() -> list[int]:
    """The cores the calling thread may run on, in order ([] where the OS does not say)."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return []
    try:
        return sorted(getter(0))
    except OSError:
        return []


#: Cores an affinity mask covers (Linux's ``cpu_set_t``: 1024 bits).
MASK_CORES = 1024


def off_core_masks(cores: list[int]) -> np.ndarray:
    """Affinity masks (rows of ``MASK_CORES / 64`` words): row ``c`` every core of ``cores`` but
    ``c``, the last row all of them, for `spin_team.keep_off_poster`; no rows (no moves) with
    fewer than two cores, or a core past `MASK_CORES`."""
    words = MASK_CORES // 64
    if len(cores) < 2 or max(cores) >= MASK_CORES:
        return np.zeros((0, words), np.uint64)
    masks = np.zeros((max(cores) + 2, words), np.uint64)
    for core in cores:
        masks[:, core // 64] |= np.uint64(1 << (core % 64))
    for core in range(max(cores) + 1):
        masks[core, core // 64] &= ~np.uint64(1 << (core % 64))
    return masks


def cores_of(mask: np.ndarray) -> set[int]:
    """The cores a row of `off_core_masks` covers."""
    return {w * 64 + b for w in range(mask.shape[0]) for b in range(64) if int(mask[w]) >> b & 1}


def bind_all(cores: list[int]) -> None:
    """Unbind the calling thread (a helper gone idle) back to every one of ``cores`` (the
    allowed ones). A sandbox refusing it leaves the thread where it was."""
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except OSError:
            pass


@functools.lru_cache(maxsize=1)
def _getcpu() -> "ctypes._CFuncPtr | None":
    try:
        return ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):  # not glibc/musl on Linux
        return None


def current_core() -> int | None:
    """The core the calling thread runs on now (None where the OS does not say)."""
    getcpu = _getcpu()
    if getcpu is None:
        return None
    core = getcpu()
    return core if core >= 0 else None


def bind_off(thread_id: int, cores: list[int], core: int) -> bool:
    """Bind thread ``thread_id`` to every one of ``cores`` but ``core`` (a helper its poster found
    waiting on the poster's own core, `spin_team.SpinTeam._take_over`); whether it was bound:
    not when nothing would be left, or a sandbox refuses."""
    others = [c for c in cores if c != core]
    if not others:
        return False
    try:
        os.sched_setaffinity(thread_id, others)
    except OSError:
        return False
    return True


def bound_off(thread_id: int, cores: list[int], core: int) -> bool:
    """Whether thread ``thread_id`` may run on every one of ``cores`` but ``core``, and not on
    ``core`` (False where the OS does not say)."""
    try:
        return set(os.sched_getaffinity(thread_id)) == {c for c in cores if c != core}
    except (OSError, AttributeError):
        return False
