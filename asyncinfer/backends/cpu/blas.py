"""The CPU backend's threading rule: one BLAS thread per call; parallelism comes from the pool.

OpenBLAS splits every GEMM over one thread per core and makes them meet after each call. When
anything else wants a core (a second request, a neighbouring process, the event loop), those
meetings stall: on a 2-core machine with one busy core, a 128×128 matmul went from 0.03 ms to
15–30 ms, and ResNet-18 from 42 ms to 250 ms (``python -m bench real_models``). So while a CPU
backend exists, BLAS runs single-threaded, and asyncinfer parallelises itself: independent layers
and concurrent requests run on the pool's threads, and large GEMMs are split across idle pool
threads (``concurrency/parallel.py``). The price, on an idle machine: OpenBLAS's spinning
threads start a GEMM part faster than a pool thread wakes, so a lone request ran 15-40% slower
(resnet50 63 -> 72 ms, squeezenet 10 -> 13 ms on 2 cores); under any load, or with concurrent
requests, the rule wins by far. For the GEMMs where that start-up matters most, a decode step's
few-row products, the backend keeps spinning helpers of its own (``concurrency/spin_team.py``),
which start a part as fast as OpenBLAS's threads do. The setting is process-wide (BLAS has no per-thread
one): it is made when the first CPU backend starts, made again by each later one for any BLAS
library loaded since (SciPy's own, which its linear algebra loads: a first Erf run imports it,
and a worker would otherwise live beside its spinning threads), and undone when the last one
closes. ``ASYNCINFER_BLAS_THREADS=n`` keeps BLAS at ``n`` threads instead (the backend then runs one
GEMM kernel at a time, as BLAS already uses the cores).
"""
from __future__ import annotations

import os
import threading
from typing import Any

_lock = threading.Lock()
_users = 0
# One per backend start that found a BLAS library not at one thread, in order (undone in reverse)
_limiters: list[Any] = []


def requested_threads() -> int | None:
    """The BLAS thread count the user asked for with ASYNCINFER_BLAS_THREADS (None: the rule above)."""
    value = os.environ.get("ASYNCINFER_BLAS_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def pinned() -> bool:
    """True when the rule is in effect: BLAS calls are single-threaded."""
    return requested_threads() is None


def acquire() -> bool:
    """A CPU backend starts: pin every BLAS library loaded now to one thread (the first backend,
    and a later one for the libraries loaded since). True if BLAS calls are single-threaded, so
    the backend may run GEMMs side by side and split them."""
    global _users
    with _lock:
        _users += 1
        if not pinned():
            return False
        try:
            from threadpoolctl import threadpool_info, threadpool_limits
        except ImportError:  # without threadpoolctl, BLAS keeps its own threads
            return False
        if not _limiters or any(lib["num_threads"] != 1 for lib in threadpool_info() if lib["user_api"] == "blas"):
            _limiters.append(threadpool_limits(limits=1, user_api="blas"))
        return True


def release() -> None:
    """A CPU backend closed: the last one gives every BLAS library its threads back."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            while _limiters:
                _limiters.pop().restore_original_limits()
