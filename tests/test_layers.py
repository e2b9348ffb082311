"""The package keeps the layers of DESIGN.md: import-linter's contracts (pyproject.toml) hold, and
only the entry points import the public API module."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
# Layer 7 (entry points) may import asyncinfer/__init__.py; nothing below it may.
ENTRY_POINTS = ("asyncinfer.__main__", "asyncinfer.cli", "asyncinfer.serving", "asyncinfer.conformance",
                "asyncinfer.operators")


def test_import_linter_contracts_are_kept() -> None:
    result = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                             "lint_imports_command()"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("asyncinfer")


def test_only_entry_points_import_the_public_api(graph: grimp.ImportGraph) -> None:
    importers = graph.find_modules_that_directly_import("asyncinfer")
    below = sorted(m for m in importers if not m.startswith(ENTRY_POINTS))
    assert below == [], f"modules below the entry points import asyncinfer/__init__.py: {below}"

