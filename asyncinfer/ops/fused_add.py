"""``act(a + b)`` for two float32 arrays of one shape, in one compiled pass (`compiled.sums`).

The CPU ops ``Add`` and ``Sum`` (of two inputs) take their layer's fused activation here (a
residual connection's ReLU): NumPy's add and then the activation in place were two passes over
the map, on one thread. A large sum is shared with the CPU backend's spinning helpers, each a
range of the flat arrays. Measured in ResNet-50 on the 2-core VM: see docs/benchmarks.md.
"""
from __future__ import annotations

import numpy as np

from ..concurrency import parallel
from .compiled.sums import add_range, part_arguments
from .epilogue import Activations, Epilogue

#: From this many values a sum is offered to the spinning helpers (about 10 µs on one core:
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
