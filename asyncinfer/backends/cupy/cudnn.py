"""Convolution through cuDNN, where CuPy was installed with it (CUDA only).

Returns None when cuDNN cannot be used, and the backend then runs its im2col kernel. cuDNN takes
symmetric pads only; the caller checks that. The bias is added by the caller (one broadcast add),
so both paths share everything but the convolution itself.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def cudnn_convolution() -> Callable[..., Any] | None:
    """``conv(x, w, pads, strides, dilations, group) -> y`` on cuDNN, or None without cuDNN."""
    try:
        import cupy
        from cupy.cuda import cudnn as libcudnn

        try:
            from cupyx import cudnn as cudnn_api
        except ImportError:  # older CuPy kept it as cupy.cudnn
            from cupy import cudnn as cudnn_api  # type: ignore[no-redef]
        libcudnn.getVersion()
    except Exception:  # noqa: BLE001 - no cuDNN library, or a CuPy built without it
        return None

    def conv(x: Any, w: Any, pads: Sequence[int], strides: Sequence[int], dilations: Sequence[int],
             group: int) -> Any:
        x = cupy.ascontiguousarray(x)
        w = cupy.ascontiguousarray(w)
        out = [(size + 2 * p - ((k - 1) * d + 1)) // s + 1
               for size, p, k, d, s in zip(x.shape[2:], pads, w.shape[2:], dilations, strides)]
        y = cupy.empty((x.shape[0], w.shape[0], *out), dtype=x.dtype)
        cudnn_api.convolution_forward(x, w, None, y, tuple(int(p) for p in pads), tuple(int(s) for s in strides),
                                      tuple(int(d) for d in dilations), int(group),
                                      auto_tune=True, tensor_core="auto")
        return y

    return conv
