"""The LSTM cell of one time step, compiled: ONNX's default activations (sigmoid, tanh, tanh).

After the recurrent GEMM, a step is a dozen element-wise NumPy operations on a few hundred values
(slices of the gates, three sigmoids, two tanhs, products, sums), each a full call: on a small
streaming model (hidden 64, a step or two a call) they cost several times the GEMM. Here they are
one loop over the hidden units.
"""
from __future__ import annotations

import numpy as np

from . import inline, kernel
from .activations import sigmoid1, tanh1


@kernel
def lstm_cell(gates: np.ndarray, c: np.ndarray, h_new: np.ndarray, c_new: np.ndarray) -> None:
    """``gates`` (B, 4H) in ONNX's order i, o, f, c (input projection, recurrence and biases
    summed); ``c`` (B, H) the cell state → ``c_new = σ(f)·c + σ(i)·tanh(g)`` and
    ``h_new = σ(o)·tanh(c_new)``."""
    for b in range(c.shape[0]):
        _update(gates[b], c[b], c_new[b], h_new[b])


@inline
def _update(g: np.ndarray, c: np.ndarray, c_new: np.ndarray, h_new: np.ndarray) -> None:
    """One batch row of the cell: ``g`` (4H) the summed gates, ``c`` the cell state (H) →
    ``c_new``, ``h_new`` (either may be ``c``'s own row: each unit reads only its own value)."""
    hidden = c.size
    for k in range(hidden):
        i = sigmoid1(g[k])
        o = sigmoid1(g[hidden + k])
        f = sigmoid1(g[2 * hidden + k])
        cell = f * c[k] + i * tanh1(g[3 * hidden + k])
        c_new[k] = cell
        h_new[k] = o * tanh1(cell)


@kernel
def lstm_forward(proj: np.ndarray, r_t: np.ndarray, h0: np.ndarray, c0: np.ndarray, ys: np.ndarray, h: np.ndarray,
                 c: np.ndarray, gates: np.ndarray) -> None:
    """Every step of one forward LSTM direction with ONNX's default activations, in one call:
    ``proj`` (T, B, 4H) the input projection with both biases, ``r_t`` (H, 4H) the recurrent
    weights transposed, ``h0``/``c0`` (B, H) the initial states → ``ys`` (T, B, H) each step's
    hidden state, ``h``/``c`` (B, H) the final ones; ``gates`` (B, 4H) scratch. The recurrence
    ``h @ r_t`` is summed here, a row of ``r_t`` at a time (a streaming model's GEMV of 64 x 256
    is too small for BLAS's set-up to pay)."""
    steps, batch, width = proj.shape
    hidden = width // 4
    h[:] = h0
    c[:] = c0
    for t in range(steps):
        for b in range(batch):
            g = gates[b]
            for j in range(width):
                g[j] = proj[t, b, j]
            for k in range(hidden):
                hk = h[b, k]
                row = r_t[k]
                for j in range(width):
                    g[j] += hk * row[j]
        for b in range(batch):
            _update(gates[b], c[b], c[b], h[b])
            ys[t, b] = h[b]
