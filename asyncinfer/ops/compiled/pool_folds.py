"""How the pool loops combine two values of a window (`pool`, `pool_three`): a sum, the exact
max of ``np.maximum``, or the one-instruction max where no NaN is in sight."""
from __future__ import annotations

from . import inline


@inline
def _max(r: float, v: float) -> float:
    """``np.maximum(r, v)``: NaN wins (the bitwise or keeps the loop branch-free)."""
    return v if (v > r) | (v != v) else r


@inline
def _larger(r: float, v: float) -> float:
    """``max(r, v)`` as one vector instruction; a NaN in ``v`` is lost (the callers check for NaN
    separately and then take `_max`)."""
    return v if v > r else r


#: How `_fold` combines: a sum, `_larger` (no NaN in sight), the exact `_max`.
SUM, LARGER, EXACT_MAX = 0, 1, 2


@inline
def _fold(r: float, v: float, how: int) -> float:
    """``r ⊕ v`` the way ``how`` says (a constant at each call: LLVM keeps one branch)."""
    if how == SUM:
        return r + v
    if how == LARGER:
        return _larger(r, v)
    return _max(r, v)
