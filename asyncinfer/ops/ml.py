"""Traditional-ML ops of the ``ai.onnx.ml`` domain (what scikit-learn / XGBoost exporters emit).

LabelEncoder, Binarizer, ArrayFeatureExtractor, Normalizer, Scaler, OneHotEncoder, Imputer,
FeatureVectorizer, LinearRegressor, LinearClassifier, TreeEnsemble and the older
TreeEnsembleRegressor / TreeEnsembleClassifier.

All tree ops share one evaluator (`_Forest`): the trees are flattened into node arrays with
leaves as extra nodes, and every (row, tree) pair walks down one level per step in vectorised
NumPy, so the Python loop runs once per tree *level*, not per row or node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import Op
from .registry import register
from .shape import check_mode, op_error

Array = np.ndarray
ML = "ai.onnx.ml"


# -- shared helpers -------------------------------------------------------------------------------
def _rows(x: Array) -> Array:
    """``x`` as a 2-D ``[N, F]`` array: a 1-D input is one row (as the ml ops specify)."""
    x = np.asarray(x)
    return x.reshape(1, -1) if x.ndim <= 1 else x.reshape(x.shape[0], -1)


def _one_of(op: Op, *names: str) -> tuple[str, Any] | tuple[None, None]:
    """The one attribute among ``names`` that is set (name, value); refuses more than one."""
    present = [n for n in names if n in op.attrs]
    if len(present) > 1:
        op.unsupported(f"attributes {' and '.join(present)} together")
    return (present[0], op.attrs[present[0]]) if present else (None, None)


def _attr_array(op: Op, name: str, dtype: Any = np.float64) -> Array | None:
    """A list attribute, or its ``<name>_as_tensor`` double form, as an array (None when unset)."""
    value = op.attr(f"{name}_as_tensor", None)
    if value is None:
        value = op.attr(name, None)
    return None if value is None else np.asarray(value, dtype=dtype).reshape(-1)


POST_TRANSFORMS = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")


def _post_transform_name(op: Op) -> str:
    """The post_transform attribute as a name (string in the older ops, an enum int in TreeEnsemble)."""
    value = op.attr("post_transform", "NONE")
    name = POST_TRANSFORMS[value] if isinstance(value, int) and 0 <= value < len(POST_TRANSFORMS) else value
    if name not in POST_TRANSFORMS:
        op.unsupported(f"attribute post_transform={value!r}")
    if name == "PROBIT":  # would need erfinv; exporters practically never emit it
        op.unsupported("attribute post_transform=PROBIT")
    return name


def post_transform(name: str, scores: Array) -> Array:
    """Apply an ml-domain post transform to ``[N, K]`` float64 scores, row by row."""
    if name == "LOGISTIC":
        return 1.0 / (1.0 + np.exp(-scores))
    if name in ("SOFTMAX", "SOFTMAX_ZERO"):
        if scores.shape[1] == 0:
            return scores
        e = np.exp(scores - scores.max(axis=1, keepdims=True))
        if name == "SOFTMAX_ZERO":  # zero scores stay zero and take no share of the mass
            e = np.where(scores == 0, 0.0, e)
        total = e.sum(axis=1, keepdims=True)
        return np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return scores


# -- element-wise mappings ------------------------------------------------------------------------
_LE_KINDS = {"strings": object, "int64s": np.int64, "floats": np.float32}
_LE_DEFAULTS = {"strings": ("default_string", "_Unused"), "int64s": ("default_int64", -1),
                "floats": ("default_float", -0.0)}


@register("LabelEncoder", versions=(2, 4), domain=ML)
class LabelEncoder(Op):
    """Key → value lookup: keys sorted once at load, then one ``searchsorted`` per run."""

    def check(self) -> None:
        tensors = ("_tensor",) if self.version >= 4 else ()
        key_attr, keys = _one_of(self, *(f"keys_{k}" for k in _LE_KINDS), *(f"keys{t}" for t in tensors))
        value_attr, values = _one_of(self, *(f"values_{k}" for k in _LE_KINDS), *(f"values{t}" for t in tensors))
        if key_attr is None or value_attr is None:
            self.unsupported("a mapping without keys_* or values_*")
        keys = self._array(key_attr, keys)
        values = self._array(value_attr, values)
        if len(keys) != len(values):
            self.unsupported(f"{len(keys)} keys with {len(values)} values")
        default = self.attr("default_tensor", None) if self.version >= 4 else None
        if default is not None:
            default = np.asarray(default).reshape(-1)[0]
        elif value_attr == "values_tensor":
            default = "_Unused" if values.dtype == object else (-0.0 if values.dtype.kind == "f" else -1)
        else:
            name, fallback = _LE_DEFAULTS[value_attr.removeprefix("values_")]
            default = self.attr(name, fallback)
        self._default = np.asarray(default, dtype=values.dtype)
        # The last of repeated keys wins: unique over the reversed keys keeps each key's last entry.
        nan = keys != keys if keys.dtype.kind == "f" else np.zeros(len(keys), dtype=bool)
        self._nan_value = values[np.flatnonzero(nan)[-1]] if nan.any() else None
        keys, values = keys[~nan][::-1], values[~nan][::-1]
        self._keys, first = np.unique(keys, return_index=True)
        self._values = values[first]

    @staticmethod
    def _array(name: str, value: Any) -> Array:
        kind = name.split("_", 1)[1]
        return np.asarray(value).reshape(-1) if kind == "tensor" else np.asarray(value, dtype=_LE_KINDS[kind])

    def run(self, x: Array) -> Array:
        x = np.asarray(x)
        out = np.full(x.shape, self._default, dtype=self._values.dtype)
        if self._keys.size:
            pos = np.searchsorted(self._keys, x).clip(0, self._keys.size - 1)
            found = self._keys[pos] == x
            out[found] = self._values[pos[found]]
        if self._nan_value is not None and x.dtype.kind == "f":
            out[np.isnan(x)] = self._nan_value
        return out


@register("Binarizer", versions=(1,), domain=ML)
class Binarizer(Op):
    def run(self, x: Array) -> Array:
        x = np.asarray(x)
        return (x > self.attr("threshold")).astype(x.dtype)


@register("ArrayFeatureExtractor", versions=(1,), domain=ML)
class ArrayFeatureExtractor(Op):
    def run(self, x: Array, indices: Array) -> Array:
        x = np.asarray(x)
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        last = x.shape[-1] if x.ndim else 1
        if indices.size and (indices.min() < 0 or indices.max() >= last):
            raise op_error(self, f"indices {indices.tolist()} out of range for last dimension {last}")
        if x.ndim <= 1:  # a vector gives one row, as onnxruntime does
            return x.reshape(1, -1)[:, indices]
        return x[..., indices]


@register("Imputer", versions=(1,), domain=ML)
class Imputer(Op):
    def check(self) -> None:
        if _one_of(self, "imputed_value_floats", "imputed_value_int64s")[0] is None:
            self.unsupported("no imputed_value_floats or imputed_value_int64s")

    def run(self, x: Array) -> Array:
        x = np.asarray(x)
        if x.dtype.kind == "f":
            imputed = np.asarray(self.attr("imputed_value_floats", [0.0]), dtype=x.dtype)
            replaced = self.attr("replaced_value_float")
            hit = np.isnan(x) if np.isnan(replaced) else x == replaced
        else:
            imputed = np.asarray(self.attr("imputed_value_int64s", [0]), dtype=x.dtype)
            hit = x == self.attr("replaced_value_int64")
        if imputed.size not in (1, x.shape[-1] if x.ndim else 1):
            raise op_error(self, f"{imputed.size} imputed values for {x.shape[-1]} features")
        return np.where(hit, imputed, x)


@register("Scaler", versions=(1,), domain=ML)
class Scaler(Op):
    def run(self, x: Array) -> Array:
        offset = np.asarray(self.attr("offset", [0.0]), dtype=np.float32)
        scale = np.asarray(self.attr("scale", [1.0]), dtype=np.float32)
        return ((np.asarray(x, dtype=np.float32) - offset) * scale).astype(np.float32)


@register("Normalizer", versions=(1,), domain=ML)
class Normalizer(Op):
    def check(self) -> None:
        check_mode(self, "norm", "MAX", ("MAX", "L1", "L2"))

    def run(self, x: Array) -> Array:
        x = np.asarray(x)
        rows = _rows(x).astype(np.float64)
        norm = self.attr("norm")
        if norm == "MAX":
            divisor = rows.max(axis=1, keepdims=True)
        elif norm == "L1":
            divisor = np.abs(rows).sum(axis=1, keepdims=True)
        else:
            divisor = np.sqrt((rows * rows).sum(axis=1, keepdims=True))
        out = np.divide(rows, divisor, out=rows.copy(), where=divisor != 0)  # a zero divisor leaves X
        return out.astype(np.float32).reshape(x.shape)


@register("OneHotEncoder", versions=(1,), domain=ML)
class OneHotEncoder(Op):
    def check(self) -> None:
        name, cats = _one_of(self, "cats_strings", "cats_int64s")
        if name is None:
            self.unsupported("no cats_strings or cats_int64s")
        self._cats = np.array(cats, dtype=object if name == "cats_strings" else np.int64)

    def run(self, x: Array) -> Array:
        x = np.asarray(x)
        if (x.dtype == object) != (self._cats.dtype == object):
            raise op_error(self, f"input of type {x.dtype} with categories of type {self._cats.dtype}")
        if x.dtype.kind == "f":
            x = x.astype(np.int64)  # numeric inputs are cast to integers, as specified
        hits = x[..., None] == self._cats
        if not self.attr("zeros") and not hits.any(axis=-1).all():
            raise op_error(self, "an input value is not among the categories (zeros=0)")
        return hits.astype(np.float32)


@register("FeatureVectorizer", versions=(1,), domain=ML)
class FeatureVectorizer(Op):
    def run(self, *xs: Array) -> Array:
        arrays = [_rows(x) for x in xs if x is not None]
        dims = self.attr("inputdimensions", None) or [a.shape[1] for a in arrays]
        if len(dims) != len(arrays):
            raise op_error(self, f"{len(arrays)} inputs for {len(dims)} inputdimensions")
        n = arrays[0].shape[0]
        out = np.zeros((n, sum(dims)), dtype=np.float32)
        start = 0
        for a, d in zip(arrays, dims):  # each input fills its slot; shorter ones are zero-padded
            take = min(d, a.shape[1])
            out[:, start:start + take] = a[:, :take]
            start += d
        return out


# -- linear models --------------------------------------------------------------------------------
class _Linear(Op):
    """``scores = X @ W.T + b``: the flat ``coefficients`` hold one row of F weights per target/class
    (F, the feature count, is only known at run time)."""

    def check(self) -> None:
        self._coefficients = np.asarray(self.attr("coefficients"), dtype=np.float64)
        intercepts = self.attr("intercepts", None)
        self._bias = None if intercepts is None else np.asarray(intercepts, dtype=np.float64)
        self._transform = _post_transform_name(self)

    def scores(self, x: Array) -> Array:
        rows = _rows(x).astype(np.float64)
        features = rows.shape[1]
        if features == 0 or self._coefficients.size % features:
            raise op_error(self, f"{self._coefficients.size} coefficients do not fit {features} features")
        weights = self._coefficients.reshape(-1, features)
        if self._bias is not None and self._bias.size != len(weights):
            raise op_error(self, f"{self._bias.size} intercepts for {len(weights)} coefficient rows")
        scores = rows @ weights.T
        return scores if self._bias is None else scores + self._bias


@register("LinearRegressor", versions=(1,), domain=ML)
class LinearRegressor(_Linear):
    def run(self, x: Array) -> Array:
        scores = self.scores(x)
        if scores.shape[1] != self.attr("targets"):
            raise op_error(self, f"{scores.shape[1]} coefficient rows for targets={self.attr('targets')}")
        return post_transform(self._transform, scores).astype(np.float32)


def _class_labels(op: Op, ints: str, strings: str = "classlabels_strings") -> Array:
    name, labels = _one_of(op, ints, strings)
    if name is None:
        op.unsupported(f"no {ints} or {strings}")
    return np.array(labels, dtype=object if name == strings else np.int64)


def _classify(labels: Array, scores: Array, transform: str) -> tuple[Array, Array]:
    """Labels (arg-max) and post-transformed scores of a classifier.

    A two-class model with one score column ``s`` (the positive class) labels by ``s > 0`` and
    reports ``[1 - p, p]`` with ``p = s`` (``sigmoid(s)`` under LOGISTIC), as onnxruntime does.
    """
    if len(labels) == 2 and scores.shape[1] == 1:
        positive = scores[:, 0]
        p = post_transform("LOGISTIC", positive) if transform == "LOGISTIC" else positive
        return labels[(positive > 0).astype(np.int64)], np.stack([1.0 - p, p], axis=1)
    scores = post_transform(transform, scores)
    return labels[np.argmax(scores, axis=1)] if scores.shape[1] else labels[:0], scores


@register("LinearClassifier", versions=(1,), domain=ML)
class LinearClassifier(_Linear):
    def check(self) -> None:
        super().check()
        self._labels = _class_labels(self, "classlabels_ints")

    def run(self, x: Array) -> tuple[Array, Array]:
        labels, scores = _classify(self._labels, self.scores(x), self._transform)
        return labels, scores.astype(np.float32)


# -- tree ensembles -------------------------------------------------------------------------------
LEAF = -1
_MODES = ("BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ", "BRANCH_MEMBER")
_MEMBER = 6
_AGGREGATES = ("AVERAGE", "SUM", "MIN", "MAX")


@dataclass
class _Forest:
    """Trees as flat node arrays; leaves are nodes too (mode LEAF), each with a run of votes.

    ``votes_start[leaf] : votes_start[leaf + 1]`` indexes ``vote_target`` / ``vote_weight``.
    """

    feature: Array
    mode: Array
    threshold: Array
    true_next: Array
    false_next: Array
    missing_true: Array
    members: dict[int, Array]
    roots: Array
    votes_start: Array
    vote_target: Array
    vote_weight: Array

    def leaves(self, op: Op, x: Array) -> Array:
        """The leaf node that each row reaches in each tree, ``[N, n_trees]``."""
        if x.shape[1] and self.feature.size and self.feature.max(initial=0) >= x.shape[1]:
            raise op_error(op, f"the trees read feature {int(self.feature.max())}, the input has {x.shape[1]}")
        cur = np.repeat(self.roots[None, :], x.shape[0], axis=0)
        for _ in range(len(self.mode) + 1):  # a well-formed tree is at most that deep
            r, t = np.nonzero(self.mode[cur] != LEAF)
            if r.size == 0:
                return cur
            node = cur[r, t]
            value, mode, thr = x[r, self.feature[node]], self.mode[node], self.threshold[node]
            cond = np.select([mode == 0, mode == 1, mode == 2, mode == 3, mode == 4, mode == 5],
                             [value <= thr, value < thr, value >= thr, value > thr, value == thr, value != thr],
                             default=False)
            for member_node, values in self.members.items():
                here = node == member_node
                if here.any():
                    cond[here] = np.isin(value[here], values)
            cond = np.where(np.isnan(value), self.missing_true[node], cond)
            cur[r, t] = np.where(cond, self.true_next[node], self.false_next[node])
        raise op_error(op, "the tree structure has a cycle")

    def aggregate(self, op: Op, x: Array, n_targets: int, how: str) -> tuple[Array, Array]:
        """Per-target ``[N, n_targets]`` float64 aggregate of the votes of every reached leaf, and
        which (row, target) pairs got any vote (the others score 0)."""
        leaves = self.leaves(op, x).reshape(-1)
        counts = self.votes_start[leaves + 1] - self.votes_start[leaves]
        # Expand each (row, leaf) into its votes without a Python loop.
        vote = np.repeat(self.votes_start[leaves] - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        row = np.repeat(np.arange(len(leaves)) // len(self.roots), counts)
        flat = row * n_targets + self.vote_target[vote]
        weight = self.vote_weight[vote]
        size = x.shape[0] * n_targets
        voted = np.zeros(size, dtype=bool)
        voted[flat] = True
        if how in ("SUM", "AVERAGE"):
            scores = np.bincount(flat, weights=weight, minlength=size)
            if how == "AVERAGE":
                scores /= len(self.roots)
        else:
            scores = np.full(size, np.inf if how == "MIN" else -np.inf)
            (np.minimum if how == "MIN" else np.maximum).at(scores, flat, weight)
            scores[~voted] = 0.0
        shape = (x.shape[0], n_targets)
        return scores.reshape(shape), voted.reshape(shape)


def _leaf_votes(n_leaves: int, leaf: Array, target: Array, weight: Array) -> tuple[Array, Array, Array]:
    """CSR vote arrays (``votes_start`` over ``n_leaves`` nodes, targets, weights) grouped by leaf."""
    order = np.argsort(leaf, kind="stable")
    start = np.zeros(n_leaves + 1, dtype=np.int64)
    np.cumsum(np.bincount(leaf, minlength=n_leaves), out=start[1:])
    return start, target[order].astype(np.int64), weight[order].astype(np.float64)


def _check_forest_size(op: Op, lengths: dict[str, int]) -> None:
    if len(set(lengths.values())) > 1:
        op.unsupported("node attributes of different lengths (" +
                       ", ".join(f"{k}: {v}" for k, v in lengths.items()) + ")")


@register("TreeEnsemble", versions=(5,), domain=ML)
class TreeEnsemble(Op):
    def check(self) -> None:
        names = ("nodes_featureids", "nodes_modes", "nodes_splits", "nodes_truenodeids", "nodes_falsenodeids",
                 "nodes_trueleafs", "nodes_falseleafs")
        nodes = {n: np.asarray(self.attr(n)).reshape(-1) for n in names}
        missing = self.attr("nodes_missing_value_tracks_true", None)
        nodes["missing"] = np.zeros(len(nodes["nodes_modes"]), bool) if missing is None else np.asarray(missing, bool)
        _check_forest_size(self, {k: len(v) for k, v in nodes.items()})
        n = len(nodes["nodes_modes"])
        mode = nodes["nodes_modes"].astype(np.int64)
        if mode.size and (mode.min() < 0 or mode.max() > _MEMBER):
            self.unsupported(f"nodes_modes value {int(mode.max())}")
        leaf_target = np.asarray(self.attr("leaf_targetids"), dtype=np.int64)
        leaf_weight = np.asarray(self.attr("leaf_weights"), dtype=np.float64).reshape(-1)
        if len(leaf_target) != len(leaf_weight):
            self.unsupported(f"{len(leaf_target)} leaf_targetids with {len(leaf_weight)} leaf_weights")
        self._n_targets = int(self.attr("n_targets", int(leaf_target.max(initial=-1)) + 1))
        if leaf_target.size and (leaf_target.min() < 0 or leaf_target.max() >= self._n_targets):
            self.unsupported(f"leaf_targetids outside [0, n_targets={self._n_targets})")
        aggregate = self.attr("aggregate_function")
        if aggregate not in range(len(_AGGREGATES)):
            self.unsupported(f"attribute aggregate_function={aggregate}")
        self._aggregate = _AGGREGATES[aggregate]
        self._transform = _post_transform_name(self)
        # Sets of BRANCH_MEMBER nodes: membership_values lists them in node order, NaN-separated.
        members: dict[int, Array] = {}
        member_nodes = np.flatnonzero(mode == _MEMBER)
        if member_nodes.size:
            values = np.asarray(self.attr("membership_values"), dtype=np.float64).reshape(-1)
            sets = np.split(values, np.flatnonzero(np.isnan(values)))
            sets = [s[~np.isnan(s)] for s in sets][:member_nodes.size]
            if len(sets) < member_nodes.size:
                self.unsupported(f"{len(sets)} membership sets for {member_nodes.size} BRANCH_MEMBER nodes")
            members = dict(zip(member_nodes.tolist(), sets))
        # Leaf k becomes node n + k: a child index points at a leaf when its *leafs flag is set.
        children = [np.where(nodes[f"nodes_{side}leafs"].astype(bool), n, 0) + nodes[f"nodes_{side}nodeids"]
                    for side in ("true", "false")]
        n_leaves = len(leaf_weight)
        self._forest = _Forest(
            feature=np.concatenate([nodes["nodes_featureids"].astype(np.int64), np.zeros(n_leaves, np.int64)]),
            mode=np.concatenate([mode, np.full(n_leaves, LEAF)]),
            threshold=np.concatenate([nodes["nodes_splits"].astype(np.float64), np.zeros(n_leaves)]),
            true_next=np.concatenate([children[0].astype(np.int64), np.zeros(n_leaves, np.int64)]),
            false_next=np.concatenate([children[1].astype(np.int64), np.zeros(n_leaves, np.int64)]),
            missing_true=np.concatenate([nodes["missing"], np.zeros(n_leaves, bool)]),
            members=members, roots=np.asarray(self.attr("tree_roots"), dtype=np.int64),
            votes_start=np.arange(n + n_leaves + 1, dtype=np.int64) - n,
            vote_target=leaf_target, vote_weight=leaf_weight)
        self._forest.votes_start[: n + 1] = 0  # interior nodes cast no votes

    def run(self, x: Array) -> Array:
        x = np.asarray(x)
        if x.ndim != 2:
            raise op_error(self, f"input must be [N, F], got shape {list(x.shape)}")
        scores, _ = self._forest.aggregate(self, x.astype(np.float64), self._n_targets, self._aggregate)
        return post_transform(self._transform, scores).astype(x.dtype)


class _LegacyTrees(Op):
    """Builds a `_Forest` from the (tree id, node id)-keyed attributes of the pre-v5 ops."""

    def build(self, vote_prefix: str, vote_target_attr: str) -> None:
        tree_ids = np.asarray(self.attr("nodes_treeids"), dtype=np.int64)
        node_ids = np.asarray(self.attr("nodes_nodeids"), dtype=np.int64)
        modes = self.attr("nodes_modes")
        thresholds = _attr_array(self, "nodes_values")
        if thresholds is None:  # neither nodes_values nor nodes_values_as_tensor
            self.unsupported("a tree ensemble without nodes_values")
        true_ids = np.asarray(self.attr("nodes_truenodeids"), dtype=np.int64)
        false_ids = np.asarray(self.attr("nodes_falsenodeids"), dtype=np.int64)
        missing = self.attr("nodes_missing_value_tracks_true", None)
        missing = np.zeros(len(modes), bool) if missing is None else np.asarray(missing, bool)
        features = np.asarray(self.attr("nodes_featureids"), dtype=np.int64)
        _check_forest_size(self, {"nodes_treeids": len(tree_ids), "nodes_nodeids": len(node_ids),
                                  "nodes_modes": len(modes), "nodes_values": len(thresholds),
                                  "nodes_truenodeids": len(true_ids), "nodes_falsenodeids": len(false_ids),
                                  "nodes_featureids": len(features), "missing": len(missing)})
        bad = sorted(set(modes) - set(_MODES[:_MEMBER]) - {"LEAF"})
        if bad:
            self.unsupported(f"nodes_modes {bad}")
        index = {(t, n): i for i, (t, n) in enumerate(zip(tree_ids.tolist(), node_ids.tolist()))}
        mode = np.array([LEAF if m == "LEAF" else _MODES.index(m) for m in modes], dtype=np.int64)
        interior = mode != LEAF

        def child(ids: Array) -> Array:
            try:
                return np.array([index[(t, c)] if leaf is False else i for i, (t, c, leaf) in
                                 enumerate(zip(tree_ids.tolist(), ids.tolist(), (~interior).tolist()))],
                                dtype=np.int64)
            except KeyError as exc:
                self.unsupported(f"a child node id {exc.args[0]} that no node has")
                raise  # unreachable: unsupported raises

        true_next, false_next = child(true_ids), child(false_ids)
        # A tree's root is its node that is no other node's child.
        is_child = np.zeros(len(mode), bool)
        is_child[true_next[interior]] = True
        is_child[false_next[interior]] = True
        roots = [int(np.flatnonzero((tree_ids == t) & ~is_child)[0]) for t in dict.fromkeys(tree_ids.tolist())]
        vote_tree = np.asarray(self.attr(f"{vote_prefix}_treeids"), dtype=np.int64)
        vote_node = np.asarray(self.attr(f"{vote_prefix}_nodeids"), dtype=np.int64)
        vote_target = np.asarray(self.attr(vote_target_attr), dtype=np.int64)
        vote_weight = _attr_array(self, f"{vote_prefix}_weights")
        if vote_weight is None or not len(vote_tree) == len(vote_node) == len(vote_target) == len(vote_weight):
            self.unsupported(f"{vote_prefix}_* attributes of different lengths")
        try:
            vote_leaf = np.array([index[(t, n)] for t, n in zip(vote_tree.tolist(), vote_node.tolist())],
                                 dtype=np.int64)
        except KeyError as exc:
            self.unsupported(f"a {vote_prefix} vote for node {exc.args[0]} that does not exist")
        start, target, weight = _leaf_votes(len(mode), vote_leaf, vote_target, vote_weight)
        self._forest = _Forest(feature=features, mode=mode, threshold=thresholds, true_next=true_next,
                               false_next=false_next, missing_true=missing, members={},
                               roots=np.asarray(roots, dtype=np.int64), votes_start=start,
                               vote_target=target, vote_weight=weight)
        self._transform = _post_transform_name(self)
        self._base = _attr_array(self, "base_values")
        self._targets = target

    def scores(self, x: Array, n_targets: int, how: str, base_where_voted: bool) -> Array:
        """Aggregated votes plus base_values; ``base_where_voted``: only to (row, target) pairs that
        got a vote (onnxruntime's regressor leaves the others at 0, its classifier does not)."""
        rows = _rows(x).astype(np.float64)
        scores, voted = self._forest.aggregate(self, rows, n_targets, how)
        if self._base is not None and self._base.size:
            if self._base.size != n_targets:
                raise op_error(self, f"{self._base.size} base_values for {n_targets} targets")
            scores += np.where(voted, self._base, 0.0) if base_where_voted else self._base
        return scores


@register("TreeEnsembleRegressor", versions=(1, 3, 5), domain=ML)
class TreeEnsembleRegressor(_LegacyTrees):
    def check(self) -> None:
        check_mode(self, "aggregate_function", "SUM", _AGGREGATES)
        self.build("target", "target_ids")
        self._n_targets = int(self.attr("n_targets", int(self._targets.max(initial=-1)) + 1))

    def run(self, x: Array) -> Array:
        scores = self.scores(x, self._n_targets, self.attr("aggregate_function"), True)
        return post_transform(self._transform, scores).astype(np.float32)


@register("TreeEnsembleClassifier", versions=(1, 3, 5), domain=ML)
class TreeEnsembleClassifier(_LegacyTrees):
    def check(self) -> None:
        self._labels = _class_labels(self, "classlabels_int64s")
        if len(self._labels) <= 2:
            # onnxruntime gives two-class trees special labelling/score conventions (threshold 0.5 or
            # 0 by weight signs, fixed negative column) that this kernel does not reproduce.
            self.unsupported(f"a {len(self._labels)}-class model (binary tree classifiers)")
        self.build("class", "class_ids")

    def run(self, x: Array) -> tuple[Array, Array]:
        labels, scores = _classify(self._labels, self.scores(x, len(self._labels), "SUM", False), self._transform)
        return labels, scores.astype(np.float32)
