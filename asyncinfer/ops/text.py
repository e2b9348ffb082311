"""String ops: StringSplit, StringNormalizer, StringConcat, RegexFullMatch, and TfIdfVectorizer.

String tensors are NumPy object arrays of Python ``str`` (as ``onnx.numpy_helper`` gives them), so
the per-element work is Python string methods applied through ``np.frompyfunc``; TfIdfVectorizer
maps tokens to small integer ids once at load and then counts n-grams with vectorised NumPy.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from .base import Op
from .registry import register
from .shape import check_mode, op_error

Array = np.ndarray


def _strings(x: Array) -> Array:
    """``x`` as an object array of str (the representation of ONNX string tensors)."""
    return np.asarray(x, dtype=object)


def _map_strings(fn: Any, x: Array, dtype: type = object) -> Array:
    """``fn`` applied to every element of ``x``; the result keeps ``x``'s shape, even 0-d and empty."""
    x = _strings(x)
    if x.size == 0:
        return np.empty(x.shape, dtype=dtype)
    return np.asarray(np.frompyfunc(fn, 1, 1)(x), dtype=object).astype(dtype, copy=False).reshape(x.shape)


@register("StringConcat", versions=(20,))
class StringConcat(Op):
    def run(self, x: Array, y: Array) -> Array:
        # Object-array addition is Python str concatenation, with NumPy broadcasting.
        return np.asarray(np.add(_strings(x), _strings(y)), dtype=object)


@register("RegexFullMatch", versions=(20,))
class RegexFullMatch(Op):
    """ONNX specifies RE2 syntax; Python's ``re`` accepts the common subset (refused otherwise at load)."""

    def check(self) -> None:
        pattern = self.attr("pattern")
        try:
            self._regex = re.compile(pattern)
        except re.error as exc:
            self.unsupported(f"pattern {pattern!r} (Python re cannot compile it: {exc})")

    def run(self, x: Array) -> Array:
        regex = self._regex
        return _map_strings(lambda s: regex.fullmatch(s) is not None, x, dtype=bool)


@register("StringSplit", versions=(20,))
class StringSplit(Op):
    def run(self, x: Array) -> tuple[Array, Array]:
        x = _strings(x)
        # An unset or empty delimiter splits on runs of whitespace, as Python's str.split(None) does.
        delimiter = self.attr("delimiter", "") or None
        maxsplit = self.attr("maxsplit", -1)
        maxsplit = -1 if maxsplit is None or maxsplit < 0 else int(maxsplit)
        parts = [s.split(delimiter, maxsplit) for s in x.reshape(-1)]
        counts = np.array([len(p) for p in parts], dtype=np.int64)
        width = int(counts.max()) if counts.size else 0
        y = np.full((len(parts), width), "", dtype=object)
        for i, p in enumerate(parts):
            y[i, :len(p)] = p
        return y.reshape(x.shape + (width,)), counts.reshape(x.shape)


# Locales whose case mapping is Python's locale-independent Unicode one (what en_US gives).
_DEFAULT_LOCALES = {"", "C", "POSIX", "C.UTF-8", "en", "en_US", "en_US.UTF-8", "en_US.utf8", "en-US"}


@register("StringNormalizer", versions=(10,))
class StringNormalizer(Op):
    def check(self) -> None:
        check_mode(self, "case_change_action", "NONE", ("NONE", "LOWER", "UPPER"))
        locale = self.attr("locale", "")
        if locale not in _DEFAULT_LOCALES:
            self.unsupported(f"attribute locale={locale!r} (only the default/en_US case mapping is implemented)")
        self._case_sensitive = bool(self.attr("is_case_sensitive"))
        stopwords = self.attr("stopwords", [])
        self._stopwords = frozenset(stopwords if self._case_sensitive else (w.lower() for w in stopwords))

    def run(self, x: Array) -> Array:
        x = _strings(x)
        if not (x.ndim == 1 or (x.ndim == 2 and x.shape[0] == 1)):
            raise op_error(self, f"input must have shape [C] or [1, C], got {list(x.shape)}")
        words = x.reshape(-1)
        if self._stopwords:
            keys = words if self._case_sensitive else _map_strings(str.lower, words)
            words = words[np.fromiter((k not in self._stopwords for k in keys), dtype=bool, count=len(keys))]
        action = self.attr("case_change_action")
        if action != "NONE":
            words = _map_strings(str.lower if action == "LOWER" else str.upper, words)
        if words.size == 0:  # everything was a stop word: one empty string, as the spec says
            words = np.array([""], dtype=object)
        return words.reshape((1, -1) if x.ndim == 2 else (-1,))


@register("TfIdfVectorizer", versions=(9,))
class TfIdfVectorizer(Op):
    """N-gram counts against a fixed pool; skip-grams with every skip up to ``max_skip_count``.

    At load, pool tokens become ids ``0..V-1`` and each pool n-gram becomes a row of ids; at run
    time input tokens are mapped to the same ids (-1 when not in the pool, so they never match)
    and each (n, skip) window set is matched against the pool with one ``np.unique``.
    """

    def check(self) -> None:
        check_mode(self, "mode", "TF", ("TF", "IDF", "TFIDF"))
        strings, ints = self.attr("pool_strings", None), self.attr("pool_int64s", None)
        if (strings is None) == (ints is None):
            self.unsupported("pool_strings and pool_int64s both set or both missing")
        pool = np.array(strings, dtype=object) if strings is not None else np.asarray(ints, dtype=np.int64)
        self._vocab, pool_ids = np.unique(pool, return_inverse=True)
        indexes = np.asarray(self.attr("ngram_indexes"), dtype=np.int64)
        weights = self.attr("weights", None)
        weights = np.ones(len(indexes)) if weights is None else np.asarray(weights, dtype=np.float64)
        self._out_size = int(indexes.max()) + 1 if indexes.size else 0
        starts = [int(v) for v in self.attr("ngram_counts")]
        ends = starts[1:] + [len(pool)]
        # For each n: (pool n-grams as rows of token ids [m, n], their output indexes).
        self._levels: dict[int, tuple[Array, Array]] = {}
        first = 0  # index of the level's first n-gram among all n-grams (ngram_indexes is per n-gram)
        for n, (start, end) in enumerate(zip(starts, ends), start=1):
            m = (end - start) // n
            self._levels[n] = (pool_ids[start:start + m * n].reshape(m, n), indexes[first:first + m])
            first += m
        # Output column scale for IDF/TFIDF: each pool n-gram's weight at its output index.
        self._scale = np.ones(self._out_size)
        if first != len(indexes) or len(weights) != len(indexes):
            self.unsupported(f"pool of {len(pool)} tokens with ngram_counts={starts} and "
                             f"{len(indexes)} ngram_indexes / {len(weights)} weights (inconsistent)")
        self._scale[indexes] = weights

    def _token_ids(self, x: Array) -> Array:
        """Input tokens as pool-vocabulary ids, -1 for tokens the pool does not hold."""
        if self._vocab.dtype == object:
            x = _strings(x)
        elif x.dtype == object:
            raise op_error(self, "string input with an integer pool")
        if self._vocab.size == 0:
            return np.full(x.shape, -1, dtype=np.int64)
        pos = np.searchsorted(self._vocab, x).clip(0, self._vocab.size - 1)
        return np.where(self._vocab[pos] == x, pos, -1).astype(np.int64)

    def run(self, x: Array) -> Array:
        x = np.asarray(x)
        if x.ndim not in (1, 2):
            raise op_error(self, f"input must be 1-D or 2-D, got shape {list(x.shape)}")
        ids = self._token_ids(x.reshape(1, -1) if x.ndim == 1 else x)
        rows, length = ids.shape
        counts = np.zeros((rows, self._out_size), dtype=np.float64)
        for n in range(self.attr("min_gram_length"), self.attr("max_gram_length") + 1):
            level = self._levels.get(n)
            if level is None or len(level[0]) == 0:
                continue
            pool_grams, out_index = level
            # Unigrams have no gaps: count them once, not once per skip value.
            for skip in range(self.attr("max_skip_count") + 1 if n > 1 else 1):
                span = (n - 1) * (skip + 1)
                if span >= length:
                    break
                starts = np.arange(length - span)
                grams = ids[:, starts[:, None] + np.arange(n) * (skip + 1)].reshape(-1, n)
                _, codes = np.unique(np.concatenate([pool_grams, grams]), axis=0, return_inverse=True)
                codes = codes.reshape(-1)
                # Which pool n-gram (if any) each unique code is; pool n-grams are distinct.
                pool_of_code = np.full(codes.max() + 1, -1, dtype=np.int64)
                pool_of_code[codes[:len(pool_grams)]] = np.arange(len(pool_grams))
                hit = pool_of_code[codes[len(pool_grams):]]
                row = np.repeat(np.arange(rows), len(starts))
                found = hit >= 0
                np.add.at(counts, (row[found], out_index[hit[found]]), 1.0)
        counts = self._weigh(counts)
        return (counts[0] if x.ndim == 1 else counts).astype(np.float32)

    def _weigh(self, counts: Array) -> Array:
        mode = self.attr("mode")
        if mode == "TF":
            return counts
        return (np.minimum(counts, 1.0) if mode == "IDF" else counts) * self._scale
