"""The model intermediate representation: a topologically ordered list of layers over named values.

The IR is backend-neutral and immutable once a worker is built on it. Constants (initializers,
folded layers) live in ``Model.constants``; every other value is produced by exactly one layer or
is a model input (an overridable initializer is an input with a default, ``Model.input_defaults``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from ..limits import DEFAULT_LIMITS, Limits

Dim = Union[int, str, None]  # a fixed size, a symbolic name, or unknown


@dataclass(frozen=True)
class TensorInfo:
    """Name, element type and (possibly symbolic) shape of a model input or output."""

    name: str
    dtype: np.dtype | None
    shape: tuple[Dim, ...] | None  # None: rank unknown
    kind: str = "tensor"  # or "sequence", "optional" (of tensors), "map"

    def __repr__(self) -> str:
        dt = "?" if self.dtype is None else np.dtype(self.dtype).name
        shape = "?" if self.shape is None else "(" + ", ".join("?" if d is None else str(d) for d in self.shape) + ")"
        return f"TensorInfo({self.name!r}, {dt}, {shape})"


@dataclass
class Layer:
    """One op applied to named input values, producing named output values.

    ``inputs`` holds ``""`` for an omitted optional input. ``version`` is the opset version of the
    layer's domain in the model. ``fused`` lists element-wise activation layers the optimizer
    folded into this one: a backend applies them, in order, to the layer's first output.
    """

    name: str
    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""
    version: int = 0
    fused: list["Layer"] = field(default_factory=list)
    cpu_bound: bool = False
    # A Concat that extends a graph input into a graph output (a KV cache): its CPU kernel may
    # append in place after the input (ops/cache_append.py). Set by the optimizer.
    appends_cache: bool = False
    # A link of a chain of Concats, each extending the one before (DenseNet's dense blocks: every
    # layer's features appended to all before): its CPU kernel appends in place after its first
    # input where that has room, and writes a result of its own into a buffer with room for this
    # many more entries along the axis, the rest of the chain's (ops/cache_append.py). None: a
    # plain Concat. Set by the optimizer.
    grow_room: int | None = None
    # Values from enclosing scopes that this layer's subgraphs read (If/Loop/Scan bodies); they are
    # also the last entries of ``inputs``, so scheduling waits for them like for any input.
    outer_inputs: list[str] = field(default_factory=list)
    # A fused layer's pattern, the layers it replaced in order: a backend without a kernel for the
    # fused op runs them instead (see runtime/plan.py). Their outside inputs are this layer's.
    expansion: list["Layer"] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """``op_type`` with its fused activations, e.g. ``Conv+Relu``."""
        return "+".join([self.op_type] + [f.op_type for f in self.fused])

    def describe(self) -> str:
        return f"layer {self.name!r} ({self.kind})"


@dataclass
class Model:
    """An ONNX model imported into the asyncinfer IR. Build one with [`load_model`][asyncinfer.load_model]."""

    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    layers: list[Layer]
    constants: dict[str, np.ndarray]
    opsets: dict[str, int]
    value_info: dict[str, TensorInfo] = field(default_factory=dict)
    name: str = "model"
    producer: str = ""
    source: str = "<memory>"
    cpu_bound_values: set[str] = field(default_factory=set)
    optimizations: dict[str, int] = field(default_factory=dict)
    # The bounds the model was loaded under; workers apply the run limits among them.
    limits: Limits = DEFAULT_LIMITS
    # Overridable initializers (IR >= 4: an initializer also listed as a graph input, as ONNX
    # Runtime reads it): they are model inputs, listed after the others, and a run that does not
    # feed one uses its default value here. Read-only arrays.
    input_defaults: dict[str, np.ndarray] = field(default_factory=dict)
    # Names of the initializers that are not inputs (constants a caller cannot override), so that
    # feeding one by name is an error that says so.
    constant_initializers: frozenset[str] = frozenset()

    def op_types(self) -> list[str]:
        """Sorted distinct op types of the model's layers (fused activations included)."""
        kinds = {l.op_type for l in self.layers} | {f.op_type for l in self.layers for f in l.fused}
        return sorted(kinds)

    def producers(self) -> dict[str, Layer]:
        return {out: layer for layer in self.layers for out in layer.outputs if out}

    def consumers(self) -> dict[str, list[Layer]]:
        result: dict[str, list[Layer]] = {}
        for layer in self.layers:
            for name in layer.inputs:
                if name:
                    result.setdefault(name, []).append(layer)
        return result

    def __repr__(self) -> str:
        return (f"Model({self.name!r}, inputs={self.inputs}, outputs={self.outputs}, "
                f"layers={len(self.layers)}, constants={len(self.constants)})")
