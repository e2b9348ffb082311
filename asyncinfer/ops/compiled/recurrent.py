"""The LSTM cell of one time step, compiled: ONNX's default activations (sigmoid, tanh, tanh).

After the recurrent GEMM, a step is a dozen element-wise NumPy operations on a few hundred values
(slices of the gates, three sigmoids, two tanhs, products, sums), each a full call: on a small
streaming model (hidden 64, a step or two a call) they cost several times the GEMM. Here they are
one loop over the hidden units.
"""
from __future__ import annotations

import numpy as np

from . import kernel
from .activations import sigmoid1, tanh1


@kernel
def lstm_cell(gates: np.ndarray, c: np.ndarray, h_new: np.ndarray, c_new: np.ndarray) -> None:
    """``gates`` (B, 4H) in ONNX's order i, o, f, c (input projection, recurrence and biases
    summed); ``c`` (B, H) the cell state → ``c_new = σ(f)·c + σ(i)·tanh(g)`` and
    ``h_new = σ(o)·tanh(c_new)``."""
    batch, hidden = c.shape
    for b in range(batch):
        g = gates[b]
        for k in range(hidden):
            i = sigmoid1(g[k])
            o = sigmoid1(g[hidden + k])
            f = sigmoid1(g[2 * hidden + k])
            cell = f * c[b, k] + i * tanh1(g[3 * hidden + k])
            c_new[b, k] = cell
            h_new[b, k] = o * tanh1(cell)
