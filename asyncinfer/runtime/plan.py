"""The compiled plan of a worker: each layer with its kernel, its backend and where its inputs come from.

Values are addressed by *source*: sources ``0..len(steps)-1`` are the steps (a step's future
holds the list of its outputs), then come the model inputs, then the constants (host constants
first, then the device copies made for device layers). An input reference is
``(source, output index)``.

Steps are the model's layers plus the *transfer* steps the plan inserts where a value crosses
between the host and a device: an ``upload`` before the first device layer that reads a host
value, a ``download`` before the first host layer that reads a device value. Each crossing is
made once per run, however many layers read the value. Constants are uploaded once, when the
worker is created, never per run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import ops
from ..backends.base import Backend, DeviceBackend
from ..model.ir import Layer, Model
from ..ops.base import Op
from .future import TaskFuture

Ref = tuple[int, int]
HOST = "cpu"


@dataclass
class Step:
    """One layer (or one transfer) in the plan."""

    index: int
    layer: Layer
    op: Op | None                   # None for transfer steps
    activations: list[tuple[Op, list]]  # fused activations with their constant extra inputs
    inputs: list[Ref | None]        # None: omitted optional input
    sources: tuple[int, ...]        # distinct step/input sources this step waits for
    backend: Backend
    release: list[Ref] = field(default_factory=list)  # values whose last reader is this step
    n_outputs: int = 0  # outputs the model uses (trailing optional ones may be omitted)
    transfer: str | None = None     # "upload" or "download" for transfer steps

    def __post_init__(self) -> None:
        self.n_outputs = len([o for o in self.layer.outputs if o])


@dataclass
class Placement:
    """Where each layer runs.

    ``layers`` maps layer name → backend name; ``fallback`` lists the layers a device backend
    handed to the CPU; ``transfers`` counts the host↔device copies one run costs (listed in
    ``transfer_steps``); ``uploaded_constants`` counts the constants copied to the device once.
    """

    layers: dict[str, str]
    transfers: int
    fallback: list[str]
    transfer_steps: list[str] = field(default_factory=list)
    uploaded_constants: int = 0

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for b in self.layers.values():
            counts[b] = counts.get(b, 0) + 1
        return f"Placement({counts}, transfers={self.transfers}, fallback={len(self.fallback)} layers)"


def value_types(model: Model) -> dict[str, np.dtype | None]:
    """The element type of every value the plan knows of (from shape inference; None: unknown)."""
    types: dict[str, np.dtype | None] = {name: info.dtype for name, info in model.value_info.items()}
    for info in list(model.inputs) + list(model.outputs):
        types[info.name] = info.dtype
    for name, value in model.constants.items():
        types[name] = getattr(value, "dtype", None)
    return types


class Plan:
    """Everything about running ``model`` that does not change between runs."""

    def __init__(self, model: Model, backend: Backend, fallback: Backend | None = None):
        self.model = model
        types = value_types(model)
        constant_names = list(model.constants)
        const_index = {name: j for j, name in enumerate(constant_names)}
        # Where each value is now: (provisional ref, device). Inputs and constants get their
        # final source numbers once the number of steps is known: until then they are keyed.
        home: dict[str, tuple[Any, str]] = {}
        for info in model.inputs:
            home[info.name] = ((("input", info.name), 0), HOST)
        for name in constant_names:
            home[name] = ((("const", const_index[name]), 0), HOST)
        copies: dict[tuple[str, str], Any] = {}
        device_constants: list[Any] = []
        self.steps: list[Step] = []
        placement: dict[str, str] = {}
        fallback_layers: list[str] = []
        transfer_names: list[str] = []

        def transfer(name: str, ref: Any, direction: str, device_backend: Backend, want: str) -> Any:
            to = device_backend.name if direction == "upload" else HOST
            layer = Layer(name=f"{direction} {name} to {to}", op_type=direction.capitalize(),
                          inputs=[name], outputs=[f"{name}@{want}"])
            step = Step(index=len(self.steps), layer=layer, op=None, activations=[], inputs=[ref],
                        sources=(), backend=device_backend, transfer=direction)
            self.steps.append(step)
            transfer_names.append(layer.name)
            return (step.index, 0)

        for layer in model.layers:
            on_device = backend.device != HOST
            use_device = on_device and backend.supports(layer, types) and not (layer.cpu_bound and fallback is not None)
            target = backend if (use_device or not on_device) else (fallback or backend)
            if target is not backend:
                fallback_layers.append(layer.name)
            host_inputs = target.host_inputs(layer) if isinstance(target, DeviceBackend) else frozenset()
            op = ops.create(layer)
            inputs: list[Any] = []
            for i, name in enumerate(layer.inputs):
                if not name:
                    inputs.append(None)
                    continue
                want = HOST if target.device == HOST or i in host_inputs else target.device
                ref, where = home[name]
                if where == want or i in op.metadata_inputs:  # Shape/Size read a device value's shape as is
                    inputs.append(ref)
                elif (name, want) in copies:
                    inputs.append(copies[(name, want)])
                elif name in model.constants:  # uploaded once now, in the layout the kernel wants
                    assert isinstance(target, DeviceBackend)
                    device_constants.append(target.upload_constant(layer, i, model.constants[name]))
                    inputs.append((("device_const", len(device_constants) - 1), 0))
                elif want == HOST:
                    copies[(name, want)] = transfer(name, ref, "download", self._backend_of(ref), want)
                    inputs.append(copies[(name, want)])
                else:
                    copies[(name, want)] = transfer(name, ref, "upload", target, want)
                    inputs.append(copies[(name, want)])
            activations = [(ops.create(f), [model.constants[n] if n else None for n in f.inputs[1:]])
                           for f in layer.fused]
            step = Step(index=len(self.steps), layer=layer, op=op, activations=activations,
                        inputs=inputs, sources=(), backend=target)
            self.steps.append(step)
            placement[layer.name] = target.name
            for k, out in enumerate(layer.outputs):
                if out:
                    home[out] = ((step.index, k), target.device)

        self._number_sources(home, constant_names, device_constants)
        self.output_refs = [self.refs[o.name] for o in model.outputs]
        self._plan_releases()
        self.placement = Placement(placement, len(transfer_names), fallback_layers, transfer_names,
                                   len(device_constants))

    def _backend_of(self, ref: Any) -> Backend:
        return self.steps[ref[0]].backend

    def _number_sources(self, home: dict[str, tuple[Any, str]], constant_names: list[str],
                        device_constants: list[Any]) -> None:
        """Give inputs and constants their source numbers, after the steps."""
        model = self.model
        n_steps = len(self.steps)
        self.input_sources = {info.name: n_steps + i for i, info in enumerate(model.inputs)}
        first_constant = n_steps + len(model.inputs)
        self.constant_futures = [TaskFuture.completed([model.constants[n]], label=n) for n in constant_names]
        self.constant_futures += [TaskFuture.completed([v], label="device constant") for v in device_constants]
        self.n_sources = first_constant + len(self.constant_futures)

        def resolve(ref: Any) -> Ref | None:
            if ref is None or isinstance(ref[0], int):
                return ref
            kind, key = ref[0]
            if kind == "input":
                return (self.input_sources[key], 0)
            if kind == "const":
                return (first_constant + key, 0)
            return (first_constant + len(constant_names) + key, 0)

        for step in self.steps:
            step.inputs = [resolve(r) for r in step.inputs]
            # Model inputs count too: one may be a pending tensor chained from another run.
            step.sources = tuple(sorted({r[0] for r in step.inputs if r is not None and r[0] < first_constant}))
        self.refs: dict[str, Ref] = {name: resolve(ref) for name, (ref, _) in home.items()}  # type: ignore[misc]

    def _plan_releases(self) -> None:
        """Free each intermediate value after its last reader, so a run holds only live tensors."""
        n_steps = len(self.steps)
        keep = set(self.output_refs)
        # Steps complete out of order, so "last in plan order" is not "last in time": count readers.
        self.reader_counts: dict[Ref, int] = {}
        for step in self.steps:
            for ref in set(r for r in step.inputs if r is not None and r[0] < n_steps and r not in keep):
                self.reader_counts[ref] = self.reader_counts.get(ref, 0) + 1
                step.release.append(ref)
