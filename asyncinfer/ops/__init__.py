"""Operator kernels, one module per op family. Importing this package registers every op.

The NumPy kernels here are the reference semantics of every backend and the CPU backend's kernels.
"""
from __future__ import annotations

from . import (  # noqa: F401  (imported for their @register side effects)
    attention,
    contrib,
    controlflow,
    conv,
    conv_pool,
    elementwise,
    expand_depthwise,
    fused,
    gradient,
    image,
    image_decoder,
    indexing,
    joined_conv,
    linalg,
    loss,
    ml,
    normalization,
    pointwise,
    pool,
    quantize,
    random,
    reduce,
    residual_conv,
    resize,
    rnn,
    sequence,
    shape,
    shuffled_conv,
    signal,
    softmax,
    squeeze_excite,
    text,
    training,
)
from .base import Op
from .registry import create, lookup, register, registered

__all__ = ["Op", "create", "lookup", "register", "registered"]
