"""Intra-op parallelism: a kernel splits a large piece of work across its pool's idle threads.

Inside asyncinfer, BLAS runs one thread per call (``backends/cpu/blas.py`` says why). A kernel
with enough work, a large GEMM, cuts it into parts instead, with `run_parts`: the pool's
threads and the calling thread take parts in turn until none is left. The caller waits only for
parts another thread has already started, never for a queued helper, so a busy pool cannot
deadlock it: at worst the caller runs every part itself, as if nothing were split.

The pool a thread may split into is thread-local: the CPU backend binds its pool on each of its
threads (`bind_pool`). Elsewhere (a device thread, the caller's thread) nothing is split.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from .spin_team import SpinTeam

_local = threading.local()


def bind_pool(submit: Callable[[Callable[[], None]], object] | None, width: int,
              team: SpinTeam | None = None, crowded: Callable[[], bool] | None = None) -> None:
    """Let kernels on the calling thread split work into ``width`` parts, handing helpers to
    ``submit`` (the pool's submit), and compiled parts to ``team`` when it is free (see
    `spin_team`) and ``crowded()`` is false (the pool's other threads are idle: a helper would
    only take a core from their work, and the caller spin while it waits). Called once per pool
    thread, when it starts."""
    _local.submit, _local.width, _local.team, _local.crowded = submit, width, team, crowded


class pool_bound:  # noqa: N801 - used as a function: ``with pool_bound(...):``
    """Within the block, kernels on this thread may split into ``width`` parts handed to
    ``submit`` or ``team`` (for code that runs kernels outside a CPU backend's pool, and for tests;
    a class, not a generator-based context manager: a blocking run enters one, and that costs
    about a microsecond more)."""

    __slots__ = ("_binding", "_outer")

    def __init__(self, submit: Callable[[Callable[[], None]], object] | None, width: int,
                 team: SpinTeam | None = None, crowded: Callable[[], bool] | None = None):
        self._binding = (submit, width, team, crowded)

    def __enter__(self) -> None:
        self._outer = (getattr(_local, "submit", None), getattr(_local, "width", 1), getattr(_local, "team", None),
                       getattr(_local, "crowded", None))
        bind_pool(*self._binding)

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        bind_pool(*self._outer)


def team(kind: int) -> SpinTeam | None:
    """The spinning helpers this thread may hand compiled parts of ``kind`` (the `PART_KIND` a
    poster writes) to now, ready to run them (`SpinTeam.ready`); None: use `run_parts`."""
    if crowded():
        return None
    bound = getattr(_local, "team", None)
    if bound is not None:
        bound.ready(kind)
    return bound


def crowded() -> bool:
    """Whether other threads run this backend's work now (concurrent requests: each core has
    its own), so that this thread's kernel runs alone on its core, sharing the L3 and memory."""
    crowded = getattr(_local, "crowded", None)
    return crowded is not None and crowded()


def team_size() -> int:
    """This thread and its spinning helpers, free or not (1: it has none): how many parts to plan
    a kernel in once for every later run (`team` says whether they may be taken now)."""
    team = getattr(_local, "team", None)
    return 1 if team is None else team.helpers + 1


def parts_available() -> int:
    """How many parts a kernel on this thread may split into (1: run it whole)."""
    return getattr(_local, "width", 1)


def run_parts(count: int, part: Callable[[int], None]) -> None:
    """Run ``part(0) … part(count - 1)``, in parallel where pool threads are free; re-raise the
    first error once every started part has ended."""
    submit = getattr(_local, "submit", None)
    if submit is None or count < 2:
        for i in range(count):
            part(i)
        return
    claims = itertools.count()  # next() on it is atomic under the GIL: each part runs once
    lock = threading.Lock()
    finished = threading.Event()
    state = {"left": count}
    errors: list[BaseException] = []

    def take_parts() -> None:
        while (i := next(claims)) < count:
            try:
                part(i)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(exc)
            with lock:
                state["left"] -= 1
                if state["left"] == 0:
                    finished.set()

    for _ in range(min(count, parts_available()) - 1):
        try:
            submit(take_parts)
        except RuntimeError:  # the pool is shutting down: this thread does the rest
            break
    take_parts()
    finished.wait()  # only parts already started elsewhere remain: they are running
    if errors:
        raise errors[0]
