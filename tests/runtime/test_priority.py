"""asyncinfer's compute threads run at a background priority (`concurrency/priority.py`), so an
event loop sharing the cores is given one first; ASYNCINFER_CPU_NICE sets how much lower."""
from __future__ import annotations

import os
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
