"""The conformance runner on gpu_pixel: every node case that passes on the CPU passes on the pixel
backend too (shaders where there is one, CPU fallback elsewhere), and every case listed in
conformance_wholly_gpu_pixel.txt passes with *all* its layers run as shaders.

Regenerate the list after adding shaders with:
    asyncinfer conformance --backend gpu_pixel --summary --write-wholly tests/conformance_wholly_gpu_pixel.txt
"""
from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import conformance
from pixel_testing import require_pixel

HERE = Path(__file__).parent
PASSING = [n.strip() for n in (HERE / "conformance_passing.txt").read_text().splitlines() if n.strip()]
WHOLLY = [n.strip() for n in (HERE / "conformance_wholly_gpu_pixel.txt").read_text().splitlines() if n.strip()]


@pytest.fixture(scope="module")
def report():
    require_pixel()
    cases = {c.name: c for c in conformance.load_cases()}
    return conformance.run_cases([cases[n] for n in PASSING], conformance.asyncinfer_engine("gpu_pixel"),
                                 "asyncinfer")


def test_every_case_passing_on_the_cpu_passes_on_gpu_pixel(report):
    broken = [f"{r.name}: {r.status}: {r.detail}" for r in report.results if not r.passed]
    assert not broken, f"{len(broken)} node cases fail on gpu_pixel:\n" + "\n".join(broken[:30])


def test_listed_cases_still_run_wholly_as_shaders(report):
    results = {r.name: r for r in report.results}
    lost = [name for name in WHOLLY if not (results[name].passed and results[name].wholly_on_backend)]
    assert not lost, f"{len(lost)} cases no longer run wholly on gpu_pixel: {lost[:20]}"
    assert len(WHOLLY) >= 500
