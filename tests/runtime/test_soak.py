"""Memory and threads stay flat: over many load/dispose cycles, and over a long soak of runs.

The quick test runs in the normal suite (about 2 s). The soak profile runs on demand::

    pytest -m soak tests/runtime/test_soak.py

RSS is read from ``/proc/self/statm``, so these tests run on Linux only.
"""
from __future__ import annotations

import asyncio
import gc
import os
import threading
from importlib import resources

import numpy as np
import pytest

import asyncinfer as ai

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"),
                                reason="resident memory is read from /proc/self/statm (Linux only)")

MODEL_BYTES = (resources.files("asyncinfer.assets") / "digits_cnn.onnx").read_bytes()
IMAGE = np.zeros((1, 1, 8, 8), np.float32)
# Growth allowed after warm-up: the allocator keeps some pages, a leak of one model per cycle
# (the default model's weights are ~40 KiB, its worker's threads and plan much more) exceeds it.
SLACK_MIB = 16


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _settled() -> tuple[float, int]:
    gc.collect()
    return _rss_mib(), threading.active_count()


def _load_run_dispose(backend: str = "cpu") -> None:
    model = ai.load_model(MODEL_BYTES)
    worker = ai.Worker(model, backend)
    worker.run_blocking(IMAGE)
    worker.dispose()


def _check_flat(cycles: int, backend: str = "cpu") -> None:
    for _ in range(50):  # warm-up: pools, allocator arenas, caches
        _load_run_dispose(backend)
    rss, threads = _settled()
    for _ in range(cycles):
        _load_run_dispose(backend)
    rss_after, threads_after = _settled()
    assert threads_after <= threads, f"{threads_after - threads} threads left behind by {cycles} workers"
    assert rss_after - rss < SLACK_MIB, f"RSS grew {rss_after - rss:.1f} MiB over {cycles} load/dispose cycles"


def test_rss_and_threads_are_flat_over_1000_load_dispose_cycles():
    _check_flat(1000)


@pytest.mark.soak
def test_soak_10000_runs_with_failures_and_cancels_keeps_rss_and_threads_flat():
    model = ai.load_model(MODEL_BYTES)

    async def soak(worker: ai.Worker, runs: int) -> None:
        for i in range(runs):
            if i % 100 == 7:  # a bad input: refused before any work
                with pytest.raises(ai.InputError):
                    await worker.run(np.zeros((1, 1, 9, 9), np.float32))
            elif i % 100 == 13:  # a run cancelled mid-flight
                task = asyncio.ensure_future(worker.run(IMAGE))
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                out = await worker.run(IMAGE)
                assert out[model.outputs[0].name].shape[0] == 1

    with ai.Worker(model, "cpu") as worker:
        asyncio.run(soak(worker, 500))
        rss, threads = _settled()
        asyncio.run(soak(worker, 10_000))
        rss_after, threads_after = _settled()
    assert threads_after <= threads
    assert rss_after - rss < SLACK_MIB, f"RSS grew {rss_after - rss:.1f} MiB over 10,000 runs"


@pytest.mark.soak
def test_soak_10000_gpu_pixel_runs_keep_rss_and_threads_flat():
    from pixel_testing import require_pixel

    require_pixel()
    model = ai.load_model(MODEL_BYTES)
    with ai.Worker(model, "gpu_pixel") as worker:
        for _ in range(200):
            worker.run_blocking(IMAGE)
        rss, threads = _settled()
        for _ in range(10_000):
            worker.run_blocking(IMAGE)
        rss_after, threads_after = _settled()
    assert threads_after <= threads
    assert rss_after - rss < SLACK_MIB, f"RSS grew {rss_after - rss:.1f} MiB over 10,000 gpu_pixel runs"


@pytest.mark.soak
@pytest.mark.xfail(reason="moderngl 5.13 leaks inside its C extension when a GL context is made: about 900 "
                          "small allocations (~40 KiB, tracemalloc points at moderngl/__init__.py's "
                          "mgl.create_context) per context, and a few hundred bytes per texture and "
                          "framebuffer object; each gpu_pixel worker owns a context, so RSS grows ~58 KiB "
                          "per worker. Runs on one worker stay flat (the test above).", strict=False)
def test_soak_1000_gpu_pixel_load_dispose_cycles():
    from pixel_testing import require_pixel

    require_pixel()
    _check_flat(1000, "gpu_pixel")
