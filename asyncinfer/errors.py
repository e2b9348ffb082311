"""The asyncinfer exception hierarchy.

Every error the engine raises on purpose is an `AsyncInferError`, and its message names the
part of the model at fault (the file, the layer, the op, the input).
"""
from __future__ import annotations

from collections.abc import Iterable


class AsyncInferError(Exception):
    """Base class of every asyncinfer error."""


class ModelLoadError(AsyncInferError):
    """The model could not be read: not ONNX, truncated, cyclic, undefined inputs, unsafe external data…"""


class LimitExceededError(AsyncInferError):
    """An untrusted model, input or request exceeds one of [`asyncinfer.Limits`][asyncinfer.Limits].

    ``limit`` is the name of the ``Limits`` field, ``value`` what was found, ``bound`` the limit.
    """

    def __init__(self, limit: str, value: int, bound: int, what: str):
        super().__init__(f"{what}: {value} exceeds Limits.{limit} = {bound}")
        self.limit, self.value, self.bound = limit, value, bound


class ModelTooLargeError(LimitExceededError, ModelLoadError):
    """A model exceeds a load limit (file size, node count, nesting, tensor size or rank)."""


class UnsupportedOperatorError(AsyncInferError):
    """One or more ops of the model have no implementation; ``problems`` lists every one of them."""

    def __init__(self, problems: Iterable[str]):
        self.problems = list(dict.fromkeys(problems))
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} unsupported operator(s):\n{lines}")


class InputError(AsyncInferError):
    """A missing, extra, wrongly typed or wrongly shaped input, found before any work is scheduled."""


class ExecutionError(AsyncInferError):
    """A kernel failed while the model ran. ``layer`` and ``op_type`` name the layer at fault."""

    def __init__(self, message: str, *, layer: str | None = None, op_type: str | None = None):
        super().__init__(message)
        self.layer = layer
        self.op_type = op_type


class BackendUnavailableError(AsyncInferError):
    """The requested backend cannot run here (no CUDA device, no GL context…); the message says what is missing."""


class DisposedError(AsyncInferError):
    """A worker or tensor was used after ``dispose()``."""


class RequestTooLargeError(LimitExceededError, InputError):
    """An input or a request exceeds a run limit (element count, rank, body size, JSON depth)."""


__all__ = [
    "AsyncInferError",
    "ModelLoadError",
    "UnsupportedOperatorError",
    "InputError",
    "ExecutionError",
    "BackendUnavailableError",
    "DisposedError",
    "LimitExceededError",
    "ModelTooLargeError",
    "RequestTooLargeError",
]
