"""Cancellation that reaches inside a running kernel.

Cancelling a run skips the layers that have not started; a started kernel normally runs to its
end. Kernels that may run for long on one call (the bodies of Loop, Scan, SequenceMap) check
between iterations instead: the thread that starts such a kernel installs its run's check with
`cancel_scope`, and the kernel calls `cancel_requested` where it may stop early.
The check is thread-local, so concurrent runs on one pool never see each other's cancellation.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_current = threading.local()


@contextmanager
def cancel_scope(is_cancelled: Callable[[], bool]) -> Iterator[None]:
    """Within the block, `cancel_requested` on this thread asks ``is_cancelled``."""
    outer = getattr(_current, "check", None)
    _current.check = is_cancelled
    try:
        yield
    finally:
        _current.check = outer  # never keep a finished run alive through a pool thread


def cancel_requested() -> bool:
    """True if the run whose kernel this thread is executing has been cancelled."""
    check = getattr(_current, "check", None)
    return check is not None and check()
