"""The serve loop of the CPU backend's spin team: which compiled kernels its helpers run.

A `concurrency.spin_team.SpinTeam` helper runs a compiled serve loop that never returns to
Python between parts; this one runs the parts of the kernels that split across the team: a
few-row GEMM's block of K (`few_rows`) and a decode step's attention heads (`attention`),
told apart by the kind each poster writes (`PART_KIND` of each module).
"""
from __future__ import annotations

import numpy as np

from ...concurrency.spin_team import KIND, mark_done, next_post
from . import kernel
from .attention import PART_KIND as ATTENTION
from .attention import attention_part
from .few_rows import few_rows_part


@kernel
def serve_parts(control: np.ndarray, seen: int, rounds: int) -> int:
    """Run the parts posted to this helper's ``control`` row until none came for ``rounds``
    rounds (returns the last sequence number) or the team stops (returns -1)."""
    while True:
        seq = next_post(control, seen, rounds)
        if seq == seen or seq < 0:
            return seq
        seen = seq
        if control[KIND] == ATTENTION:
            attention_part(control)
        else:
            few_rows_part(control)
        mark_done(control, seq)
