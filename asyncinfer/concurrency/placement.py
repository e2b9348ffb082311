"""Keeping a spinning helper off the core of the thread that posts its parts (Linux).

A lane thread running a layer posts parts of it to the spinning helpers (`spin_team.py`) and
runs its own part meanwhile. A helper that had gone to sleep is woken by the lane, and Linux
places a woken thread near its waker, often on the waker's very core: the lane and the helper
then take turns on one core while another sits idle, until the load balancer moves one of
them, milliseconds later, and the next wake-up may put them together again. On the 2-core Zen 5
VM each of the two took about 70 involuntary context switches a MobileNetV3-small run, and the
run took 1.6-2.3 ms where the lane and the helper happened to share a core, against 1.4-1.5
where they did not (BERT-tiny 1.19 against 0.89 ms).

So each post carries the poster's core (`spin_team.post`), and a helper that finds itself on
that core binds itself to the process's other cores (`move_away`) before it runs the part: one
system call, made only when the two met, after which the OS can no longer put them together
until the poster itself moves. Binding every compute thread to a fixed core instead stacked a
parallel run's second lane on the helper's core (ResNet-18 10.6 -> 20 ms).

The lanes that run layers (`lanes.LanePool`) are left to the OS: bound to a core each (lane
``i`` to the ``i``-th), 8 tasks awaiting SqueezeNet ran no faster (354 against 366 runs/s) and
the event loop, which must then wait for a core a lane holds, lagged more (p99 4.9 against
1.8 ms).

``ASYNCINFER_PIN_THREADS=0`` leaves the helpers where the OS puts them. Elsewhere
than Linux, or with a single core to run on, nothing is bound.
"""
from __future__ import annotations

import os


def enabled() -> bool:
    """Whether helpers move off their poster's core (``ASYNCINFER_PIN_THREADS``, default on)."""
    return os.environ.get("ASYNCINFER_PIN_THREADS", "").strip() != "0"


def allowed_cores() -> list[int]:
    """The cores the calling thread may run on, in order ([] where the OS does not say)."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return []
    try:
        return sorted(getter(0))
    except OSError:
        return []


def move_away(core: int, cores: list[int]) -> bool:
    """Bind the calling thread to ``cores`` but ``core`` (it moves at once); False, having done
    nothing, when no other core is left or the OS refuses."""
    others = [c for c in cores if c != core]
    if not others:
        return False
    try:
        os.sched_setaffinity(0, others)
    except OSError:  # a core taken away since, or a sandbox refusing it: left to the OS
        return False
    return True

