"""Which values a run returns: the model's outputs, or any value of the graph asked for by name.

A run that asks for values (``worker.schedule(x, outputs=[...])``) runs on a plan made for that
set of names (`Plan.with_outputs()`): the plan keeps those values alive for the run's life
instead of freeing them after their last reader. Such plans are cached per worker, a bounded
number of them (the names may come from untrusted requests).
"""
from __future__ import annotations

import difflib
import threading
from collections import OrderedDict
from collections.abc import Iterable

from ..errors import InputError
from ..model.ir import Model
from .plan import Plan

#: How many specialised plans a worker keeps (least recently used ones are dropped).
MAX_CACHED_PLANS = 32


def check_output_names(plan: Plan, names: Iterable[str]) -> tuple[str, ...]:
    """``names`` without repeats, each checked to be a value of ``plan``'s (optimized) graph.

    Raises:
        InputError: no name given, a name that is not a string, or one the graph does not hold:
            the message says whether the optimizer fused or folded it away (and how to keep it),
            or lists the nearest names the graph has.
    """
    if isinstance(names, (str, bytes)):
        raise InputError(f"outputs must be a list of value names, got the string {names!r} (write [{names!r}])")
    chosen: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise InputError(f"outputs must be value names (strings), got {type(name).__name__}")
        if name not in plan.refs:
            raise InputError(_unknown_value(plan.model, plan.refs, name))
        if name not in chosen:
            chosen.append(name)
    if not chosen:
        raise InputError("outputs=[] asks for nothing: name at least one value (or leave outputs out)")
    return tuple(chosen)


def _unknown_value(model: Model, known: Iterable[str], name: str) -> str:
    keep = "load the model with load_model(..., optimize=False) to keep every value of the graph"
    for layer in model.layers:
        for fused in layer.fused:
            if fused.inputs and fused.inputs[0] == name:
                return (f"value {name!r} no longer exists: the optimizer fused {fused.op_type} {fused.name!r} into "
                        f"{layer.describe()}, which computes {layer.kind} in one step and outputs only "
                        f"{layer.outputs[0]!r}; {keep}")
    if name in model.value_info:
        return (f"value {name!r} no longer exists: the optimizer removed it (fused or folded into another "
                f"layer, the output of an Identity, or of a layer no output depends on); {keep}")
    near = difflib.get_close_matches(name, list(known), n=5, cutoff=0.5)
    hint = f"; nearest names: {near}" if near else "; the layers and their outputs are listed by model.layers"
    return f"the model has no value {name!r}{hint}"


class OutputPlans:
    """The plans of one worker by requested names (the plan for the model's outputs included),
    least recently used dropped beyond `MAX_CACHED_PLANS`. Thread-safe."""

    def __init__(self, plan: Plan, size: int = MAX_CACHED_PLANS):
        self.default = plan
        self._size = size
        self._plans: OrderedDict[tuple[str, ...], Plan] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, names: Iterable[str]) -> Plan:
        """The plan returning ``names`` (checked; see `check_output_names()`)."""
        key = check_output_names(self.default, names)
        if list(key) == self.default.output_names:
            return self.default
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = self.default.with_outputs(key)  # outside the lock: two threads may both build it
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return plan
