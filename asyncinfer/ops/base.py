"""The base class of every operator kernel.

An op class is built once per layer, when a worker is created (so attribute problems surface
before anything runs), and its `Op.run` is then called for every execution, possibly from
several threads at once: ``run`` must not mutate ``self`` nor its inputs (`Op.per_shape`'s memo
of derived geometry aside: its entries are computed whole, then stored).

Kernels run with NumPy's floating-point warnings off: ONNX expects inf and NaN silently where IEEE
arithmetic makes them. The threads that run kernels set this once (the CPU backend's pool, the
device threads) and so does the optimizer when it folds constants; kernels do not repeat it.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from ..errors import UnsupportedOperatorError
from ..limits import DEFAULT_LIMITS, Limits
from ..model.mapped import release_resident_pages
from .schema import attribute_defaults, schema_version

if TYPE_CHECKING:
    from ..model.ir import Layer

_REQUIRED = object()
T = TypeVar("T")
# Operand shapes whose derived geometry a layer remembers (`Op.per_shape`); a model fed ever new
# shapes starts afresh past this many.
SHAPES_KEPT = 64

#: A layer's fused activations, as the plan hands them to its kernel: (op, its extra inputs) each.
Activations = Sequence[tuple["Op", Sequence[Any]]]


class Op:
    """A CPU (NumPy) kernel for one ONNX operator.

    Subclasses override `run` and, when some attribute values are not implemented,
    `check` (calling `unsupported`). Class attributes describe the op to the optimizer:

    - ``value_inputs``: input indices whose *values* are needed to know output shapes (the
      ``shape`` of Reshape, ``axes`` of reductions…): the optimizer keeps their producers on the CPU.
    - ``deterministic``: False for random ops, which must never be constant-folded.
    - ``elementwise_unary``: True for activations that may be fused into the layer before them.
    - ``multithreaded``: True for kernels that use every core themselves (GEMM-based, split
      across the pool); when BLAS is kept multi-threaded the CPU backend runs those one at a time
      instead of oversubscribing the cores.
    - ``metadata_inputs``: input indices of which only the shape is read (Shape, Size): a value
      on a device is passed as it is (its storage knows its shape), never downloaded.
    - ``cancellable``: True for kernels that may run long on one call (control flow): they poll
      ``concurrency.cancellation.cancel_requested()`` between iterations, so a cancel stops them.
    - ``takes_activations``: True for kernels whose ``run`` takes the layer's fused activations
      (keyword ``activations``, see ``ops/epilogue.py``) and applies them itself, as it stores its
      output; the backend applies them after any other kernel.
    """

    op_type: ClassVar[str] = ""
    domain: ClassVar[str] = ""
    value_inputs: ClassVar[tuple[int, ...]] = ()
    deterministic: ClassVar[bool] = True
    elementwise_unary: ClassVar[bool] = False
    multithreaded: ClassVar[bool] = False
    metadata_inputs: ClassVar[tuple[int, ...]] = ()
    cancellable: ClassVar[bool] = False
    takes_activations: ClassVar[bool] = False

    def __init__(self, layer: "Layer", limits: Limits = DEFAULT_LIMITS):
        self.layer = layer
        self.limits = limits
        self.version = layer.version
        self.attrs = layer.attrs
        self._defaults = attribute_defaults(self.op_type, self.version, self.domain)
        self._per_shape: dict[Hashable, Any] = {}
        self._constants: dict[int, np.ndarray] = {}
        self._derived: dict[str, Any] = {}
        self.check()

    # -- attribute helpers ------------------------------------------------------------------
    def attr(self, name: str, default: Any = _REQUIRED) -> Any:
        """The attribute ``name``: the layer's value, else ``default`` if given, else the default
        of ONNX's schema for this op and opset (so kernels never restate the standard's defaults).
        A missing attribute with no default is an UnsupportedOperatorError."""
        if name in self.attrs:
            return self.attrs[name]
        if default is not _REQUIRED:
            return default
        if name in self._defaults:
            return self._defaults[name]
        raise UnsupportedOperatorError([f"{self.layer.describe()}: required attribute {name!r} is missing"])

    def per_shape(self, key: Hashable, work_out: Callable[[], T]) -> T:
        """``work_out()`` (the geometry a kernel derives from its attributes and operand shapes),
        worked out once per ``key`` (those shapes): a layer sees the same shapes run after run, and
        this is 5-15 µs of Python a call. ``work_out`` must not return None."""
        value = self._per_shape.get(key)
        if value is None:
            if len(self._per_shape) >= SHAPES_KEPT:
                self._per_shape.clear()
            value = self._per_shape[key] = work_out()
        return value

    def bind_constants(self, constants: Mapping[int, np.ndarray]) -> None:
        """Tell the op which of its inputs are the model's constants (input index → the value every
        run will pass), so that `derived` may keep what it works out from them. The plan calls it
        when it builds the layer's step."""
        self._constants = dict(constants)

    def bound_constant(self, index: int) -> np.ndarray | None:
        """The model's constant every run passes as input ``index`` (`bind_constants`), or None."""
        return self._constants.get(index)

    def derived(self, name: str, inputs: Mapping[int, np.ndarray | None], work_out: Callable[[], T]) -> T:
        """``work_out()``, a form of some inputs (``inputs``: index → the value this run passed)
        that a kernel would otherwise rebuild every run (int8 weights shifted by their zero point
        and converted for BLAS): kept under ``name`` after the first call when every one of those
        inputs is the model's constant bound to its index (`bind_constants`), else worked out for
        this run alone."""
        if any(self._constants.get(i) is not value for i, value in inputs.items()):
            return work_out()
        value = self._derived.get(name)
        if value is None:
            value = self._derived[name] = work_out()
        return value

    def derived_constant(self, name: str, index: int, value: np.ndarray, work_out: Callable[[], T], *,
                         create: bool = True) -> T | None:
        """`derived` for a form worth only keeping (weights packed for a kernel): ``work_out()`` of
        input ``index``'s ``value``, kept under ``name``, when ``value`` is the model's constant
        bound to that index; None, and nothing worked out, when it is not. ``create=False``: only
        a form kept already (None when there is none yet). The form stands in for the constant:
        once made, the constant's pages go back to the page cache where it is mapped from the
        model's file (`model.mapped.release_resident_pages`), so the weights are resident once."""
        if self._constants.get(index) is not value:
            return None
        form = self._derived.get(name)
        if form is None and create:
            form = self._derived[name] = work_out()
            release_resident_pages(value)
        return form

    def check_allocation(self, shape: Sequence[int], what: str = "output") -> None:
        """Refuse to allocate a tensor of ``shape`` sized from run-time data beyond
        ``Limits.max_tensor_rank`` / ``max_tensor_elements`` (a RequestTooLargeError naming the
        layer), before NumPy tries: Expand, Tile, ConstantOfShape, Range and the like call it."""
        self.limits.check_shape(tuple(shape), f"{self.layer.describe()}: {what} of shape {tuple(shape)}")

    def unsupported(self, what: str) -> None:
        """Refuse this layer: ``what`` names the attribute or combination that is not implemented."""
        since = schema_version(self.op_type, self.version, self.domain) or self.version
        raise UnsupportedOperatorError([f"{self.op_type} version {since} (opset {self.version}) in "
                                        f"{self.layer.describe()}: {what} is not supported"])

    # -- to override ----------------------------------------------------------------------------
    def check(self) -> None:
        """Validate attributes at worker creation; call `unsupported` to refuse."""

    def run(self, *inputs: np.ndarray | None) -> np.ndarray | tuple[np.ndarray | None, ...]:
        """Compute the outputs from the inputs (``None`` for an omitted optional input)."""
        raise NotImplementedError

    def run_inplace(self, x: np.ndarray, *inputs: np.ndarray | None) -> np.ndarray:
        """Like `run` for a single-output op, but free to overwrite ``x`` (a fresh buffer
        nobody else reads). Fused activations use it to skip an allocation and a memory pass."""
        return self(x, *inputs)[0]  # type: ignore[return-value]

    #: Inputs (by position) whose arrays `donating_run` may write over, when the runtime gives them
    #: up: values that no step reads after this one and that share memory with no other value
    #: (`runtime.plan.Plan`'s donations). None here.
    donatable_inputs: tuple[int, ...] = ()

    def donating_run(self, activations: Activations, donated: tuple[int, ...]) -> Callable[[list], list] | None:
        """`bound_run` for a step given the arrays of inputs ``donated`` (some of
        `donatable_inputs`): free to write its outputs over them. None: no such way (the runtime
        then calls `bound_run`)."""
        return None

    def __call__(self, *inputs: np.ndarray | None, **options: Any) -> tuple[np.ndarray | None, ...]:
        out = self.run(*inputs, **options)
        return out if isinstance(out, tuple) else (out,)

    def bound_run(self, activations: Activations = ()) -> Callable[[list], list]:
        """`run` as one callable from the list of inputs to the list of outputs: what a job
        calls for each of its layers, with the layer's fused ``activations`` for a kernel that
        `takes_activations` (others are given none: the backend applies theirs after). An op
        whose ``run`` does per-call work that its attributes settle once (an opset test, keyword
        arguments, a case looked up) may return a leaner callable computing the very same
        outputs: it runs for every layer of every run."""
        run = self.run
        if activations:
            def activated(args: list) -> list:
                out = run(*args, activations=activations)
                return list(out) if isinstance(out, tuple) else [out]

            return activated

        def outputs(args: list) -> list:
            out = run(*args)
            return list(out) if isinstance(out, tuple) else [out]

        return outputs
