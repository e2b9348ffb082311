"""Shape specialisation: the shape arithmetic of a run, computed once per input-shape signature.

Exported transformers rebuild their reshape targets on every run: ``Shape`` of an activation,
then ``Gather``/``Unsqueeze``/``Concat``/``Slice`` on the resulting little vectors (GPT-2's decode
step: about 200 of its 321 layers). When the model's input dims are symbolic, load-time folding
cannot remove them. But in most models those values depend on the input *shapes* only: then,
once a run with given input shapes and types has computed them, every later run with the same
signature can take them as constants, and their layers are not dispatched at all.

Which layers: `shape_determined_nodes`. A host layer is *shape-determined* if it is a
``Shape``/``Size`` or all its inputs are constants or shape-determined values (random ops never).
That the values depend on the input shapes alone holds when every shape any layer takes from a
value (its ``value_inputs``: Reshape's target, Slice's bounds, Expand's shape…) is itself
shape-determined, and no layer has an output shape that depends on data by nature (NonZero,
Unique, NonMaxSuppression, control flow, sequences). Models that break this are not specialised.

How: the first run with a new signature keeps the shape-determined values alive
(``Plan.keeping``) and records them when it completes; later runs with that signature run
``Plan.with_precomputed(values)``, whose futures for those layers are born complete. A bounded
number of signatures is kept per worker (they may come from untrusted requests).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .. import ops
from ..backends.base import HOST, StepKind
from ..concurrency.future import TaskFuture
from ..errors import AsyncInferError
from ..ops.fused import FUSED_DOMAIN
from .plan import Plan

#: Signatures whose precomputed values a worker keeps (least recently used ones are dropped).
MAX_SIGNATURES = 16
#: A shape-determined layer with more output elements than this is computed every run instead of
#: held per signature (a large mask built by ConstantOfShape, say): memory stays bounded.
MAX_PRECOMPUTED_ELEMENTS = 1 << 20
#: Ops whose output shape depends on the *values* of a data input by nature (or that run
#: subgraphs): a model holding one is never specialised.
DATA_DEPENDENT_SHAPES = frozenset({
    "NonZero", "Unique", "Compress", "NonMaxSuppression", "StringSplit", "If", "Loop", "Scan",
    "SequenceMap", "ConcatFromSequence", "SplitToSequence", "SequenceConstruct", "SequenceEmpty",
    "SequenceInsert", "SequenceErase", "SequenceAt", "SequenceLength", "Optional", "OptionalGetElement",
    "OptionalHasElement",
})
#: Ops giving different values on every run.
NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                              "Multinomial", "Bernoulli", "Dropout"})
SHAPE_READERS = frozenset({"Shape", "Size"})


def shape_determined_nodes(plan: Plan) -> tuple[int, ...]:
    """The indices of the plan's host layers whose values depend only on the input shapes and
    types, or ``()`` when the model does not allow specialisation (see the module docstring)."""
    model = plan.model
    if any((layer.domain and layer.domain != FUSED_DOMAIN) or layer.op_type in DATA_DEPENDENT_SHAPES
           for layer in model.layers):
        return ()
    derived: set[str] = set()
    chosen: list[int] = []
    for node in plan.nodes:
        layer = node.layer
        if node.step.kind is not StepKind.LAYER or node.backend.device != HOST or layer.op_type in NONDETERMINISTIC:
            continue
        from_shapes = layer.op_type in SHAPE_READERS or (
            any(layer.inputs) and all(not n or n in model.constants or n in derived for n in layer.inputs))
        if from_shapes:
            derived.update(o for o in layer.outputs if o)
            chosen.append(node.index)
    if not chosen:
        return ()
    for layer in model.layers:  # every shape taken from a value must come from the shapes
        try:
            value_inputs = ops.lookup(layer.op_type, layer.version, layer.domain).value_inputs
        except AsyncInferError:
            return ()
        for i in value_inputs:
            name = layer.inputs[i] if i < len(layer.inputs) else ""
            if name and name not in model.constants and name not in derived:
                return ()
    return tuple(chosen)


def signature(futures: Mapping[str, TaskFuture]) -> tuple | None:
    """The input shapes and types of a run, or None when one is not known yet (a pending tensor
    chained from another run)."""
    key = []
    for name, future in futures.items():
        if not future.done() or future.failed():
            return None
        value = future.peek()[0]
        shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
        if shape is None or dtype is None:
            return None
        key.append((name, shape if type(shape) is tuple else tuple(shape), dtype))
    return tuple(key)


class ShapePlans:
    """One worker's specialised plans, by input signature. Thread-safe."""

    def __init__(self, plan: Plan, size: int = MAX_SIGNATURES):
        self.base = plan
        self.nodes = shape_determined_nodes(plan)
        self._names = [o for i in self.nodes for o in plan.nodes[i].layer.outputs if o]
        self._size = size
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._observing: set[tuple] = set()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.nodes)

    def plan_for(self, key: tuple | None) -> tuple[Plan, tuple | None]:
        """The plan for a run whose inputs have the signature ``key`` (`signature`; None: not
        known yet), and the signature to `observe` the run for when the run is the first of its
        signature (else None)."""
        if key is None or not self.nodes:
            return self.base, None
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan, None
            if key in self._observing:  # a run of this signature is already recording
                return self.base, None
            self._observing.add(key)
        return self.base.keeping(self._names), key

    def observe(self, key: tuple, step_future: Callable[[int], TaskFuture | None]) -> None:
        """Record the shape-determined values of a first run (``step_future``: the future of one
        of the run's steps, `Execution.step_future`) when its layers complete; a failed run
        records nothing."""
        pending = [step_future(i) for i in self.nodes]
        remaining = [len(pending)]
        lock = threading.Lock()

        def one_done(_: TaskFuture) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            self._record(key, pending)

        for future in pending:
            if future is None:  # never submitted (schedule_iterable stopped early)
                self._forget(key)
                return
        for future in pending:
            future.add_done_callback(one_done)  # type: ignore[union-attr]

    def _record(self, key: tuple, futures: list[TaskFuture]) -> None:
        values: dict[int, list[Any]] = {}
        for index, future in zip(self.nodes, futures):
            if future.failed():
                self._forget(key)
                return
            outputs = future.peek()
            if sum(int(np.size(v)) for v in outputs if v is not None) <= MAX_PRECOMPUTED_ELEMENTS:
                # copies: the run may have handed an array to its caller as an output (`handover`)
                values[index] = [v.copy() if type(v) is np.ndarray else v for v in outputs]
        plan = self.base.with_precomputed(values)
        with self._lock:
            self._observing.discard(key)
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)

    def _forget(self, key: tuple) -> None:
        with self._lock:
            self._observing.discard(key)
