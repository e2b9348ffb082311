"""ONNX's backend interface (``onnx.backend.base``) over asyncinfer, for tools that drive a backend
through it, ``onnx.backend.test.BackendTest`` first among them::

    import asyncinfer.onnx_backend as backend
    rep = backend.prepare(model_proto)          # load_model + a Worker on the CPU
    outputs = rep.run([x])                      # a tuple of NumPy arrays, also indexable by name
    backend.run_node(node, [x, y])              # one node on its own

``prepare`` is ``load_model`` (the optimizer included) and a ``Worker``; ``run`` is
``Worker.run_blocking``, so an input is checked, and an error raised, exactly as for any other
caller (``InputError``, ``ExecutionError``…). The device is ``"CPU"``: the other backends are reached
through ``Worker`` itself. A ``BackendRep`` holds its worker's threads until it is disposed or
garbage-collected.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from .loader import load_model
from .model.ir import Model
from .runtime.worker import Worker

__all__ = ["AsyncInferBackend", "AsyncInferRep", "node_model", "prepare", "run_model", "run_node",
           "supports_device"]


class AsyncInferRep(BackendRep):
    """A prepared model: its ``Worker``, run again and again by `run`."""

    def __init__(self, model: Model, threads: int | None = None):
        self.model = model
        self.worker = Worker(model, "cpu", threads=threads)
        # The backend-test runner never disposes what ``prepare`` returns: the worker's threads end
        # when this object is collected, or at dispose().
        self._finalizer = weakref.finalize(self, self.worker.dispose)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Outputs in model order, as a tuple that is also indexable by output name.

        ``inputs``: a list or tuple (positional, in ``model.inputs`` order), a mapping by name, or a
        single array for a one-input model. A sequence output is a list of arrays, an empty optional
        is None.
        """
        if kwargs:
            raise TypeError(f"run() takes no options, got {sorted(kwargs)}")
        if isinstance(inputs, (list, tuple)):  # positional, in model order (a sequence input is a list)
            results = self.worker.run_blocking(*inputs)
        else:  # a mapping by name, or the one input's value
            results = self.worker.run_blocking(inputs)
        names = [info.name for info in self.model.outputs]
        return namedtupledict("Outputs", names)(*(results[n] for n in names))

    def dispose(self) -> None:
        """End the worker's threads now (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "AsyncInferRep":
        return self

    def __exit__(self, *exc: object) -> None:
        self.dispose()


class AsyncInferBackend(Backend):
    """``onnx.backend.base.Backend`` for asyncinfer's CPU backend."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> AsyncInferRep:
        """Load ``model`` (a ``ModelProto``, bytes or a path) and build its worker.

        Keyword options: ``threads`` (the CPU pool's size; default the core count) and ``optimize``
        (``load_model``'s). Raises what ``load_model`` raises (``ModelLoadError``,
        ``UnsupportedOperatorError``), or ValueError for a device other than ``"CPU"``.
        """
        if not cls.supports_device(device):
            raise ValueError(f"asyncinfer's ONNX backend runs on 'CPU', not {device!r} "
                             "(use asyncinfer.Worker for the GPU backends)")
        threads = kwargs.pop("threads", None)
        optimize = kwargs.pop("optimize", True)
        if kwargs:
            raise TypeError(f"prepare() got unknown options {sorted(kwargs)}")
        return AsyncInferRep(load_model(model, optimize=optimize), threads=threads)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        """Prepare ``model``, run it once on ``inputs`` and release its worker."""
        with cls.prepare(model, device, **kwargs) as rep:
            return rep.run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[np.dtype, tuple[int, ...]]] | None = None,
                 **kwargs: Any) -> tuple[Any, ...]:
        """Run one node on ``inputs`` (arrays in the order of ``node.input``, or a mapping by name).

        ``opset_version`` (keyword) picks the default domain's opset (default: the newest onnx
        knows); ``outputs_info`` may give each output's (dtype, shape), otherwise they are left to
        the op.
        """
        opset = kwargs.pop("opset_version", None)
        model = node_model(node, inputs, outputs_info, opset)
        return cls.run_model(model, inputs if isinstance(inputs, Mapping) else [v for v in inputs], device, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """True for ``"CPU"`` (``"CPU:0"`` too), False for every other device."""
        try:
            return Device(device).type == DeviceType.CPU
        except (AttributeError, ValueError):
            return False


def node_model(node: onnx.NodeProto, inputs: Any,
               outputs_info: Sequence[tuple[np.dtype, tuple[int, ...]]] | None = None,
               opset: int | None = None) -> onnx.ModelProto:
    """A one-node model around ``node``: graph inputs typed from the given arrays, outputs from
    ``outputs_info`` (else untyped)."""
    names = [n for n in node.input if n]
    values = [inputs[n] for n in names] if isinstance(inputs, Mapping) else list(inputs)
    if len(values) != len(names):
        raise ValueError(f"node {node.op_type!r} takes {len(names)} inputs {names}, got {len(values)}")
    graph_inputs = [_value_info(n, v) for n, v in zip(names, values)]
    graph_outputs = []
    for i, out in enumerate(o for o in node.output if o):
        if outputs_info is not None and i < len(outputs_info):
            dtype, shape = outputs_info[i]
            graph_outputs.append(helper.make_tensor_value_info(out, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                                                               list(shape)))
        else:
            graph_outputs.append(helper.make_empty_tensor_value_info(out))
    opsets = [helper.make_opsetid("", opset if opset is not None else onnx.defs.onnx_opset_version())]
    if node.domain not in ("", "ai.onnx"):
        opsets.append(helper.make_opsetid(node.domain, 1))
    graph = helper.make_graph([node], f"{node.op_type}_node", graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=opsets)


def _value_info(name: str, value: Any) -> onnx.ValueInfoProto:
    if isinstance(value, (list, tuple)):  # a sequence of tensors
        elem = np.asarray(value[0]).dtype if value else np.dtype(np.float32)
        return helper.make_tensor_sequence_value_info(name, helper.np_dtype_to_tensor_dtype(elem), None)
    array = np.asarray(value)
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape))


# The module is the backend, as onnx's runner and other tools expect (``BackendTest(module)``).
# No module-level ``is_compatible``: the runner would skip, not fail, the models it refuses.
prepare = AsyncInferBackend.prepare
run_model = AsyncInferBackend.run_model
run_node = AsyncInferBackend.run_node
supports_device = AsyncInferBackend.supports_device
