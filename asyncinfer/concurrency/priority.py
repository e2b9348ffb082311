"""Background priority for asyncinfer's compute threads, so that the event loop stays responsive.

A CPU backend runs a lane thread per core plus helpers; while they compute, every core is busy,
and an event loop woken by a timer or a socket waits for the OS to give it a core. Two settings
of each compute thread make the OS run the loop first:

- a lower priority (a higher *nice* value): the loop outweighs the compute threads when the
  scheduler shares the cores out;
- a longer time slice than the OS's default (`COMPUTE_SLICE_NS`, Linux 6.12 and later, through
  ``sched_setattr``). Linux's scheduler (EEVDF) lets a running thread finish its slice before a
  thread that wakes takes its core, unless the woken thread asked for a *shorter* slice than the
  running one. With the same slice as the loop, a nice compute thread still held the core up to
  a slice (0.75-3 ms, by the number of cores) after the loop's timer fired. A longer slice for the
  compute threads is the same as a shorter one for everything else: any thread with the default
  slice that wakes gets a core at once. Nothing else changes: the share of CPU time follows the
  nice value, and a compute thread sleeping on a lock or the GIL gets a fresh slice.

On the 2-core VM, 8 tasks awaiting squeezenet, 1 ms ticker on the loop: nice 10 took the loop's
lag p99 from 3.5 to 2.2-3.1 ms; the longer slice took it to 1.2-1.9 ms, at the same throughput.
A 1 ms ticker in *another* process went from p99 1.0-1.7 to 0.11-0.19 ms.

``ASYNCINFER_CPU_NICE`` (default `DEFAULT_NICE`) is how much lower, relative to the process's
own priority; ``0`` keeps asyncinfer's threads at the process's priority and the OS's slice. Only
Linux has per-thread priorities; elsewhere this does nothing. A kernel before 6.12 ignores the
slice, and a sandbox refusing ``sched_setattr`` gets the nice value alone.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
import threading

#: How much nicer than the process compute threads are by default (Linux nice values: 0-19).
DEFAULT_NICE = 10
_MAX_NICE = 19
#: The time slice a compute thread asks for: longer than Linux's default on any number of cores
#: (0.75 ms x (1 + log2 of the cores, at most 8): 3 ms at most), so that a thread with the
#: default slice waking up takes the core at once; short enough that compute threads which
#: outnumber the cores still take turns every few milliseconds.
COMPUTE_SLICE_NS = 8_000_000

#: ``sched_setattr``'s number per machine (the syscall has no libc wrapper before glibc 2.41).
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274, "arm64": 274, "riscv64": 274, "ppc64le": 355,
                  "s390x": 345}
_SCHED_OTHER = 0


class _SchedAttr(ctypes.Structure):
    """Linux's ``struct sched_attr`` (version 1, 56 bytes); ``sched_runtime`` is a fair thread's slice."""
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64), ("sched_util_min", ctypes.c_uint32),
                ("sched_util_max", ctypes.c_uint32)]


def requested_nice() -> int:
    """The ``ASYNCINFER_CPU_NICE`` setting (a malformed value is the default)."""
    value = os.environ.get("ASYNCINFER_CPU_NICE", "").strip()
    if value.isdigit():
        return min(int(value), _MAX_NICE)
    return DEFAULT_NICE


def lower_this_thread() -> None:
    """Give the calling thread (a compute thread) the background priority (see the module docstring)."""
    nice = requested_nice()
    if nice == 0 or not sys.platform.startswith("linux"):
        return
    try:
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the process's (its main thread's) priority
        nice = min(base + nice, _MAX_NICE)
        if not _set_nice_and_slice(nice):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:  # a sandbox refusing it costs responsiveness, never a failure
        pass


def _set_nice_and_slice(nice: int) -> bool:
    """Set the calling thread's nice value and `COMPUTE_SLICE_NS` in one ``sched_setattr``.

    False where that cannot be done (another machine, another policy than the normal one, the
    call refused): the caller sets the nice value alone."""
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None or os.sched_getscheduler(0) != _SCHED_OTHER:
        return False
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=_SCHED_OTHER, sched_nice=nice,
                      sched_runtime=COMPUTE_SLICE_NS)
    return _libc().syscall(ctypes.c_long(number), ctypes.c_long(0), ctypes.byref(attr), ctypes.c_uint(0)) == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
