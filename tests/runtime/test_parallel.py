"""Intra-op parallelism (concurrency/parallel.py): parts run once each, errors come back, and the
caller never waits for a helper that has not started."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from asyncinfer.concurrency import parallel
from asyncinfer.ops.linalg import matmul


@pytest.fixture
def pool():
    executor = ThreadPoolExecutor(2, thread_name_prefix="test-parallel")
    yield executor
    executor.shutdown()


def test_each_part_runs_once_across_the_pool(pool):
    seen, lock = [], threading.Lock()

    def part(i):
        with lock:
            seen.append(i)

    with parallel.pool_bound(pool.submit, 3):
        parallel.run_parts(40, part)
    assert sorted(seen) == list(range(40))


def test_a_failing_part_raises_on_the_caller(pool):
    def part(i):
        if i == 1:
            raise ValueError("boom")

    with parallel.pool_bound(pool.submit, 2), pytest.raises(ValueError, match="boom"):
        parallel.run_parts(3, part)


def test_the_caller_never_waits_for_a_busy_helper(pool):
    """With every pool thread taken, the caller runs every part itself and returns."""
    release = threading.Event()
    blockers = [pool.submit(release.wait, 10) for _ in range(2)]
    done: list = []

    def call():
        with parallel.pool_bound(pool.submit, 3):
            parallel.run_parts(6, done.append)

    caller = threading.Thread(target=call)
    try:
        caller.start()
        caller.join(timeout=5)
        assert not caller.is_alive(), "run_parts waited for a helper that never started"
        assert sorted(done) == list(range(6))
    finally:
        release.set()
        for blocker in blockers:
            blocker.result()


# (b's columns never whole panels of `compiled.gemm`, which takes such products itself)
@pytest.mark.parametrize("shapes", [((300, 200), (200, 300)), ((1, 512), (512, 9000)),
                                    ((5, 64, 128), (5, 128, 70)), ((2, 1, 70, 80), (3, 80, 90)),
                                    ((1, 7, 7, 300), (300, 770))])
def test_split_matmul_equals_numpy(pool, shapes, monkeypatch):
    from asyncinfer.ops import linalg

    monkeypatch.setattr(linalg, "SPLIT_MIN_MACS", 0)  # every shape here takes the split path
    calls = []
    real = parallel.run_parts
    monkeypatch.setattr(parallel, "run_parts", lambda count, part: (calls.append(count), real(count, part)))
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    with parallel.pool_bound(pool.submit, 2):
        got = matmul(a, b)
    np.testing.assert_allclose(got, np.matmul(a, b), rtol=1e-5, atol=1e-4)
    assert calls == [2]


# In a process of its own (another test's worker left undisposed would hold the pin): BLAS at one
# thread while a worker lives, a library loaded since the first worker started (SciPy's own, its
# linear algebra's) pinned by the next, each library's own count back after the last one closes.
_BLAS_PROGRAM = """
import importlib.resources, json, threadpoolctl
import asyncinfer as ai
def blas_threads():
    return {lib["filepath"]: lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"}
seen = {"before": blas_threads()}
model = ai.load_model((importlib.resources.files("asyncinfer.assets") / "digits_cnn.onnx").read_bytes())
first = ai.Worker(model)
seen["first"] = blas_threads()
try:
    import scipy.linalg  # noqa: F401 (its own OpenBLAS, loaded while a worker lives)
except ImportError:
    pass
seen["loaded"] = blas_threads()
second = ai.Worker(model)
seen["second"] = blas_threads()
second.dispose()
seen["second_closed"] = blas_threads()
first.dispose()
seen["after"] = blas_threads()
print(json.dumps(seen))
"""


def test_blas_is_single_threaded_while_a_cpu_worker_lives_and_restored_after():
    pytest.importorskip("threadpoolctl")
    from asyncinfer.backends.cpu import blas

    if not blas.pinned():
        pytest.skip("ASYNCINFER_BLAS_THREADS is set: BLAS keeps the threads it asks for")
    proc = subprocess.run([sys.executable, "-c", _BLAS_PROGRAM], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    if not seen["before"]:
        pytest.skip("no BLAS library found by threadpoolctl")
    assert set(seen["first"].values()) == {1}
    assert set(seen["second"].values()) == {1} and set(seen["second"]) == set(seen["loaded"])
    assert set(seen["second_closed"].values()) == {1}  # (the first worker still lives)
    loaded_since = {path: n for path, n in seen["loaded"].items() if path not in seen["before"]}
    assert seen["after"] == {**seen["before"], **loaded_since}


