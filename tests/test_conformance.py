"""The conformance guard: every ONNX node test case listed in conformance_passing.txt must pass.

Regenerate the list after adding ops with:
    asyncinfer conformance --summary --write-passing tests/conformance_passing.txt
"""
from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import conformance

PASSING_LIST = Path(__file__).with_name("conformance_passing.txt")
EXPECTED = [line.strip() for line in PASSING_LIST.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def report():
    cases = {c.name: c for c in conformance.load_cases()}
    missing = [name for name in EXPECTED if name not in cases]
    assert not missing, f"cases listed but not shipped by this onnx version: {missing[:10]}"
    return conformance.run_cases([cases[n] for n in EXPECTED], conformance.asyncinfer_engine("cpu"), "asyncinfer")


def test_every_listed_case_still_passes(report):
    broken = [f"{r.name}: {r.status}: {r.detail}" for r in report.results if not r.passed]
    assert not broken, f"{len(broken)} node cases stopped passing:\n" + "\n".join(broken[:30])


def test_listed_cases_are_many():
    assert len(EXPECTED) >= 1300


def test_compare_outputs_is_strict():
    import numpy as np

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
