"""Fused activations: applied by the kernel that stores the output, or after it, in place.

The optimizer attaches a single-consumer activation to the layer before it (``Layer.fused``);
the plan hands each step its activations as ``(op, extra inputs)`` pairs. A kernel that stores
its output block by block (the tiled conv) applies them in that pass as an `Epilogue`; any
other output takes them afterwards with `apply_activations`, in place when it is a fresh buffer.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import Activations
from .compiled import epilogue as compiled
from .elementwise import clip_bounds


@dataclass(frozen=True)
class Epilogue:
    """What `compiled.epilogue.store_rows` applies to each stored value after the bias: an
    activation code and its two parameters (see that module)."""

    kind: int = compiled.NONE
    a: float = 0.0
    b: float = 0.0

    @functools.cached_property
    def numbers(self) -> np.ndarray:
        """``a, b`` as the float64 pair a spinning helper reads from a posted address (made once)."""
        return np.array([self.a, self.b], np.float64)

    @staticmethod
    def of(activations: Activations, dtype: np.dtype) -> "Epilogue | None":
        """The epilogue doing ``activations`` on ``dtype`` results, or None when it cannot (a chain
        of several, an activation it lacks, or other than float32: its loops are float32)."""
        if not activations:
            return NO_ACTIVATION
        if len(activations) != 1 or dtype != np.float32:
            return None
        op, extras = activations[0]
        kind = op.op_type
        if kind == "Relu":
            return Epilogue(compiled.RELU)
        if kind == "Clip":
            lo, hi = clip_bounds(op, *list(extras)[:2])
            with np.errstate(over="ignore"):  # a float64 bound beyond float32 is ±inf, as in Clip
                return Epilogue(compiled.CLIP, -np.inf if lo is None else float(np.float32(lo)),
                                np.inf if hi is None else float(np.float32(hi)))
        if kind == "LeakyRelu":
            return Epilogue(compiled.LEAKY_RELU, float(op.attr("alpha")))
        if kind == "HardSigmoid":
            return Epilogue(compiled.HARD_SIGMOID, float(op.attr("alpha")), float(op.attr("beta")))
        if kind == "HardSwish":
            return Epilogue(compiled.HARD_SWISH)
        if kind == "Sigmoid":
            return Epilogue(compiled.SIGMOID)
        if kind == "Swish":  # SiLU (x · Sigmoid(x)) after `loader.patterns.fuse_silu`: EfficientNet's
            return Epilogue(compiled.SWISH, float(op.attr("alpha")))
        return None

    def store(self, block: np.ndarray, bias: np.ndarray, out: np.ndarray, v0: int, row_width: int,
              out_width: int) -> None:
        """``out[:, v0:v0 + width] = act(block + bias[:, None])``: rows of ``block`` are output
        channels, ``bias`` one value per row; columns are positions of a grid ``row_width`` wide
        whose columns past ``out_width`` are dropped (see `compiled.epilogue.store_rows`)."""
        compiled.store_rows(block, bias, out, v0, row_width, out_width, self.kind, self.a, self.b)

    def apply(self, rows: np.ndarray, bias: np.ndarray) -> None:
        """``rows = act(rows + bias[:, None])`` in place (rows contiguous, one bias per row)."""
        compiled.apply_rows(rows, bias, self.kind, self.a, self.b)

    def apply_inplace(self, y: np.ndarray) -> np.ndarray:
        """The activation alone, over a fresh contiguous ``y`` (any shape), in place."""
        if self.kind != compiled.NONE and y.size:
            # adding -0.0 changes no value, not even a -0.0 (+0.0 would make it +0.0)
            compiled.apply_rows(y.reshape(1, -1), _NEGATIVE_ZERO.astype(y.dtype), self.kind, self.a, self.b)
        return y


NO_ACTIVATION = Epilogue()
_NEGATIVE_ZERO = np.array([-0.0], np.float32)


def apply_activations(y: Any, activations: Activations, args: Sequence[Any]) -> Any:
    """Run ``activations`` on ``y`` (a kernel's first output), in place when ``y`` is a buffer the
    kernel just made (a float array sharing memory with none of the kernel's ``args``)."""
    fresh = (isinstance(y, np.ndarray) and y.flags.writeable and y.dtype.kind == "f"
             and not any(isinstance(a, np.ndarray) and np.may_share_memory(y, a) for a in args))
    for act, extra in activations:
        y = act.run_inplace(y, *extra) if fresh else act(y, *extra)[0]
        fresh = True
    return y
