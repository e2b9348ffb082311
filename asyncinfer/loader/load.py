"""``load_model``: import, optimise and check an ONNX model."""
from __future__ import annotations

import warnings

from .. import ops
from ..errors import AsyncInferError, ModelLoadError, UnsupportedOperatorError
from ..limits import DEFAULT_LIMITS, Limits
from ..model.ir import Layer, Model
from ..model.onnx_import import ModelSource, import_model
from .optimize import mark_cpu_bound
from .optimize import optimize as run_passes


def load_model(source: ModelSource, *, optimize: bool = True, limits: Limits = DEFAULT_LIMITS,
               max_tensor_bytes: int | None = None) -> Model:
    """Load an ONNX model from a path, bytes or ``onnx.ModelProto``.

    Args:
        source: the model.
        optimize: run the graph optimiser: Identity/inference-Dropout removal, constant folding
            (``Shape`` of static tensors included), dead-layer removal, folding of
            BatchNormalization and per-channel Mul/Add/Sub/Div into the Conv or
            BatchNormalization before them, activation fusion, and float16/bfloat16 models with
            GEMM-like layers computed in float32 (rounded once at their outputs). The CPU-bound
            analysis runs either way. Turning the optimiser off never changes results beyond
            float rounding.
        limits: the bounds an untrusted model must keep ([`asyncinfer.Limits`][asyncinfer.Limits]); the model
            keeps them, and workers built on it apply their run limits.
        max_tensor_bytes: deprecated, use ``limits=ai.Limits(max_tensor_bytes=...)``.

    Raises:
        ModelLoadError: the model is malformed (with what and where).
        ModelTooLargeError: the model exceeds one of ``limits`` (a ``ModelLoadError`` too).
        UnsupportedOperatorError: listing every op of the model without an implementation.
    """
    if max_tensor_bytes is not None:
        warnings.warn("load_model(max_tensor_bytes=...) is deprecated: pass limits=ai.Limits(max_tensor_bytes=...)",
                      DeprecationWarning, stacklevel=2)
        limits = limits.replace(max_tensor_bytes=max_tensor_bytes)
    model = import_model(source, limits=limits)
    if optimize:
        run_passes(model)
    else:
        mark_cpu_bound(model)
    check_supported(model.layers, model.source, model.limits)
    return model


def check_supported(layers: list[Layer], label: str = "<model>", limits: Limits = DEFAULT_LIMITS) -> None:
    """Build every layer's kernel once; raise one error listing every unsupported op and attribute.

    A kernel's attribute check that fails with anything but an asyncinfer error (a malformed
    attribute it did not foresee) is a ModelLoadError naming the layer, never a raw exception."""
    problems: list[str] = []
    for layer in layers:
        for part in [layer] + layer.fused:
            try:
                ops.create(part, limits)
            except UnsupportedOperatorError as exc:
                problems += [f"{p} (layer {part.name!r})" if part.name not in p else p for p in exc.problems]
            except AsyncInferError:
                raise
            except Exception as exc:  # noqa: BLE001 - the safety net the docstring promises
                raise ModelLoadError(f"{label}: {part.describe()} has malformed attributes or subgraphs: "
                                     f"{type(exc).__name__}: {exc}") from exc
    if problems:
        raise UnsupportedOperatorError(problems)
