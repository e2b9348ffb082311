"""docs/operators.md is generated from the op registry and must be current."""
from __future__ import annotations

from pathlib import Path

from asyncinfer.operators import markdown, support_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "operators.md"


def test_operators_doc_is_current():
    assert DOC.read_text() == markdown(), "regenerate with: asyncinfer operators --output docs/operators.md"


def test_table_lists_core_ops_on_cpu_and_no_test_ops():
    rows = {(domain, op): backends for domain, op, _, backends in support_table()}
    for op in ("Conv", "MatMul", "Gemm", "Softmax", "LayerNormalization", "LSTM", "Resize", "Einsum"):
        assert "cpu" in rows[("", op)]
    assert not any(domain == "test.asyncinfer" for domain, _ in rows)
