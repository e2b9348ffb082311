"""asyncinfer's compute threads run at a background priority (`concurrency/priority.py`), so an
event loop sharing the cores is given one first; ASYNCINFER_CPU_NICE sets how much lower."""
from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
from concurrent.futures import Future

import numpy as np
import pytest

import asyncinfer as ai
from asyncinfer.concurrency import priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread priorities exist on Linux only (elsewhere nothing changes)")


def _nice_of_pool_thread(worker: ai.Worker) -> int:
    nice: Future[int] = Future()
    pool = worker._backend._pool  # noqa: SLF001 - the lane threads themselves
    pool.submit(lambda: nice.set_result(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    return nice.result(10)


def _base() -> int:
    return os.getpriority(os.PRIO_PROCESS, os.getpid())


@pytest.mark.parametrize("setting, offset", [(None, priority.DEFAULT_NICE), ("0", 0), ("3", 3), ("junk", priority.DEFAULT_NICE)])
def test_pool_threads_run_nicer_than_the_process(digits_model, digits_samples, monkeypatch, setting, offset):
    if setting is None:
        monkeypatch.delenv("ASYNCINFER_CPU_NICE", raising=False)
    else:
        monkeypatch.setenv("ASYNCINFER_CPU_NICE", setting)
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ai.Worker(digits_model, "cpu", threads=2) as worker:
        out = worker.run_blocking(digits_samples[0][:2])
        assert _nice_of_pool_thread(worker) == min(_base() + offset, 19)
    assert np.all(np.isfinite(next(iter(out.values()))))
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller  # the caller's own is untouched


_SCHED_GETATTR = {"x86_64": 315, "aarch64": 275}


def _slice_of_pool_thread(worker: ai.Worker) -> int:
    """The pool thread's time slice in ns, read back with ``sched_getattr``."""
    def read() -> int:
        attr = priority._SchedAttr()  # noqa: SLF001 - the kernel's struct, as the module declares it
        libc = ctypes.CDLL(None, use_errno=True)
        number = _SCHED_GETATTR[platform.machine()]
        assert libc.syscall(ctypes.c_long(number), ctypes.c_long(0), ctypes.byref(attr),
                            ctypes.c_uint(ctypes.sizeof(attr)), ctypes.c_uint(0)) == 0, ctypes.get_errno()
        return attr.sched_runtime

    slice_ns: Future[int] = Future()
    worker._backend._pool.submit(lambda: slice_ns.set_result(read()))  # noqa: SLF001 - the lane threads
    return slice_ns.result(10)


def _kernel_takes_fair_slices() -> bool:
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (6, 12)


@pytest.mark.skipif(platform.machine() not in _SCHED_GETATTR, reason="sched_getattr's number is known here "
                    "for x86_64 and aarch64 only")
@pytest.mark.skipif(not _kernel_takes_fair_slices(), reason="Linux before 6.12 has no time slice per thread "
                    "(sched_setattr ignores it for normal threads)")
@pytest.mark.parametrize("setting", [None, "0"])
def test_pool_threads_ask_for_a_longer_slice(digits_model, monkeypatch, setting):
    """A compute thread's longer slice lets a woken event loop take its core at once (module docstring)."""
    if setting is None:
        monkeypatch.delenv("ASYNCINFER_CPU_NICE", raising=False)
    else:
        monkeypatch.setenv("ASYNCINFER_CPU_NICE", setting)
    with ai.Worker(digits_model, "cpu", threads=2) as worker:
        if setting is None:
            assert _slice_of_pool_thread(worker) == priority.COMPUTE_SLICE_NS
            assert _nice_of_pool_thread(worker) == min(_base() + priority.DEFAULT_NICE, 19)
        else:  # the OS's own slice (1.4 ms on a 2-core VM), shorter than the compute one
            assert 0 < _slice_of_pool_thread(worker) < priority.COMPUTE_SLICE_NS
