"""The ``com.microsoft`` domain: the ops ONNX Runtime's own tools write into models.

ORT's transformer optimizer fuses attention, layer norms and GELU into ``com.microsoft`` ops;
``onnxruntime.quantization`` writes the QOperator ops (QLinearAdd, QGemm…) and weight-only
``MatMulNBits``. Their semantics are ORT's operator documentation (ContribOperators.md); where
ORT and that text disagree the kernel follows ORT and its docstring says so. Each op is a class
registered in the one kernel table under ``com.microsoft``, with the attribute defaults declared
once per op (`asyncinfer.ops.schema.declare_defaults`), since onnx ships no schemas for them.

- `.transformer`: the transformer-optimizer fusions;
- `.quantized`: the QOperator ops and the quantized matmuls.
"""
from __future__ import annotations

MS_DOMAIN = "com.microsoft"

from . import quantized, transformer  # noqa: E402,F401  (imported for their @register side effects)
