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

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .. import ops
from ..backends.base import HOST, Backend, Step, StepKind
from ..backends.device import DeviceBackend
from ..concurrency.future import TaskFuture
from ..errors import ExecutionError
from ..model.ir import Layer, Model, TensorInfo

Ref = tuple[int, int]

#: Layers whose output is a new array that shares memory with no input and with nothing the layer
#: keeps: a value one makes may be given up to the step that reads it last (`Plan._plan_donations`).
DONOR_OP_TYPES = frozenset({"Conv", "ResidualConv"})


@dataclass(eq=False, slots=True)
class Node:
    """A step placed in the task graph: the backend that runs it and where its inputs come from."""

    step: Step
    backend: Backend
    inputs: list[Ref | None]        # None: omitted optional input
    sources: tuple[int, ...] = ()   # distinct step/input sources this step waits for
    release: list[Ref] = field(default_factory=list)  # values whose last reader is this step
    # ``release`` split (`Plan._plan_releases`): values this step alone reads (freed without
    # counting or locking) and values several steps read (counted down under the run's lock)
    release_sole: list[Ref] = field(default_factory=list)
    release_shared: list[Ref] = field(default_factory=list)
    #: Inputs (by position) whose arrays this step may write over (`Plan._plan_donations`), in
    #: runs that hand no layer's value to the caller (`Execution.private`): they compute it with
    #: ``donating`` (the kernel's `Op.donating_run`) instead of ``inline``
    donated: tuple[int, ...] = ()
    index: int = field(init=False)     # (copies of the step's: read for every step of every run)
    layer: Layer = field(init=False)
    #: What a job of an unprofiled run calls for this step (inputs -> outputs) instead of
    #: dispatching it with a completion (`Backend.inline_compute`): None where the backend has
    #: none, for transfers, and for kernels that need their completion's cancellation check
    #: (`Op.cancellable`).
    inline: Callable[[list], list] | None = field(init=False)
    donating: Callable[[list], list] | None = field(init=False)

    def __post_init__(self) -> None:
        self.index, self.layer = self.step.index, self.step.layer
        op = self.step.op
        self.inline = self.backend.inline_compute(self.step) if op is not None and not op.cancellable else None
        self.donating = None


@dataclass(eq=False)
class Segment:
    """Consecutive steps that run as one job (see `Plan._plan_segments`)."""

    nodes: list[Node]
    light: bool                    # its steps may run inside a job
    sources: tuple[int, ...] = ()  # sources outside the segment that its steps wait for
    #: (step index, layer name) of each step whose future is made when the segment is submitted
    labels: tuple[tuple[int, str], ...] = ()
    #: Its steps that only later steps of the segment read (not its last, not a kept value):
    #: nothing outside waits for them, so a run makes their futures only when asked
    #: (`Execution.step_future`), and the job passes their values on in the run's value list.
    private: tuple[int, ...] = ()
    #: ``private`` as runs of consecutive step indices, ``(start, stop)``: a run marks them in
    #: its futures a slice at a time (a chain of 1000 small layers: 30 µs as a loop, 2 as slices)
    private_spans: tuple[tuple[int, int], ...] = ()


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
        self.nodes: list[Node] = []
        placement: dict[str, str] = {}
        fallback_layers: list[str] = []
        transfer_names: list[str] = []

        def transfer(name: str, ref: Any, kind: StepKind, device_backend: Backend, want: str) -> Any:
            to = device_backend.name if kind is StepKind.UPLOAD else HOST
            layer = Layer(name=f"{kind.value} {name} to {to}", op_type=kind.value.capitalize(),
                          inputs=[name], outputs=[f"{name}@{want}"])
            node = Node(Step(index=len(self.nodes), layer=layer, kind=kind), device_backend, inputs=[ref])
            self.nodes.append(node)
            transfer_names.append(layer.name)
            return (node.index, 0)

        pending = model.layers[::-1]  # popped from the end: in order, a fused layer's expansion in its place
        while pending:
            layer = pending.pop()
            op = ops.create(layer, model.limits)
            self._bind_constants(op)
            on_device = backend.device != HOST
            keep_on_host = on_device and layer.cpu_bound and fallback is not None
            target, kernel = backend, None if keep_on_host else backend.prepare(layer, op, types)
            if kernel is None and on_device and layer.expansion and not keep_on_host:
                pending += layer.expansion[::-1]  # the layers the fusion replaced may all run here
                continue
            if kernel is None:  # no kernel here (or a value the scheduler needs): the CPU runs it
                target = fallback or backend
                kernel = target.prepare(layer, op, types)
            uploaded: dict[int, Any] = {}
            if isinstance(target, DeviceBackend) and fallback is not None:
                try:  # constants go to the device once, now, in the layout the kernel wants
                    uploaded = {i: target.upload_constant(kernel, i, model.constants[name])
                                for i, name in enumerate(layer.inputs)
                                if name in model.constants and i not in target.host_inputs(kernel)
                                and i not in op.metadata_inputs}
                except Exception:  # noqa: BLE001 - e.g. int64 values a float texture cannot hold
                    target, kernel, uploaded = fallback, fallback.prepare(layer, op, types), {}
            if target is not backend:
                fallback_layers.append(layer.name)
            host_inputs = target.host_inputs(kernel) if isinstance(target, DeviceBackend) else frozenset()
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
                elif i in uploaded:
                    device_constants.append(uploaded[i])
                    inputs.append((("device_const", len(device_constants) - 1), 0))
                elif want == HOST:
                    copies[(name, want)] = transfer(name, ref, StepKind.DOWNLOAD, self._backend_of(ref), want)
                    inputs.append(copies[(name, want)])
                else:
                    copies[(name, want)] = transfer(name, ref, StepKind.UPLOAD, target, want)
                    inputs.append(copies[(name, want)])
            activations = tuple((ops.create(f, model.limits), [model.constants[n] if n else None for n in f.inputs[1:]])
                                for f in layer.fused)
            step = Step(index=len(self.nodes), layer=layer, op=op, kernel=kernel, activations=activations)
            self.nodes.append(Node(step, target, inputs))
            placement[layer.name] = target.name
            for k, out in enumerate(layer.outputs):
                if out:
                    home[out] = ((step.index, k), target.device)

        self._number_sources(home, constant_names, device_constants)
        # The values a run returns: the model's outputs, unless the plan was made for others
        # (``with_outputs``). Each is kept for the run's life, never released.
        self.output_names = [o.name for o in model.outputs]
        self.output_refs = [self.refs[name] for name in self.output_names]
        self.kept_refs: frozenset[Ref] = frozenset()  # other values never released (``keeping``)
        self.precomputed: dict[int, list[Any]] = {}    # steps not run (``with_precomputed``)
        self.serial_segments = False                    # segments not paths (``for_serial_runs``)
        self._serial_variant: Plan | None = None        # ``for_serial_runs``'s, made once
        # ... and their futures, born complete and shared by every run of this plan: their values
        # are never released (like constants), so no run writes into them.
        self.precomputed_futures: list[tuple[int, TaskFuture]] = []
        self._run_templates: tuple[list[TaskFuture | None], list[Any]] | None = None  # see `run_state`
        self._host_outputs: list[tuple[str, Ref]] | None = None         # see `host_outputs`
        self._plan_releases()
        self.segments = self._plan_segments()
        self.placement = Placement(placement, len(transfer_names), fallback_layers, transfer_names,
                                   len(device_constants))

    def with_outputs(self, names: Sequence[str]) -> "Plan":
        """This plan, returning the values ``names`` (any value of the graph: the model's inputs,
        outputs, constants or layer outputs; the caller checked them). The model's outputs stay
        readable too. Layers, kernels and device constants are shared with this plan; only which
        values are kept differs, so a specialised plan costs no placement and no upload."""
        return self._variant(output_names=list(names), output_refs=[self.refs[name] for name in names])

    def keeping(self, names: Sequence[str]) -> "Plan":
        """This plan, with the values ``names`` kept for the run's life (never released), its
        outputs unchanged: how a run records values for later runs (see ``specialise.py``)."""
        return self._variant(kept_refs=self.kept_refs | {self.refs[name] for name in names})

    def with_precomputed(self, values: dict[int, list[Any]]) -> "Plan":
        """This plan, with the steps in ``values`` (step index → its outputs) not run: a run's
        futures for them are born complete with those values (see ``specialise.py``).

        Steps whose values only precomputed steps read (a tensor made only for ``Shape`` to
        read, such as the repeated K heads of a fused grouped-query attention) are not run
        either: their futures are born failed, saying so, for anyone who asks for them."""
        precomputed = {**self.precomputed, **values}
        futures = [(index, TaskFuture.completed(outputs, label=self.nodes[index].layer.name))
                   for index, outputs in precomputed.items()]
        for index in self._unread(precomputed):
            layer = self.nodes[index].layer
            future = TaskFuture(label=layer.name)
            future.set_exception(ExecutionError(
                f"{layer.describe()} did not run: runs of these input shapes need only its shape, "
                "known from an earlier run", layer=layer.name, op_type=layer.op_type))
            futures.append((index, future))
            precomputed[index] = []
        return self._variant(precomputed=precomputed, precomputed_futures=futures)

    def _unread(self, precomputed: dict[int, list[Any]]) -> list[int]:
        """The steps no output, kept value or running step needs once ``precomputed`` are known."""
        n_steps = len(self.nodes)
        needed = {ref[0] for ref in self._kept_values()}
        unread = []
        for node in reversed(self.nodes):
            if node.index in precomputed:
                continue
            if node.index not in needed:
                unread.append(node.index)
                continue
            needed.update(ref[0] for ref in node.inputs if ref is not None and ref[0] < n_steps)
        return unread[::-1]

    def for_serial_runs(self) -> "Plan":
        """This plan, for runs that take their steps one after another (``Execution(serial=True)``):
        its segments are runs of consecutive light steps in plan order, not only paths (see
        `_plan_segments`). A serial run gains nothing from starting independent branches apart,
        so a whole decode step (GPT-2: ~320 steps, ~50 paths) becomes one job, each step still
        completing its own layer future, with no hand-off or callback between paths. Made once
        per plan."""
        if self.serial_segments:
            return self
        if self._serial_variant is None:
            self._serial_variant = self._variant(serial_segments=True)
        return self._serial_variant

    def with_op(self, index: int, op: ops.Op) -> "Plan":
        """This plan with host step ``index`` running ``op`` instead of its layer's own (same
        inputs, same outputs): how the generation engine computes only the logits it reads."""
        node = self.nodes[index]
        self._bind_constants(op)
        kernel = node.backend.prepare(node.layer, op, value_types(self.model))
        plan = self._variant()
        # (the op's own way, without the donations planned for the layer's)
        plan.nodes[index] = replace(plan.nodes[index], step=replace(node.step, op=op, kernel=kernel), donated=())
        plan.segments = plan._plan_segments()  # they hold the nodes themselves
        return plan

    def _bind_constants(self, op: ops.Op) -> None:
        """Tell ``op`` which of its layer's inputs are the model's constants (`Op.bind_constants`)."""
        constants = self.model.constants
        op.bind_constants({i: constants[name] for i, name in enumerate(op.layer.inputs) if name in constants})

    def _variant(self, **changes: Any) -> "Plan":
        """A copy with ``changes`` to which values are kept or known, its releases and segments
        planned again; layers, kernels and device constants are shared."""
        plan = copy.copy(self)
        plan.__dict__.update(changes)
        plan._run_templates = plan._serial_variant = plan._host_outputs = None
        plan.nodes = [replace(node, release=[], donated=()) for node in self.nodes]
        plan._plan_releases()
        plan.segments = plan._plan_segments()
        return plan

    def host_outputs(self) -> list[tuple[str, Ref]]:
        """The outputs a run returns that are in host memory when their step is done (not on a
        device), as ``(name, ref)``, the one whose step comes last first: the order to wait for
        them in, so that the waiter usually wakes once. Worked out once."""
        outputs = self._host_outputs
        if outputs is None:
            on_host = [(name, ref) for name, ref in zip(self.output_names, self.output_refs)
                       if ref[0] >= len(self.nodes) or self.nodes[ref[0]].backend.device == HOST]
            outputs = self._host_outputs = sorted(on_host, key=lambda item: -item[1][0])
        return outputs

    def run_state(self) -> tuple[list[TaskFuture | None], list[Any]]:
        """A new run's futures and values, one of each per source (steps, inputs, constants):
        None for the steps and inputs, the constants and precomputed steps in place (their
        shared born-complete futures, their lists of outputs). Two list copies a run (GPT-2's
        decode step has ~560 precomputed steps: a loop placing them cost 30-60 µs a step)."""
        templates = self._run_templates
        if templates is None:
            futures: list[TaskFuture | None] = [None] * self.n_sources
            futures[self.n_sources - len(self.constant_futures):] = self.constant_futures
            for index, future in self.precomputed_futures:
                futures[index] = future
            # (a precomputed step no one reads is born failed: its value None, read by no step)
            values = [None if f is None else f.peek() for f in futures]
            templates = self._run_templates = (futures, values)
        return templates[0].copy(), templates[1].copy()

    def info(self, name: str) -> TensorInfo | None:
        """What the model declares or shape inference knows of value ``name`` (None: nothing)."""
        model = self.model
        for info in (*model.outputs, *model.inputs):
            if info.name == name:
                return info
        if name in model.value_info:
            return model.value_info[name]
        if name in model.constants:
            value = model.constants[name]
            return TensorInfo(name, getattr(value, "dtype", None), getattr(value, "shape", None))
        return None

    def _backend_of(self, ref: Any) -> Backend:
        return self.nodes[ref[0]].backend

    def _number_sources(self, home: dict[str, tuple[Any, str]], constant_names: list[str],
                        device_constants: list[Any]) -> None:
        """Give inputs and constants their source numbers, after the steps."""
        model = self.model
        n_steps = len(self.nodes)
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

        for node in self.nodes:
            node.inputs = [resolve(r) for r in node.inputs]
            # Model inputs count too: one may be a pending tensor chained from another run.
            node.sources = tuple(sorted({r[0] for r in node.inputs if r is not None and r[0] < first_constant}))
        self.refs: dict[str, Ref] = {name: resolve(ref) for name, (ref, _) in home.items()}  # type: ignore[misc]

    def _plan_segments(self) -> list[Segment]:
        """Cut the steps into segments: maximal paths of consecutive light layers on a backend
        that runs jobs, each reading the one before it and otherwise only values of the path,
        model inputs or constants. A segment runs as one job on one thread (it was a path: no
        parallelism is lost), so its layers cost no dispatch each. Every other step is a segment
        of its own, as is a kernel the backend keeps out of jobs (`Backend.job_may_hold`: the CPU
        backend's GEMM-based kernels while they take turns in its lane).

        A plan for serial runs (`for_serial_runs`) drops the path rule: a light step joins the
        segment before it whenever everything it reads is in that segment or complete before
        the run starts, so a segment never waits midway and branches run in plan order."""
        n_steps = len(self.nodes)
        segments: list[Segment] = []
        members: set[int] = set()
        ready = self.precomputed  # born complete: no segment waits for them
        for node in self.nodes:
            if node.index in ready:
                continue
            step = node.step
            light = (node.backend.runs_jobs and step.kind is StepKind.LAYER
                     and node.backend.job_may_hold(step.kernel))
            last = segments[-1].nodes[-1] if segments else None
            if (light and last is not None and last.backend is node.backend and segments[-1].light
                    and (self.serial_segments or last.index in node.sources)
                    and all(s in members or s >= n_steps or s in ready for s in node.sources)):
                segments[-1].nodes.append(node)
                members.add(node.index)
                continue
            segments.append(Segment([node], light))
            members = {node.index}
        kept = {ref[0] for ref in self._kept_values()}
        readers: dict[int, set[int]] = {}
        for node in self.nodes:
            for s in node.sources:
                readers.setdefault(s, set()).add(node.index)
        for segment in segments:
            inside = {n.index for n in segment.nodes}
            last = segment.nodes[-1].index
            private = {n.index for n in segment.nodes
                       if n.index != last and n.index not in kept and readers.get(n.index, set()) <= inside}
            segment.private = tuple(sorted(private))
            segment.private_spans = _spans(segment.private)
            segment.labels = tuple((n.index, n.layer.name) for n in segment.nodes if n.index not in private)
            segment.sources = tuple(sorted({s for n in segment.nodes for s in n.sources
                                            if s not in inside and s not in ready}))
        return segments

    def _kept_values(self) -> set[Ref]:
        """The values a run keeps for its whole life, never released: what it returns, the
        model's outputs and the values kept for later runs (``keeping``)."""
        return set(self.output_refs) | {self.refs[o.name] for o in self.model.outputs} | self.kept_refs

    def _plan_releases(self) -> None:
        """Free each intermediate value after its last reader, so a run holds only live tensors."""
        n_steps = len(self.nodes)
        keep = self._kept_values()
        # Steps complete out of order, so "last in plan order" is not "last in time": count readers.
        self.reader_counts: dict[Ref, int] = {}
        for node in self.nodes:
            if node.index in self.precomputed:  # born complete: reads nothing
                continue
            for ref in set(r for r in node.inputs if r is not None and r[0] < n_steps and r not in keep
                           and r[0] not in self.precomputed):
                self.reader_counts[ref] = self.reader_counts.get(ref, 0) + 1
                node.release.append(ref)
        for node in self.nodes:
            node.release_sole = [r for r in node.release if self.reader_counts[r] == 1]
            node.release_shared = [r for r in node.release if self.reader_counts[r] > 1]
        # a run counts down only the values several steps read
        self.reader_counts = {ref: count for ref, count in self.reader_counts.items() if count > 1}
        self._plan_donations(keep)

    def _plan_donations(self, keep: set[Ref]) -> None:
        """Give each step whose kernel may write over some of its inputs (`Op.donatable_inputs`:
        a ResidualConv's residual) those whose value is dead once it has read them: made by a
        layer of `DONOR_OP_TYPES` on the step's own backend (a new array, sharing memory with no
        other value), not kept (an output, a value kept for later runs), not another input of
        the step too, and read by no step that may run after it (every other reader is one of
        its ancestors). Its ``donating`` then is the kernel's `Op.donating_run`, which the runs
        that hand no layer's value to their caller compute it with (`Execution.private`: a
        `schedule()`d run hands out its layers' futures, whose values a callback may still be
        reading while later layers run)."""
        n_steps = len(self.nodes)
        candidates = [node for node in self.nodes if node.inline is not None and node.index not in self.precomputed
                      and getattr(node.step.kernel, "donatable_inputs", ())]
        if not candidates:
            return
        readers: dict[Ref, list[int]] = {}
        ancestors = [0] * n_steps  # bit j of ancestors[i]: step j runs before step i
        for node in self.nodes:
            bits = 0
            for ref in node.inputs:
                if ref is not None and ref[0] < n_steps:
                    bits |= ancestors[ref[0]] | (1 << ref[0])
            ancestors[node.index] = bits
            if node.index not in self.precomputed:
                for ref in set(r for r in node.inputs if r is not None):
                    readers.setdefault(ref, []).append(node.index)
        for node in candidates:
            donated = []
            for i in node.step.kernel.donatable_inputs:
                ref = node.inputs[i] if i < len(node.inputs) else None
                if (ref is None or ref[0] >= n_steps or ref in keep or ref[0] in self.precomputed
                        or node.inputs.count(ref) != 1):
                    continue
                producer = self.nodes[ref[0]]
                if (producer.step.kind is not StepKind.LAYER or producer.step.layer.op_type not in DONOR_OP_TYPES
                        or producer.backend is not node.backend):
                    continue
                if all(reader == node.index or ancestors[node.index] >> reader & 1 for reader in readers[ref]):
                    donated.append(i)
            if donated:
                node.donated = tuple(donated)
                node.donating = node.backend.inline_compute(node.step, node.donated)


def _spans(indices: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Sorted ``indices`` as runs of consecutive numbers, ``(start, stop)`` each."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
    return tuple((start, stop) for start, stop in spans)
