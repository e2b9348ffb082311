"""Loss ops: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both gather ``-input[n, target[n, d…], d…]`` along the class axis (axis 1), weight it by the
class weight, zero the entries whose target equals ``ignore_index`` (which may lie outside
``[0, C)``, so it is masked before indexing) and reduce. ``mean`` divides by the sum of the
weights actually applied, as the spec says (the count of non-ignored entries without weights).
Narrow floats are computed in float32 and returned in the input's dtype.
"""
from __future__ import annotations

import numpy as np

from .base import Op
from .elementwise import compute_dtype
from .registry import register
from .shape import MaybeArray, check_mode, op_error
from .softmax import log_softmax

_REDUCTIONS = ("none", "sum", "mean")


def nll_loss(op: Op, log_prob: np.ndarray, target: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
    """The reduced negative log-likelihood of ``log_prob`` (N, C, d…) at ``target`` (N, d…), in log_prob's dtype."""
    target = np.asarray(target).astype(np.int64, copy=False)
    n_classes = log_prob.shape[1] if log_prob.ndim > 1 else 0
    if log_prob.ndim < 2 or target.shape != log_prob.shape[:1] + log_prob.shape[2:]:
        raise op_error(op, f"target of shape {target.shape} does not match input of shape {log_prob.shape}")
    ignore = op.attr("ignore_index", None)
    keep = np.ones(target.shape, bool) if ignore is None else target != int(ignore)
    index = np.where(keep, target, 0)
    if ((index < 0) | (index >= n_classes)).any():
        bad = int(index[(index < 0) | (index >= n_classes)][0])
        raise op_error(op, f"target {bad} is out of range for {n_classes} classes")
    picked = np.take_along_axis(log_prob, index[:, None], axis=1)[:, 0]
    w = keep.astype(log_prob.dtype)
    if weight is not None:
        w = w * np.asarray(weight).astype(log_prob.dtype, copy=False)[index]
    loss = -picked * w
    reduction = op.attr("reduction", "mean")
    if reduction == "sum":
        return np.asarray(loss.sum(), dtype=log_prob.dtype)
    if reduction == "mean":
        with np.errstate(all="ignore"):
            return np.asarray(loss.sum() / w.sum(), dtype=log_prob.dtype)
    return loss


class _Loss(Op):
    def check(self) -> None:
        check_mode(self, "reduction", "mean", _REDUCTIONS)


@register("NegativeLogLikelihoodLoss", versions=(12, 13, 22))
class NegativeLogLikelihoodLoss(_Loss):
    def run(self, x: np.ndarray, target: np.ndarray, weight: MaybeArray = None) -> np.ndarray:
        data = x.astype(compute_dtype(x.dtype), copy=False)
        return nll_loss(self, data, target, weight).astype(x.dtype, copy=False)


@register("SoftmaxCrossEntropyLoss", versions=(12, 13))
class SoftmaxCrossEntropyLoss(_Loss):
    """NLL of the log-softmax over the class axis; the second (optional) output is that log-softmax."""

    def run(self, scores: np.ndarray, labels: np.ndarray,
            weights: MaybeArray = None) -> tuple[np.ndarray, np.ndarray]:
        data = scores.astype(compute_dtype(scores.dtype), copy=False)
        if data.ndim < 2:
            raise op_error(self, f"scores of shape {scores.shape} have no class axis")
        with np.errstate(all="ignore"):
            log_prob = log_softmax(data, 1)
        loss = nll_loss(self, log_prob, labels, weights)
        return loss.astype(scores.dtype, copy=False), log_prob.astype(scores.dtype, copy=False)
