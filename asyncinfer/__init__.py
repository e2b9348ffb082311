"""asyncinfer: an async-first ONNX inference engine.

Scheduling a model never blocks; every layer is a future in a task graph; outputs are read back
when the caller awaits, polls or is called back::

    import asyncinfer as ai
    model = ai.load_model("model.onnx")
    async with ai.Worker(model, "cpu") as worker:
        worker.schedule(x)
        y = await worker.peek_output().readback_and_clone_async()
"""
from .backends import BackendType
from .errors import (
    AsyncInferError,
    BackendUnavailableError,
    DisposedError,
    ExecutionError,
    InputError,
    LimitExceededError,
    ModelLoadError,
    ModelTooLargeError,
    RequestTooLargeError,
    UnsupportedOperatorError,
)
from .limits import Limits
from .model.compress import CompressedModel, quantize_weights
from .model.ir import Layer, Model, TensorInfo
from .loader import load_model
from .runtime.execution import Execution
from .runtime.inputs import InputShapeWarning
from .runtime.generation import (FinishReason, GenerationStats, TextStream, TextTokenizer, TokenizerUnavailableError,
                                 TokenStream)
from .runtime.plan import Placement
from .runtime.profiling import OpTotal, Profile, RunRecord, StepRecord
from .runtime.worker import Worker, WorkerState
from .tensor import Tensor, TensorData, TensorState

__version__ = "0.1.0"

__all__ = [
    "AsyncInferError",
    "BackendType",
    "CompressedModel",
    "BackendUnavailableError",
    "DisposedError",
    "Execution",
    "ExecutionError",
    "FinishReason",
    "GenerationStats",
    "InputError",
    "InputShapeWarning",
    "Layer",
    "LimitExceededError",
    "Limits",
    "Model",
    "ModelLoadError",
    "ModelTooLargeError",
    "OpTotal",
    "Placement",
    "Profile",
    "RequestTooLargeError",
    "RunRecord",
    "StepRecord",
    "Tensor",
    "TensorData",
    "TensorInfo",
    "TensorState",
    "TextStream",
    "TextTokenizer",
    "TokenStream",
    "TokenizerUnavailableError",
    "UnsupportedOperatorError",
    "Worker",
    "WorkerState",
    "load_model",
    "quantize_weights",
    "__version__",
]
