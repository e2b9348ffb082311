"""Element-wise layers with their fused activation in one compiled pass (`compiled.one_pass`).

- `fused_add`: ``act(a + b)``, the CPU ops ``Add`` and ``Sum`` of two float32 maps of one shape
  (a residual connection and its ReLU);
- `fused_affine`: ``act(x · scale[c] + shift[c])``, an inference-mode ``BatchNormalization`` of a
  float32 map (DenseNet's BN + ReLU before each conv).

As NumPy passes these were two or three trips through the map, on one thread. Large ones are
shared with the CPU backend's spinning helpers: ranges of the flat arrays, or of channel planes.
Measured in ResNet-50 and DenseNet-121 on the 2-core VM: see docs/benchmarks.md.
"""
from __future__ import annotations

import numpy as np

from ..concurrency import parallel
from .compiled.one_pass import add_range, affine_arguments, affine_rows, part_arguments
from .epilogue import Activations, Epilogue

#: From this many values a pass is offered to the spinning helpers (about 10 µs on one core:
#: posting a part costs a few).
TEAM_MIN_VALUES = 1 << 15
#: A part's range starts on a multiple of this many values (whole cache lines: no two threads
#: write the same line).
ALIGN = 16


def fused_add(a: np.ndarray, b: np.ndarray, activations: Activations) -> np.ndarray | None:
    """A fresh ``act(a + b)`` (``activations``: the layer's fused ones), or None when this is no
    case for the compiled pass: other than float32, shapes that differ (broadcasting), operands
    not C-contiguous, activations the epilogue lacks, or a plain sum too small for the team (NumPy
    is as fast alone)."""
    if (type(a) is not np.ndarray or type(b) is not np.ndarray or a.dtype != np.float32 or b.dtype != np.float32
            or a.shape != b.shape or not a.flags.c_contiguous or not b.flags.c_contiguous or not a.size):
        return None
    epilogue = Epilogue.of(activations, a.dtype)
    if epilogue is None:
        return None
    n = a.size
    team = parallel.team() if n >= TEAM_MIN_VALUES else None
    if team is None and not activations:
        return None
    out = np.empty(a.shape, np.float32)
    x, y, z = a.reshape(-1), b.reshape(-1), out.reshape(-1)
    kind, av, bv = epilogue.kind, epilogue.a, epilogue.b
    if team is not None:
        count = team.helpers + 1
        cuts = [0] + [n * i // count // ALIGN * ALIGN for i in range(1, count)] + [n]
        numbers = np.array([av, bv], np.float64)
        posted = [part_arguments(x, y, z, cuts[i], cuts[i + 1], kind, numbers) for i in range(1, count)]
        if team.try_run(posted, lambda: add_range(x, y, z, cuts[0], cuts[1], kind, av, bv)):
            return out
    add_range(x, y, z, 0, n, kind, av, bv)
    return out


#: Fewest values a channel plane needs for `fused_affine` (a row loop over shorter planes is
#: mostly overhead: NumPy's broadcast does as well).
MIN_PLANE = 16


def fused_affine(x: np.ndarray, scale: np.ndarray, shift: np.ndarray, activations: Activations) -> np.ndarray | None:
    """A fresh ``act(x · scale[c] + shift[c])`` over the channel axis (1) of ``x`` (N, C, ...), or
    None when this is no case for the compiled pass: other than float32 (``scale`` and ``shift``
    too, (C,) C-contiguous), ``x`` not C-contiguous, planes under `MIN_PLANE` values, or
    activations the epilogue lacks."""
    if (type(x) is not np.ndarray or x.dtype != np.float32 or x.ndim < 3 or not x.flags.c_contiguous or not x.size
            or scale.dtype != np.float32 or shift.dtype != np.float32 or scale.shape != (x.shape[1],)
            or shift.shape != scale.shape or not scale.flags.c_contiguous or not shift.flags.c_contiguous):
        return None
    width = x.size // (x.shape[0] * x.shape[1])
    epilogue = Epilogue.of(activations, x.dtype)
    if width < MIN_PLANE or epilogue is None:
        return None
    out = np.empty(x.shape, np.float32)
    rows = x.shape[0] * x.shape[1]
    planes, results = x.reshape(rows, width), out.reshape(rows, width)
    kind, av, bv = epilogue.kind, epilogue.a, epilogue.b
    team = parallel.team() if x.size >= TEAM_MIN_VALUES and rows > 1 else None
    if team is not None:
        count = min(team.helpers + 1, rows)
        cuts = [rows * i // count for i in range(count + 1)]
        numbers = np.array([av, bv], np.float64)
        posted = [affine_arguments(planes, scale, shift, results, cuts[i], cuts[i + 1], kind, numbers)
                  for i in range(1, count)]
        if team.try_run(posted, lambda: affine_rows(planes, scale, shift, results, cuts[0], cuts[1], kind, av, bv)):
            return out
    affine_rows(planes, scale, shift, results, 0, rows, kind, av, bv)
    return out
