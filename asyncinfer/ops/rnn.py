"""Recurrent ops: LSTM, GRU and RNN (all directions, layouts, sequence_lens, clip, activations).

The input projection ``X @ W^T + Wb`` of every time step is one big GEMM up front; only the
recurrent ``h @ R^T`` stays in the per-step loop. Reverse directions (and ragged batches given
by ``sequence_lens``) are handled by reversing each sequence's valid prefix, running forward
with a per-step mask that freezes finished sequences, and reversing the outputs back.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .base import Op
from .compiled.recurrent import lstm_cell, lstm_forward
from .registry import register

Activation = Callable[[np.ndarray], np.ndarray]


def _make_activation(name: str, alpha: float | None, beta: float | None, dtype: np.dtype) -> Activation:
    """The NumPy function of one ONNX RNN activation (parameters default as in the ONNX ops)."""
    t = dtype.type
    if name == "sigmoid":
        # tanh form: as accurate as 1/(1+exp(-x)) and free of overflow warnings
        return lambda x: t(0.5) * (np.tanh(x * t(0.5)) + t(1))
    if name == "tanh":
        return np.tanh
    if name == "relu":
        return lambda x: np.maximum(x, t(0))
    if name == "affine":
        a, b = t(1.0 if alpha is None else alpha), t(0.0 if beta is None else beta)
        return lambda x: a * x + b
    if name == "leakyrelu":
        a = t(0.01 if alpha is None else alpha)
        return lambda x: np.where(x >= 0, x, a * x)
    if name == "thresholdedrelu":
        a = t(1.0 if alpha is None else alpha)
        return lambda x: np.where(x >= a, x, t(0))
    if name == "scaledtanh":
        a, b = t(1.0 if alpha is None else alpha), t(1.0 if beta is None else beta)
        return lambda x: a * np.tanh(b * x)
    if name == "hardsigmoid":
        a, b = t(0.2 if alpha is None else alpha), t(0.5 if beta is None else beta)
        return lambda x: np.clip(a * x + b, t(0), t(1))
    if name == "elu":
        a = t(1.0 if alpha is None else alpha)
        return lambda x: np.where(x >= 0, x, a * np.expm1(np.minimum(x, t(0))))
    if name == "softsign":
        return lambda x: x / (t(1) + np.abs(x))
    if name == "softplus":
        return lambda x: np.logaddexp(x, t(0))
    raise KeyError(name)


_USES_ALPHA = {"affine", "leakyrelu", "thresholdedrelu", "scaledtanh", "hardsigmoid", "elu"}
_USES_BETA = {"affine", "scaledtanh", "hardsigmoid"}
_KNOWN = {"sigmoid", "tanh", "relu", "softsign", "softplus"} | _USES_ALPHA


class _Recurrent(Op):
    """Attribute handling and the direction/sequence machinery shared by LSTM, GRU and RNN."""
    multithreaded = True  # GEMM in BLAS: already uses every core

    gates: int = 1
    default_activations: tuple[str, ...] = ()

    def check(self) -> None:
        direction = self.attr("direction", "forward")
        if direction not in ("forward", "reverse", "bidirectional"):
            self.unsupported(f"direction={direction!r}")
        if int(self.attr("layout", 0)) not in (0, 1):
            self.unsupported(f"layout={self.attr('layout')}")
        names = self.activation_names()
        bad = [n for n in names if n not in _KNOWN]
        if bad:
            self.unsupported(f"activations {bad}")
        if len(names) != len(self.default_activations) * self.num_directions():
            self.unsupported(f"activations={self.attr('activations')} (expected "
                             f"{len(self.default_activations) * self.num_directions()} names)")
        if int(self.attr("input_forget", 0)) and self.op_type != "LSTM":
            self.unsupported("input_forget")

    def num_directions(self) -> int:
        return 2 if self.attr("direction", "forward") == "bidirectional" else 1

    def activation_names(self) -> list[str]:
        given = self.attr("activations", None)
        if not given:
            return list(self.default_activations) * self.num_directions()
        return [str(a).lower() for a in given]

    def activations(self, dtype: np.dtype) -> list[list[Activation]]:
        """Per direction, the activation functions (alpha/beta consumed in order by those using them)."""
        alphas = list(self.attr("activation_alpha", None) or [])
        betas = list(self.attr("activation_beta", None) or [])
        fns = []
        for name in self.activation_names():
            alpha = alphas.pop(0) if name in _USES_ALPHA and alphas else None
            beta = betas.pop(0) if name in _USES_BETA and betas else None
            fns.append(_make_activation(name, alpha, beta, dtype))
        per = len(self.default_activations)
        return [fns[d * per:(d + 1) * per] for d in range(self.num_directions())]

    def clip(self, x: np.ndarray) -> np.ndarray:
        c = self.attr("clip", None)
        if c is None:
            return x
        c = x.dtype.type(c)
        return np.clip(x, -c, c, out=x)

    def prepare(self, x: np.ndarray, w: np.ndarray, sequence_lens: np.ndarray | None,
                states: list[np.ndarray | None]):
        """Inputs in layout 0 ((seq, batch, …) and (dirs, batch, hidden)) plus per-batch lengths."""
        layout = int(self.attr("layout", 0))
        if layout == 1:
            x = x.transpose(1, 0, 2)
            states = [None if s is None else s.transpose(1, 0, 2) for s in states]
        seq, batch = x.shape[:2]
        hidden = w.shape[0] // self.gates
        if sequence_lens is None:
            lens = np.full(batch, seq, dtype=np.int64)
        else:
            lens = np.minimum(sequence_lens.astype(np.int64).reshape(batch), seq)
        states = [np.zeros((self.num_directions(), batch, hidden), dtype=x.dtype) if s is None else s
                  for s in states]
        return x, lens, states, hidden

    def finish(self, ys: list[np.ndarray], finals: list[list[np.ndarray]]) -> tuple[np.ndarray, ...]:
        """Stack per-direction outputs into Y (seq, dirs, batch, hidden) and the final states, per layout."""
        y = np.stack(ys, axis=1)
        outs = [np.stack(f, axis=0) for f in finals]
        if int(self.attr("layout", 0)) == 1:
            y = y.transpose(2, 0, 1, 3)
            outs = [o.transpose(1, 0, 2) for o in outs]
        return (np.ascontiguousarray(y),) + tuple(np.ascontiguousarray(o) for o in outs)

    def run_directions(self, x: np.ndarray, lens: np.ndarray, step_fn) -> tuple[list[np.ndarray], list[list]]:
        """Run ``step_fn(direction, xs, lens)`` for each direction; reverse ones see reversed sequences."""
        seq, batch = x.shape[:2]
        ragged = bool((lens < seq).any())
        reverse_index = None
        ys, finals = [], None
        for d in range(self.num_directions()):
            reverse = self.attr("direction", "forward") == "reverse" or d == 1
            xs = x
            if reverse:
                if reverse_index is None:
                    t = np.arange(seq)[:, None]
                    reverse_index = np.where(t < lens[None, :], lens[None, :] - 1 - t, t)
                xs = np.take_along_axis(x, reverse_index[:, :, None], axis=0)
            y, states = step_fn(d, xs, lens if ragged else None)
            if reverse:
                y = np.take_along_axis(y, reverse_index[:, :, None], axis=0)
            ys.append(y)
            finals = [[s] for s in states] if finals is None else [f + [s] for f, s in zip(finals, states)]
        return ys, finals


def _input_projection(xs: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """``X @ W^T (+ Wb)`` for all time steps at once: (seq, batch, gates*hidden)."""
    proj = np.matmul(xs, w.T)
    if b is not None:
        proj += b
    return proj


def _masked_update(new: np.ndarray, old: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    return new if mask is None else np.where(mask, new, old)


def _step_mask(t: int, ragged_lens: np.ndarray | None) -> np.ndarray | None:
    """Which batch rows are still inside their sequence at step ``t`` (None: all of them)."""
    return None if ragged_lens is None else (t < ragged_lens)[:, None]


def _emit(ys: np.ndarray, t: int, h_new: np.ndarray, mask: np.ndarray | None) -> None:
    """Write step ``t``'s output; rows past their sequence length output zeros."""
    ys[t] = h_new if mask is None else np.where(mask, h_new, 0)


@register("LSTM", versions=(1, 7, 14, 22))
class LSTM(_Recurrent):
    """LSTM with gate order i, o, f, c; peepholes P = (i, o, f); optional coupled input/forget gate."""

    gates = 4
    default_activations = ("sigmoid", "tanh", "tanh")

    def check(self) -> None:
        super().check()
        # the common case a streaming model runs (forward, layout 0, ONNX's activations, no clip,
        # no coupled gates): `_forward`'s one compiled call when the operands allow it too
        self._plain = (self.attr("direction", "forward") == "forward" and int(self.attr("layout", 0)) == 0
                       and self.attr("clip", None) is None and not int(self.attr("input_forget", 0))
                       and self.activation_names() == list(self.default_activations))

    def run(self, x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None):
        if (self._plain and p is None and sequence_lens is None and x.dtype == np.float32 and x.ndim == 3
                and w.dtype == r.dtype == np.float32 and (b is None or b.dtype == np.float32)):
            done = self._forward(x, w, r, b, initial_h, initial_c)
            if done is not None:
                return done
        x, lens, (h0, c0), hidden = self.prepare(x, w[0], sequence_lens, [initial_h, initial_c])
        coupled = bool(int(self.attr("input_forget")))
        H = hidden
        # the default activations, no clip: every step's element-wise work in one compiled loop
        compiled = (x.dtype == np.float32 and not coupled and self.attr("clip", None) is None
                    and self.activation_names() == list(self.default_activations) * self.num_directions())
        acts = self.activations(x.dtype)

        def step_fn(d, xs, ragged_lens):
            wb = rb = None
            if b is not None:
                wb, rb = b[d, :4 * H], b[d, 4 * H:]
            proj = _input_projection(xs, w[d], wb if rb is None else wb + rb)
            rt = r[d].T
            pi = po = pf = None
            if p is not None:
                pi, po, pf = p[d, :H], p[d, H:2 * H], p[d, 2 * H:]
            h, c = h0[d], c0[d]
            ys = np.zeros((xs.shape[0],) + h.shape, dtype=x.dtype)
            if compiled and pi is None and ragged_lens is None:
                c = np.ascontiguousarray(c)
                for t in range(xs.shape[0]):
                    h_new, c_new = np.empty_like(c), np.empty_like(c)
                    lstm_cell(np.ascontiguousarray(proj[t] + h @ rt), c, h_new, c_new)
                    ys[t], h, c = h_new, h_new, c_new
                return ys, [h, c]
            f, g, h_act = acts[d]
            for t in range(xs.shape[0]):
                gates = proj[t] + h @ rt
                gi, go, gf, gc = (gates[:, k * H:(k + 1) * H] for k in range(4))
                if pi is not None:
                    gi = gi + pi * c
                    gf = gf + pf * c
                i = f(self.clip(gi))
                ft = (1 - i) if coupled else f(self.clip(gf))
                c_new = ft * c + i * g(self.clip(gc))
                if po is not None:
                    go = go + po * c_new
                o = f(self.clip(go))
                h_new = o * h_act(c_new)
                mask = _step_mask(t, ragged_lens)
                h = _masked_update(h_new, h, mask)
                c = _masked_update(c_new, c, mask)
                _emit(ys, t, h_new, mask)
            return ys, [h, c]

        ys, finals = self.run_directions(x, lens, step_fn)
        return self.finish(ys, finals)


    def _forward(self, x, w, r, b, initial_h, initial_c) -> tuple[np.ndarray, ...] | None:
        """`run` of the plain case (`check`) as one input GEMM and one compiled call for every step
        (`compiled.recurrent.lstm_forward`): the generic path's Python per call (attributes,
        directions, stacking) cost a streaming VAD's LSTM (hidden 64, two steps) about 30 µs.
        None, having done nothing, for operands whose shapes do not fit (the generic path says
        what is wrong)."""
        gates = 4 * r.shape[-1]
        if (w.shape != (1, gates, x.shape[2]) or r.shape != (1, gates, r.shape[-1])
                or b is not None and b.shape != (1, 2 * gates)):
            return None
        w_t = self.derived("w_t", {1: w}, lambda: np.ascontiguousarray(w[0].T))
        r_t = self.derived("r_t", {2: r}, lambda: np.ascontiguousarray(r[0].T))
        bias = None if b is None else self.derived("bias", {3: b}, lambda: b[0, :gates] + b[0, gates:])
        return _lstm_steps(x, w_t, r_t, bias, initial_h, initial_c)

    def bound_run(self) -> Callable[[list], list]:
        """`run` for the model's own weights, whose transposes and bias are worked out here once:
        a call of the plain case (`check`) checks its operands and goes straight to
        `_lstm_steps` (a streaming VAD's LSTM, two steps of hidden 64: 14.6 -> 11 µs a call, hot);
        anything else, `run`."""
        general = super().bound_run()
        names = list(self.layer.inputs) + [""] * 8
        w, r = self.bound_constant(1), self.bound_constant(2)
        b = self.bound_constant(3) if names[3] else None
        if (not self._plain or names[4] or names[7] or w is None or r is None or (names[3] and b is None)
                or w.dtype != np.float32 or r.dtype != np.float32 or (b is not None and b.dtype != np.float32)
                or w.ndim != 3 or r.ndim != 3):
            return general
        gates, inputs = w.shape[1], w.shape[2]
        if w.shape[0] != 1 or r.shape != (1, gates, gates // 4) or gates % 4 or (b is not None and b.shape != (1, 2 * gates)):
            return general
        w_t, r_t = np.ascontiguousarray(w[0].T), np.ascontiguousarray(r[0].T)
        bias = None if b is None else b[0, :gates] + b[0, gates:]
        given = (1, w), (2, r), (3, b)

        def outputs(args: list) -> list:
            x = args[0]
            if (type(x) is not np.ndarray or x.dtype != np.float32 or x.ndim != 3 or x.shape[2] != inputs
                    or any(i < len(args) and args[i] is not value for i, value in given if value is not None)):
                return general(args)
            done = _lstm_steps(x, w_t, r_t, bias, args[5] if len(args) > 5 else None,
                               args[6] if len(args) > 6 else None)
            return general(args) if done is None else list(done)

        return outputs


def _lstm_steps(x: np.ndarray, w_t: np.ndarray, r_t: np.ndarray, bias: np.ndarray | None,
                initial_h: np.ndarray | None, initial_c: np.ndarray | None) -> tuple[np.ndarray, ...] | None:
    """A forward LSTM's outputs (Y, Y_h, Y_c) over float32 ``x`` (seq, batch, input), given its
    weights transposed (``w_t`` (input, 4H), ``r_t`` (H, 4H)) and its two biases summed (4H);
    None when the initial states do not fit (the generic path says what is wrong)."""
    seq, batch = x.shape[:2]
    hidden = r_t.shape[0]
    gates = 4 * hidden
    states = [s if s is not None else np.zeros((1, batch, hidden), np.float32) for s in (initial_h, initial_c)]
    if any(type(s) is not np.ndarray or s.shape != (1, batch, hidden) or s.dtype != np.float32 for s in states):
        return None
    proj = np.matmul(x, w_t)
    if bias is not None:
        proj += bias
    y = np.empty((seq, 1, batch, hidden), np.float32)
    h, c = np.empty((1, batch, hidden), np.float32), np.empty((1, batch, hidden), np.float32)
    lstm_forward(proj, r_t, np.ascontiguousarray(states[0][0]), np.ascontiguousarray(states[1][0]), y[:, 0],
                 h[0], c[0], np.empty((batch, gates), np.float32))
    return y, h, c


@register("GRU", versions=(1, 3, 7, 14, 22))
class GRU(_Recurrent):
    """GRU with gate order z, r, h; ``linear_before_reset`` applies the reset gate after R_h."""

    gates = 3
    default_activations = ("sigmoid", "tanh")

    def run(self, x, w, r, b=None, sequence_lens=None, initial_h=None):
        x, lens, (h0,), hidden = self.prepare(x, w[0], sequence_lens, [initial_h])
        acts = self.activations(x.dtype)
        before_reset = bool(int(self.attr("linear_before_reset", 0)))
        H = hidden

        def step_fn(d, xs, ragged_lens):
            f, g = acts[d]
            wb = rbh = None
            if b is not None:
                wb = b[d, :3 * H].copy()
                wb[:2 * H] += b[d, 3 * H:5 * H]  # z and r recurrent biases fold into the input ones
                rbh = b[d, 5 * H:]
            proj = _input_projection(xs, w[d], wb)
            rzr, rh = r[d, :2 * H].T, r[d, 2 * H:].T
            h = h0[d]
            ys = np.zeros((xs.shape[0],) + h.shape, dtype=x.dtype)
            for t in range(xs.shape[0]):
                pz_r = proj[t, :, :2 * H] + h @ rzr
                z = f(self.clip(pz_r[:, :H]))
                rg = f(self.clip(pz_r[:, H:]))
                if before_reset:
                    rec = h @ rh
                    if rbh is not None:
                        rec += rbh
                    cand = proj[t, :, 2 * H:] + rg * rec
                else:
                    cand = proj[t, :, 2 * H:] + (rg * h) @ rh
                    if rbh is not None:
                        cand = cand + rbh
                hh = g(self.clip(cand))
                h_new = (1 - z) * hh + z * h
                mask = _step_mask(t, ragged_lens)
                h = _masked_update(h_new, h, mask)
                _emit(ys, t, h_new, mask)
            return ys, [h]

        ys, finals = self.run_directions(x, lens, step_fn)
        return self.finish(ys, finals)


@register("RNN", versions=(1, 7, 14, 22))
class RNN(_Recurrent):
    """Simple RNN: ``h = f(x W^T + h R^T + Wb + Rb)``."""

    gates = 1
    default_activations = ("tanh",)

    def run(self, x, w, r, b=None, sequence_lens=None, initial_h=None):
        x, lens, (h0,), hidden = self.prepare(x, w[0], sequence_lens, [initial_h])
        acts = self.activations(x.dtype)
        H = hidden

        def step_fn(d, xs, ragged_lens):
            (f,) = acts[d]
            bias = None if b is None else b[d, :H] + b[d, H:]
            proj = _input_projection(xs, w[d], bias)
            rt = r[d].T
            h = h0[d]
            ys = np.zeros((xs.shape[0],) + h.shape, dtype=x.dtype)
            for t in range(xs.shape[0]):
                h_new = f(self.clip(proj[t] + h @ rt))
                mask = _step_mask(t, ragged_lens)
                h = _masked_update(h_new, h, mask)
                _emit(ys, t, h_new, mask)
            return ys, [h]

        ys, finals = self.run_directions(x, lens, step_fn)
        return self.finish(ys, finals)
