"""The conformance guard: every ONNX backend node test case, on every backend (the harness:
tests/node_cases.py). A case passes unless it is an expected failure, which must fail, raising
what its entry says. So every case listed in conformance_passing.txt passes on the CPU and on every
other backend (but for that backend's own expected failures), and every case listed in
conformance_wholly_gpu_pixel.txt passes on gpu_pixel with *all* its layers run as shaders.

Regenerate the lists after adding ops or shaders with:
    asyncinfer conformance --summary --write-passing tests/conformance_passing.txt
    asyncinfer conformance --backend gpu_pixel --summary --write-wholly tests/conformance_wholly_gpu_pixel.txt
"""
from __future__ import annotations

import numpy as np
import pytest

from asyncinfer import conformance
from node_cases import (BACKENDS, EXPECTED_FAILURES, PASSING_LIST, WHOLLY_GPU_PIXEL_LIST, check_node_case,
                        node_case_names, node_case_params, read_list)

PASSING = read_list(PASSING_LIST)
WHOLLY_GPU_PIXEL = read_list(WHOLLY_GPU_PIXEL_LIST)


@pytest.mark.parametrize(("backend", "name"), node_case_params())
def test_node_case(backend: str, name: str) -> None:
    check_node_case(name, backend)


def test_no_kernel_writes_into_the_inputs_a_run_reads_in_place():
    """``run_blocking`` (and ``run``) read NumPy inputs in place, not copied (runtime/inputs.py):
    every passing case still passes on the CPU fed arrays that way, and leaves each exactly as it
    was (NaN included), so no kernel, NumPy or compiled, writes into an input it was handed."""
    import warnings

    import asyncinfer as ai
    from node_cases import _as_array, node_case

    failed = []
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name in PASSING:
            case = node_case(name)
            for inputs, expected in case.data_sets:
                try:
                    model = ai.load_model(case.model)
                    feeds = dict(zip([i.name for i in model.inputs], map(_as_array, inputs)))
                    before = {k: v.copy() for k, v in feeds.items() if isinstance(v, np.ndarray)}
                    with ai.Worker(model, "cpu", threads=1) as worker:
                        got = worker.run_blocking(feeds)
                    conformance.compare_outputs([got[o.name] for o in model.outputs],
                                                [_as_array(e) for e in expected], case.rtol, case.atol)
                    for k, v in before.items():
                        assert v.tobytes() == feeds[k].tobytes(), f"input {k!r} was written"
                except Exception as exc:  # noqa: BLE001 - collected, then reported together
                    failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
    assert not failed, f"{len(failed)} cases fail or write into inputs read in place: {failed[:10]}"


# -- the lists -------------------------------------------------------------------------------------
def test_listed_cases_are_shipped_by_this_onnx():
    shipped = set(node_case_names())
    for listed in (PASSING, WHOLLY_GPU_PIXEL, EXPECTED_FAILURES,
                   *(spec.expected_failures for spec in BACKENDS.values())):
        missing = sorted(set(listed) - shipped)
        assert not missing, f"cases listed but not shipped by this onnx version: {missing[:10]}"


def test_passing_list_is_every_case_without_an_expected_failure():
    """So test_node_case asserts, case by case, what the list claims (regenerate it when this fails)."""
    assert sorted(PASSING) == sorted(set(node_case_names()) - set(EXPECTED_FAILURES))
    for backend, spec in BACKENDS.items():  # a backend's own failures are cases that pass on the CPU
        assert set(spec.expected_failures) <= set(PASSING), backend


def test_listed_cases_are_many():
    assert len(PASSING) >= 1300
    assert len(WHOLLY_GPU_PIXEL) >= 500
    assert set(WHOLLY_GPU_PIXEL) <= set(PASSING)


# -- the runner ------------------------------------------------------------------------------------
def test_compare_outputs_is_strict():
    conformance.compare_outputs([np.float32([1, 2])], [np.float32([1, 2])], 1e-3, 1e-7)
    for got in ([np.float64([1, 2])], [np.float32([1, 2.1])], [np.float32([1, 2, 3])], []):
        with pytest.raises(AssertionError):
            conformance.compare_outputs(got, [np.float32([1, 2])], 1e-3, 1e-7)


def test_more_cases_pass_than_onnxruntime_in_the_same_harness():
    pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the comparison")
    cases = conformance.load_cases()
    ours = conformance.run_cases(cases, conformance.asyncinfer_engine("cpu"), "asyncinfer")
    theirs = conformance.run_cases(cases, conformance.onnxruntime_engine(), "onnxruntime")
    print(f"\nasyncinfer {ours.passed}/{len(cases)}, onnxruntime {theirs.passed}/{len(cases)}")
    assert ours.passed >= theirs.passed
