"""From an ONNX file to a runnable `Model`: import, validate, optimize.

It sits above both ``model/`` (the IR and the ONNX import) and ``ops/`` (op semantics, which the
optimizer consults to fold constants and fuse activations), so neither of those imports it.
"""
from .load import load_model

__all__ = ["load_model"]
