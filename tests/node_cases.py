"""The one node-case harness: every ONNX backend node test case shipped with the installed ``onnx``
(``onnx.backend.test.case.node.collect_testcases``), on every backend, through the whole engine.

A case runs as the conformance runner (``asyncinfer.conformance``) runs it: ``load_model`` (the
optimizer included), a ``Worker`` on the backend, every output taken and read back, then compared
with ``conformance.compare_outputs`` (shape, dtype, the case's own rtol/atol, NaN equal to NaN).

- :func:`check_node_case` ``(name, backend)`` is the check; exceptions are not swallowed, so an
  expected failure is asserted with the exception it raises.
- :func:`node_case_params` gives every ``(backend, case name)`` pair for ``parametrize``: a case is
  expected to pass unless :data:`EXPECTED_FAILURES` (every backend) or the backend's own list
  holds it, which makes it a strict xfail carrying its reason and the exception it raises; a
  backend that cannot run here is skipped with the reason it gives.
- ``tests/test_conformance.py::test_node_case`` is the test, parametrised by both.

Adding a backend is one entry in :data:`BACKENDS`: how to build the Worker's backend for one run
(a name ``Worker`` accepts, or a fresh backend instance, which the Worker owns and closes), why it
cannot run here (``None`` when it can), the cases that must run on it with no CPU fallback, and the
cases that fail on it alone, with why.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from asyncinfer import conformance

HERE = Path(__file__).parent
# The cases that pass on the CPU (``asyncinfer conformance --write-passing``; README and docs name it).
PASSING_LIST = HERE / "conformance_passing.txt"
# The cases that run with every layer as a shader (``asyncinfer conformance --backend gpu_pixel --write-wholly``).
WHOLLY_GPU_PIXEL_LIST = HERE / "conformance_wholly_gpu_pixel.txt"


def read_list(path: Path) -> list[str]:
    """Case names, one a line."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


# -- the cases -------------------------------------------------------------------------------------
@functools.cache
def _cases() -> dict[str, Any]:
    return {case.name: case for case in conformance.load_cases()}


def node_case(name: str) -> Any:
    """The shipped node case called ``name``."""
    return _cases()[name]


def node_case_names() -> list[str]:
    """Every node case shipped with the installed onnx, sorted."""
    return sorted(_cases())


def node_op_types(case: Any, *, subgraphs: bool = False) -> set[str]:
    """Op types of a case's graph (and, with ``subgraphs``, of its bodies at any depth)."""

    def walk(graph: onnx.GraphProto) -> set[str]:
        found = set()
        for node in graph.node:
            found.add(node.op_type)
            if subgraphs:
                for attr in node.attribute:
                    for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                        found |= walk(sub)
        return found

    return walk(case.model.graph)


def cases_using(op_types: set[str], *, subgraphs: bool = False) -> dict[str, Any]:
    """Node cases whose graph (and, with ``subgraphs``, bodies) has a node of one of ``op_types``, by name."""
    return {name: case for name, case in _cases().items() if node_op_types(case, subgraphs=subgraphs) & op_types}


def cases_made_of(op_types: set[str]) -> dict[str, Any]:
    """Node cases whose every node is one of ``op_types``, by name."""
    return {name: case for name, case in _cases().items() if node_op_types(case) <= op_types}


# -- what cannot pass, and why -----------------------------------------------------------------------
@dataclass(frozen=True)
class ExpectedFailure:
    raises: type[BaseException]  # what the check raises: UnsupportedOperatorError at load, …
    reason: str
    always: bool = True  # False: the case may pass by chance (a fresh random draw), so a pass is no error


_RANDOM_DRAW = ExpectedFailure(AssertionError, "Bernoulli draws at random: its outputs cannot equal the ones NumPy "
                                               "drew when onnx made the case (tests/ops/test_random.py checks "
                                               "that it follows the probabilities)")
# Unseeded, each run draws afresh and matches the case's 10 draws by chance (for the case's
# probabilities, about once in a few dozen to a few hundred runs): a strict xfail would fail CI
# at random.
_FRESH_RANDOM_DRAW = ExpectedFailure(AssertionError, _RANDOM_DRAW.reason + "; unseeded, it may match by chance",
                                     always=False)

# Cases that fail on every backend (the CPU runs them where a device has no kernel), and why.
EXPECTED_FAILURES: dict[str, ExpectedFailure] = {
    # ops/random.py
    **{f"test_bernoulli{variant}": _FRESH_RANDOM_DRAW
       for variant in ("", "_double", "_double_expanded", "_expanded")},
    **{f"test_bernoulli{variant}": _RANDOM_DRAW for variant in ("_seed", "_seed_expanded")},
}



# -- the backends ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeCaseBackend:
    make: Callable[[], Any]  # what Worker(model, …) gets for one run: a backend name or a fresh instance
    unavailable: Callable[[], str | None] = lambda: None  # why it cannot run here, None when it can
    wholly: Callable[[], frozenset[str]] = frozenset  # cases that must run with no layer on the CPU
    expected_failures: dict[str, ExpectedFailure] = field(default_factory=dict)  # on this backend alone


def _gpu_compute_on_the_host() -> Any:
    from asyncinfer.backends.cupy import CuPyBackend, HostRuntime

    return CuPyBackend(HostRuntime())


@functools.cache
def _wholly_gpu_pixel() -> frozenset[str]:
    return frozenset(read_list(WHOLLY_GPU_PIXEL_LIST))


def _cuda_unavailable() -> str | None:
    from asyncinfer.backends.cupy.device import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    return None if reason is None else f"no CUDA device for gpu_compute: {reason}"


def _pixel_unavailable() -> str | None:
    from pixel_testing import pixel_unavailable_reason

    reason = pixel_unavailable_reason()
    return None if reason is None else f"no gpu_pixel backend on this machine: {reason}"


BACKENDS: dict[str, NodeCaseBackend] = {
    "cpu": NodeCaseBackend(make=lambda: "cpu"),
    # CuPy's backend on HostRuntime (NumPy, host memory): the real Worker, Plan, dispatcher thread, uploads,
    # device kernels, CPU fallback and downloads, without CUDA (tests/backends/cupy/test_backend.py).
    "gpu_compute": NodeCaseBackend(make=_gpu_compute_on_the_host),
    # The same backend on CuPy and the first CUDA device: streams, events, pinned readbacks, NVRTC kernels.
    "gpu_compute_cuda": NodeCaseBackend(make=lambda: "gpu_compute", unavailable=_cuda_unavailable),
    "gpu_pixel": NodeCaseBackend(make=lambda: "gpu_pixel", unavailable=_pixel_unavailable,
                                 wholly=_wholly_gpu_pixel),
}


def expected_failure(name: str, backend: str) -> ExpectedFailure | None:
    """Why case ``name`` cannot pass on ``backend``; None when it must pass."""
    return BACKENDS[backend].expected_failures.get(name) or EXPECTED_FAILURES.get(name)


def expected_failures_among(names, backend: str = "cpu") -> dict[str, ExpectedFailure]:
    """The cases of ``names`` expected to fail on ``backend``, with why."""
    return {name: failure for name in names if (failure := expected_failure(name, backend)) is not None}


# -- the check -----------------------------------------------------------------------------------------
def _as_array(value: Any) -> Any:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list):
        return [_as_array(v) for v in value]
    return value


def run_node_case(name: str, backend: str) -> tuple[list[tuple[list, list]], bool]:
    """Run every data set of case ``name`` on ``backend``: ``([(outputs, expected outputs)…],
    whether every layer of every run stayed on the backend)``. Raises what the engine raises."""
    spec, case = BACKENDS[backend], node_case(name)
    results, wholly = [], True
    # Cases divide by zero, take log(0)… on purpose: no numeric warnings, on this thread or the backend's
    # (np.errstate is per thread; the warning filters are the process's), as the conformance runner does.
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for inputs, expected in case.data_sets:
            engine = conformance.asyncinfer_engine(spec.make())
            got, on_backend = engine(case.model, [_as_array(v) for v in inputs])
            results.append(([_as_array(g) for g in got], [_as_array(e) for e in expected]))
            wholly = wholly and on_backend
    return results, wholly


def check_node_case(name: str, backend: str) -> None:
    """Case ``name`` passes on ``backend``: every output matches (``conformance.compare_outputs``),
    and, where the backend lists the case as running wholly on it, no layer fell back to the CPU."""
    case = node_case(name)
    results, wholly = run_node_case(name, backend)
    for got, expected in results:
        conformance.compare_outputs(got, expected, case.rtol, case.atol)
    if name in BACKENDS[backend].wholly():
        assert wholly, f"{name} no longer runs wholly on {backend}: a layer fell back to the CPU"


def node_case_params(backends: tuple[str, ...] | None = None, names: list[str] | None = None) -> list:
    """``pytest.param(backend, name)`` for every backend (default: all of BACKENDS) and case (default:
    every shipped case), ids ``backend-name``; expected failures are strict xfails with their reason
    (not strict for a random draw that may match by chance),
    a backend that cannot run here is skipped with its reason."""
    params = []
    for backend in backends or tuple(BACKENDS):
        unavailable = BACKENDS[backend].unavailable()
        for name in names if names is not None else node_case_names():
            marks = []
            if unavailable is not None:
                marks.append(pytest.mark.skip(reason=unavailable))
            elif (failure := expected_failure(name, backend)) is not None:
                marks.append(pytest.mark.xfail(raises=failure.raises, strict=failure.always, reason=failure.reason))
            params.append(pytest.param(backend, name, marks=marks, id=f"{backend}-{name}"))
    return params
