"""Control flow: If, Loop, Scan and SequenceMap, built on a small subgraph evaluator.

Each graph attribute is imported once, when the worker is created, into a `Subgraph`:
its layers in topological order, each with a kernel made by `registry.create` (so an
unsupported op inside a body is refused at load, and nested If/Loop kernels build their own
subgraphs recursively). Running a subgraph is a sequential walk over a dict of values local to
the call, so one kernel may run from several threads at once.

Outer-scope values: the importer appends the values a layer's subgraphs read from enclosing
graphs (at any depth) to its inputs and names them in ``layer.outer_inputs``. They seed every
evaluation of the body, and a nested control-flow layer inside the body receives them again as
its own outer inputs, because the importer listed them for it too.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, ClassVar, Optional

import numpy as np
import onnx

from ..concurrency.cancellation import cancel_requested
from ..errors import ModelLoadError, UnsupportedOperatorError
from ..model.ir import Layer, TensorInfo
from ..model.onnx_import import import_graph
from .base import Op
from .registry import create, register
from .shape import int_list, normalize_axis, op_error

# Each schema version of these ops differs from the previous one by the types it admits (and Scan 11
# by allowing negative axes, which every version here accepts).
IF_LOOP_VERSIONS = (1, 11, 13, 16, 19, 21, 23, 24, 25)
SCAN_VERSIONS = (9, 11, 16, 19, 21, 23, 24, 25)
# A custom domain unknown to onnx: take the newest kernel registered for it.
_UNKNOWN_DOMAIN_OPSET = 1 << 30


@lru_cache(maxsize=None)
def _newest_opset(domain: str) -> int:
    """The newest opset onnx knows for ``domain`` (subgraph nodes of a domain the layer is not in)."""
    versions = [s.since_version for s in onnx.defs.get_all_schemas_with_history() if s.domain == domain]
    return max(versions, default=_UNKNOWN_DOMAIN_OPSET)


def _domain(name: str) -> str:
    return "" if name in ("", "ai.onnx") else name


class Subgraph:
    """A graph attribute imported once and evaluated layer by layer on NumPy values."""

    def __init__(self, owner: Op, attr_name: str, opsets: Mapping[str, int] | None = None):
        """``opsets``: the opset of each domain the graph's nodes use; by default the owner's for
        its own domain and the newest onnx knows for the others."""
        graph: onnx.GraphProto = owner.attr(attr_name)
        layer = owner.layer
        self.owner = owner
        opsets = dict(opsets) if opsets is not None else {_domain(layer.domain): layer.version}
        for node in graph.node:
            opsets.setdefault(_domain(node.domain), _newest_opset(_domain(node.domain)))
        label = f"{layer.describe()}, attribute {attr_name!r}"
        _, outputs, layers, constants = import_graph(graph, opsets, label=label, limits=owner.limits,
                                                     outer_scope=frozenset(layer.outer_inputs))
        self.input_names: list[str] = [vi.name for vi in graph.input]  # bound by position
        self.outputs: list[TensorInfo] = outputs
        self.constants = constants
        self.steps: list[tuple[Layer, Op]] = []
        problems: list[str] = []
        for inner in layers:
            inner.name = f"{layer.name}/{attr_name}/{inner.name}"  # errors then locate the inner layer
            try:
                self.steps.append((inner, create(inner, owner.limits)))
            except UnsupportedOperatorError as exc:  # gather them all, as the model support check does
                problems += [p if inner.name in p else f"{p} ({inner.describe()})" for p in exc.problems]
        if problems:
            raise UnsupportedOperatorError(problems)

    def run(self, inputs: Sequence[Any], outer: Mapping[str, Any]) -> list[Any]:
        """The graph's outputs for positional ``inputs`` (the caller checked their count), reading
        ``outer`` for enclosing values. A cancelled run stops here, between iterations."""
        if cancel_requested():
            raise op_error(self.owner, "the run was cancelled while the layer ran")
        values = dict(outer)
        values.update(self.constants)
        values.update(zip(self.input_names, inputs))
        for layer, kernel in self.steps:
            results = kernel(*[values[name] if name else None for name in layer.inputs])
            values.update((name, value) for name, value in zip(layer.outputs, results) if name)
        return [values[info.name] for info in self.outputs]


class _ControlFlow(Op):
    """An op with graph attributes (``graph_attrs``), imported at check time into ``self.graphs``."""

    graph_attrs: ClassVar[tuple[str, ...]] = ()
    cancellable = True  # each body evaluation checks for a cancel first (Subgraph.run)

    def check(self) -> None:
        self.graphs = {name: Subgraph(self, name) for name in self.graph_attrs}

    def split_args(self, args: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
        """The declared inputs, and the outer-scope values by name (they come last)."""
        n_outer = len(self.layer.outer_inputs)
        declared = list(args[:len(args) - n_outer])
        return declared, dict(zip(self.layer.outer_inputs, args[len(args) - n_outer:]))

    def truth(self, value: Any, what: str) -> bool:
        """A one-element boolean tensor as a Python bool."""
        if value is None or np.size(value) != 1:
            raise op_error(self, f"{what} must be a single-element tensor, got {np.shape(value)}")
        return bool(np.asarray(value).reshape(-1)[0])

    def stack(self, items: list[Any], axis: int, info: TensorInfo) -> np.ndarray:
        """Per-iteration outputs stacked along a new ``axis``; with no iteration, an empty tensor
        of the body output's declared dtype and shape where known."""
        if items:
            try:
                return np.stack(items, axis=normalize_axis(self, axis, np.ndim(items[0]) + 1))
            except ValueError as exc:
                raise op_error(self, f"scan output {info.name!r} changes shape between iterations: {exc}") from None
        shape = list(info.shape) if info.shape is not None and all(isinstance(d, int) for d in info.shape) else []
        shape.insert(normalize_axis(self, axis, len(shape) + 1), 0)
        return np.empty(shape, dtype=info.dtype or np.float32)


@register("If", versions=IF_LOOP_VERSIONS)
class If(_ControlFlow):
    """Run ``then_branch`` or ``else_branch`` on a scalar condition."""

    graph_attrs = ("then_branch", "else_branch")
    value_inputs = (0,)

    def check(self) -> None:
        super().check()
        for name, graph in self.graphs.items():
            if graph.input_names or len(graph.outputs) != len(self.layer.outputs):
                raise ModelLoadError(f"{self.layer.describe()}: {name} takes {len(graph.input_names)} inputs "
                                     f"and gives {len(graph.outputs)} outputs, for none and {len(self.layer.outputs)}")

    def run(self, *args: Any) -> tuple[Any, ...]:
        (cond,), outer = self.split_args(args)
        branch = "then_branch" if self.truth(cond, "cond") else "else_branch"
        return tuple(self.graphs[branch].run((), outer))


@register("Loop", versions=IF_LOOP_VERSIONS)
class Loop(_ControlFlow):
    """``body(i, cond, *state) -> (cond, *state, *scan)`` until the trip count or condition ends it;
    scan outputs are stacked along a new first axis."""

    graph_attrs = ("body",)
    value_inputs = (0, 1)

    def run(self, *args: Any) -> tuple[Any, ...]:
        declared, outer = self.split_args(args)
        declared += [None] * (2 - len(declared))
        trip_count, cond, *state = declared
        if trip_count is None and cond is None:
            raise op_error(self, "neither a trip count nor a condition: the loop would never end")
        body = self.graphs["body"]
        n_state = len(state)
        scan_infos = body.outputs[1 + n_state:]
        if len(body.input_names) != 2 + n_state or len(scan_infos) + n_state + 1 != len(body.outputs):
            raise op_error(self, f"body takes {len(body.input_names)} inputs and gives {len(body.outputs)} "
                                 f"outputs for {n_state} loop-carried values")
        limit = None if trip_count is None else int_list(trip_count)[0]
        going = cond if cond is not None else np.array(True)
        keep_going = self.truth(going, "cond")
        scans: list[list[Any]] = [[] for _ in scan_infos]
        i = 0
        while keep_going and (limit is None or i < limit):
            outs = body.run([np.array(i, dtype=np.int64), going, *state], outer)
            going, state = outs[0], outs[1:1 + n_state]
            for acc, value in zip(scans, outs[1 + n_state:]):
                acc.append(value)  # a scan output grows with the (data-given) trip count: bounded
                self.check_allocation((len(acc),) + np.shape(value), "scan output")
            if cond is not None:  # without a cond input, the body's condition is ignored
                keep_going = self.truth(going, "the body's condition output")
            i += 1
        return tuple(state) + tuple(self.stack(acc, 0, info) for acc, info in zip(scans, scan_infos))


class _ScanBase(_ControlFlow):
    graph_attrs = ("body",)

    def iterate(self, states: list[Any], sequences: list[Any], outer: dict[str, Any]
                ) -> tuple[list[Any], list[list[Any]]]:
        """Run the body along axis 0 of ``sequences`` (already ordered and sliced): the final
        states and, per scan output, the list of per-step values."""
        body = self.graphs["body"]
        if len(body.input_names) != len(states) + len(sequences) or len(body.outputs) < len(states):
            raise op_error(self, f"body takes {len(body.input_names)} inputs and gives {len(body.outputs)} outputs "
                                 f"for {len(states)} states and {len(sequences)} scan inputs")
        n_state = len(states)
        per_step: list[list[Any]] = [[] for _ in body.outputs[n_state:]]
        for t in range(len(sequences[0]) if sequences else 0):
            outs = body.run([*states, *(s[t] for s in sequences)], outer)
            states = outs[:n_state]
            for acc, value in zip(per_step, outs[n_state:]):
                acc.append(value)
        return states, per_step

    def attr_list(self, name: str, count: int, what: str) -> list[int]:
        """An ints attribute with one value per scan input/output (0 each when absent)."""
        values = [int(v) for v in self.attr(name, [0] * count)]
        if len(values) != count:
            raise op_error(self, f"{name} has {len(values)} values for {count} {what}")
        return values


@register("Scan", versions=SCAN_VERSIONS)
class Scan(_ScanBase):
    """Scan (opset 9+): iterate over ``scan_input_axes`` of the scan inputs, carrying states."""

    def run(self, *args: Any) -> tuple[Any, ...]:
        declared, outer = self.split_args(args)
        m = self.attr("num_scan_inputs")
        n = len(declared) - m
        if n < 0 or m < 1:
            raise op_error(self, f"num_scan_inputs={m} does not fit {len(declared)} inputs")
        states, inputs = declared[:n], declared[n:]
        axes = self.attr_list("scan_input_axes", m, "scan inputs")
        directions = self.attr_list("scan_input_directions", m, "scan inputs")
        sequences = []
        for x, axis, backward in zip(inputs, axes, directions):
            view = np.moveaxis(x, normalize_axis(self, axis, np.ndim(x)), 0)
            sequences.append(view[::-1] if backward else view)
        if len({len(s) for s in sequences}) != 1:
            raise op_error(self, f"scan inputs have different lengths {[len(s) for s in sequences]}")
        states, per_step = self.iterate(states, sequences, outer)
        k = len(per_step)
        out_axes = self.attr_list("scan_output_axes", k, "scan outputs")
        out_directions = self.attr_list("scan_output_directions", k, "scan outputs")
        infos = self.graphs["body"].outputs[n:]
        outputs = [self.stack(acc[::-1] if backward else acc, axis, info)
                   for acc, axis, backward, info in zip(per_step, out_axes, out_directions, infos)]
        return tuple(states) + tuple(outputs)


@register("Scan", versions=(8,))
class Scan8(_ScanBase):
    """Scan (opset 8): axis 0 of every state and scan input is a batch axis, axis 1 the scanned one;
    optional ``sequence_lens`` per batch entry (scan outputs zero-padded past it)."""

    def run(self, *args: Any) -> tuple[Any, ...]:
        declared, outer = self.split_args(args)
        sequence_lens: Optional[np.ndarray] = declared[0]
        m = self.attr("num_scan_inputs")
        n = len(declared) - 1 - m
        if n < 0 or m < 1:
            raise op_error(self, f"num_scan_inputs={m} does not fit {len(declared) - 1} inputs")
        states, inputs = declared[1:1 + n], declared[1 + n:]
        directions = self.attr_list("directions", m, "scan inputs")
        batch, max_len = np.shape(inputs[0])[:2]
        lengths = [max_len] * batch if sequence_lens is None else int_list(sequence_lens)
        if len(lengths) != batch or any(not 0 <= t <= max_len for t in lengths):
            raise op_error(self, f"sequence_lens {lengths} do not fit batch {batch} and length {max_len}")
        infos = self.graphs["body"].outputs[n:]
        final: list[list[Any]] = [[] for _ in states]
        scans: list[list[Any]] = [[] for _ in infos]
        for b, length in enumerate(lengths):
            sequences = [x[b, :length][::-1] if backward else x[b, :length] for x, backward in zip(inputs, directions)]
            st, per_step = self.iterate([s[b] for s in states], sequences, outer)
            for acc, value in zip(final, st):
                acc.append(value)
            for acc, steps, info in zip(scans, per_step, infos):
                out = self.stack(steps, 0, info)
                pad = [(0, max_len - out.shape[0])] + [(0, 0)] * (out.ndim - 1)
                acc.append(np.pad(out, pad) if length < max_len else out)
        if batch == 0:
            return tuple(states) + tuple(self.stack([], 0, info)[None] for info in infos)
        return tuple(np.stack(acc) for acc in final) + tuple(np.stack(acc) for acc in scans)


@register("SequenceMap", versions=(17,))
class SequenceMap(_ControlFlow):
    """Apply ``body`` to each element of the input sequences (tensor inputs are passed whole)."""

    graph_attrs = ("body",)

    def run(self, *args: Any) -> tuple[list[Any], ...]:
        declared, outer = self.split_args(args)
        if not isinstance(declared[0], list):
            raise op_error(self, f"input 0 must be a sequence, got {type(declared[0]).__name__}")
        count = len(declared[0])
        lengths = [len(x) for x in declared if isinstance(x, list)]
        if any(n != count for n in lengths):
            raise op_error(self, f"input sequences have different lengths {lengths}")
        body = self.graphs["body"]
        if len(body.input_names) != len(declared):
            raise op_error(self, f"body takes {len(body.input_names)} inputs, the node has {len(declared)}")
        outputs: list[list[Any]] = [[] for _ in body.outputs]
        for i in range(count):
            results = body.run([x[i] if isinstance(x, list) else x for x in declared], outer)
            for acc, value in zip(outputs, results):
                acc.append(value)
        return tuple(outputs)
