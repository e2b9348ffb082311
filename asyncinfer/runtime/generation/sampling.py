"""Choosing the next token from a row of logits, and stopping on token-id sequences.

Selection runs on the host, on the last row of logits of each sequence (the only part of the
logits read back). Greedy (temperature 0) is ``argmax``, the first index on ties, as NumPy's and
every reference loop's. Sampling scales by the temperature, keeps the ``top_k`` largest logits,
then the smallest set of most likely tokens whose probability reaches ``top_p``, and draws from
what is left with the stream's own NumPy generator: a seeded stream is reproducible.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import InputError


@dataclass(frozen=True)
class Sampling:
    """How one stream picks its tokens (checked by `Sampling.checked`)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def checked(cls, temperature: float, top_k: int | None, top_p: float | None) -> "Sampling":
        """The options, or an `InputError` naming the one at fault."""
        if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool) \
                or not math.isfinite(temperature) or temperature < 0:
            raise InputError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 1):
            raise InputError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
        if top_p is not None and (not isinstance(top_p, numbers.Real) or isinstance(top_p, bool)
                                  or not 0.0 < top_p <= 1.0):
            raise InputError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
        return cls(float(temperature), None if top_k is None else int(top_k), None if top_p is None else float(top_p))


#: top_p's first guess at the nucleus size: the candidates it sorts before checking that their
#: probability reaches top_p (grown 8-fold until it does). Sorting a whole 50k vocabulary costs
#: milliseconds a token; a nucleus is usually far smaller.
NUCLEUS_GUESS = 64


def choose(row: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """The next token from one row of logits.

    Only what the options need is sorted: nothing for temperature alone (the draw walks the
    unsorted cumulative probabilities), the ``top_k`` candidates for top_k, and for top_p the
    most likely tokens until their probability reaches ``top_p``. The distribution drawn from is
    the same as sorting everything.
    """
    if sampling.greedy:
        return int(np.argmax(row))
    logits = np.asarray(row, dtype=np.float64) / sampling.temperature
    vocab = logits.shape[0]
    top_p = sampling.top_p if sampling.top_p is not None and sampling.top_p < 1.0 else None
    if sampling.top_k is not None and sampling.top_k < vocab:
        candidates = np.argpartition(-logits, sampling.top_k - 1)[:sampling.top_k]
        weights = np.exp(logits[candidates] - logits[candidates].max())
    elif top_p is None:  # temperature alone: draw from the whole vocabulary, unsorted
        cdf = np.cumsum(np.exp(logits - logits.max()))
        return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), vocab - 1))
    else:
        candidates = np.arange(vocab)
        weights = np.exp(logits - logits.max())
    need = None if top_p is None else top_p * weights.sum()
    size = len(candidates) if need is None else min(NUCLEUS_GUESS, len(candidates))
    while True:  # the `size` most likely candidates, most likely first, until they reach top_p
        part = np.arange(len(candidates)) if size == len(candidates) else np.argpartition(-weights, size - 1)[:size]
        order = part[np.argsort(-weights[part], kind="stable")]
        cdf = np.cumsum(weights[order])
        if need is None or cdf[-1] >= need or size == len(candidates):
            break
        size = min(size * 8, len(candidates))
    if need is not None:  # the smallest set of most likely tokens reaching top_p
        keep = min(int(np.searchsorted(cdf, need)) + 1, len(cdf))
        order, cdf = order[:keep], cdf[:keep]
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(candidates[order[min(index, len(order) - 1)]])


def token_ids(value: object, what: str) -> tuple[int, ...]:
    """``value`` as a tuple of token ids (an int or a sequence of ints), or an `InputError`."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return (int(value),)
    if isinstance(value, (str, bytes)):
        raise InputError(f"{what} must be token ids; text needs a tokenizer (got {value!r})")
    try:
        ids = tuple(value)  # type: ignore[call-overload]
    except TypeError:
        raise InputError(f"{what} must be a token id or a sequence of token ids, got {type(value).__name__}") from None
    for t in ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0:
            raise InputError(f"{what} must hold non-negative integer token ids, got {t!r}")
    return tuple(int(t) for t in ids)


def stop_sequences(stop: object) -> tuple[tuple[int, ...], ...]:
    """``stop`` (None, one token-id sequence, or several) as a tuple of non-empty id tuples."""
    if stop is None:
        return ()
    if isinstance(stop, (str, bytes)) or (isinstance(stop, Sequence) and any(isinstance(s, (str, bytes)) for s in stop)):
        raise InputError("stop must be token-id sequences here; stop strings need a tokenizer")
    if isinstance(stop, Iterable) and not isinstance(stop, np.ndarray):
        items = list(stop)
        if items and all(isinstance(s, numbers.Integral) for s in items):
            items = [items]  # one sequence given flat: stop=[13, 13]
    else:
        items = [stop]
    sequences = tuple(token_ids(s, "stop") for s in items)
    if any(not s for s in sequences):
        raise InputError("stop holds an empty sequence")
    return sequences


class StopMatcher:
    """Holds back generated tokens that may begin a stop sequence, releasing them once they
    cannot; a completed stop sequence is never released (as OpenAI's ``stop`` behaves)."""

    def __init__(self, sequences: tuple[tuple[int, ...], ...]):
        self.sequences = sequences
        self.held: list[int] = []

    def push(self, token: int) -> tuple[list[int], bool]:
        """Add one token; the tokens now safe to release, and whether a stop sequence completed."""
        if not self.sequences:
            return [token], False
        self.held.append(token)
        for seq in self.sequences:
            if len(self.held) >= len(seq) and tuple(self.held[-len(seq):]) == seq:
                released = self.held[:-len(seq)]
                self.held = []
                return released, True
        # the longest tail of held that is a proper prefix of some stop sequence stays held
        keep = 0
        for seq in self.sequences:
            for n in range(min(len(seq) - 1, len(self.held)), keep, -1):
                if tuple(self.held[-n:]) == seq[:n]:
                    keep = n
                    break
        released = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return released, False

    def flush(self) -> list[int]:
        """The tokens still held, at the end of a stream that stopped for another reason."""
        held, self.held = self.held, []
        return held
