"""The compiled plan of a worker: each layer with its kernel, its backend and where its inputs come from.

Values are addressed by *source*: sources ``0..len(steps)-1`` are the layers (a layer's future
holds the list of its outputs), then come the model inputs, then the constants. An input
reference is ``(source, output index)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import ops
from ..backends.base import Backend
from ..model.ir import Layer, Model
from ..ops.base import Op
from .future import TaskFuture

Ref = tuple[int, int]


@dataclass
class Step:
    """One layer in the plan."""

    index: int
    layer: Layer
    op: Op
    activations: list[tuple[Op, list]]  # fused activations with their constant extra inputs
    inputs: list[Ref | None]        # None: omitted optional input
    sources: tuple[int, ...]        # distinct layer/input sources this step waits for
    backend: Backend
    release: list[Ref] = field(default_factory=list)  # values whose last reader is this step
    n_outputs: int = 0  # outputs the model uses (trailing optional ones may be omitted)

    def __post_init__(self) -> None:
        self.n_outputs = len([o for o in self.layer.outputs if o])


@dataclass
class Placement:
    """Where each layer runs: ``layers`` maps layer name → backend name; ``transfers`` counts device copies."""

    layers: dict[str, str]
    transfers: int
    fallback: list[str]

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for b in self.layers.values():
            counts[b] = counts.get(b, 0) + 1
        return f"Placement({counts}, transfers={self.transfers}, fallback={len(self.fallback)} layers)"


class Plan:
    """Everything about running ``model`` that does not change between runs."""

    def __init__(self, model: Model, backend: Backend, fallback: Backend | None = None):
        self.model = model
        n_layers = len(model.layers)
        refs: dict[str, Ref] = {}
        self.input_sources: dict[str, int] = {}
        for i, info in enumerate(model.inputs):
            self.input_sources[info.name] = n_layers + i
            refs[info.name] = (n_layers + i, 0)
        self.constant_futures: list[TaskFuture] = []
        for j, (name, value) in enumerate(model.constants.items()):
            refs[name] = (n_layers + len(model.inputs) + j, 0)
            self.constant_futures.append(TaskFuture.completed([value], label=name))
        self.n_sources = n_layers + len(model.inputs) + len(model.constants)

        self.steps: list[Step] = []
        placement: dict[str, str] = {}
        fallback_layers: list[str] = []
        for index, layer in enumerate(model.layers):
            target = backend if backend.supports(layer) and not (layer.cpu_bound and fallback is not None) else (fallback or backend)
            if target is not backend:
                fallback_layers.append(layer.name)
            inputs = [refs[n] if n else None for n in layer.inputs]
            # Model inputs count too: one may be a pending tensor chained from another run.
            sources = tuple(sorted({r[0] for r in inputs if r is not None and r[0] < n_layers + len(model.inputs)}))
            activations = [(ops.create(f), [model.constants[n] if n else None for n in f.inputs[1:]])
                           for f in layer.fused]
            step = Step(index=index, layer=layer, op=ops.create(layer), activations=activations,
                        inputs=inputs, sources=sources, backend=target)
            self.steps.append(step)
            placement[layer.name] = target.name
            for k, out in enumerate(layer.outputs):
                if out:
                    refs[out] = (index, k)
        self.refs = refs
        self.output_refs = [refs[o.name] for o in model.outputs]
        self._plan_releases()
        transfers = sum(1 for s in self.steps for r in s.inputs
                        if r is not None and r[0] < n_layers and self.steps[r[0]].backend is not s.backend)
        self.placement = Placement(placement, transfers, fallback_layers)

    def _plan_releases(self) -> None:
        """Free each intermediate value after its last reader, so a run holds only live tensors."""
        n_layers = len(self.steps)
        keep = set(self.output_refs)
        # Layers complete out of order, so "last in plan order" is not "last in time": count readers.
        self.reader_counts: dict[Ref, int] = {}
        for step in self.steps:
            for ref in set(r for r in step.inputs if r is not None and r[0] < n_layers and r not in keep):
                self.reader_counts[ref] = self.reader_counts.get(ref, 0) + 1
                step.release.append(ref)
