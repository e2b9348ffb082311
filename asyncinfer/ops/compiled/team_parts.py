"""The serve loop of the CPU backend's spin team: which compiled kernels its helpers run.

A `concurrency.spin_team.SpinTeam` helper runs a compiled serve loop that never returns to
Python between parts; this one runs the parts of the kernels that split across the team: a
few-row GEMM's block of K (`few_rows`), an attention's heads (`attention`: a decode step's, or
an encoder's as two products a head), a tiled
conv's blocks (`conv_blocks`), a Winograd conv's bands (`winograd_bands`), a depthwise conv's
images or channels (`depthwise_parts`), a 1x1 conv's panels (`pointwise`), a pool's planes
(`pool`), a stem conv's output rows (`direct`), a deep conv's panels of channels by output rows
(`direct_panels`), a band of a GEMM (`blas_call`), a GEMM's panels (`gemm`), a range of a sum,
activation or channel affine map (`one_pass`) and a range of rows of a softmax or of row maxima
(`normalization`), told apart by the kind each poster writes (`PART_KIND` of each module).
"""
from __future__ import annotations

import numpy as np

from ...concurrency.spin_team import KIND, flag_asleep, keep_off_poster, mark_done, next_post, take_part
from . import kernel
from .attention import PART_KIND as ATTENTION
from .attention import PRODUCTS_PART_KIND as ATTENTION_PRODUCTS
from .attention import attention_part, products_part
from .blas_call import PART_KIND as GEMM
from .blas_call import gemm_part
from .conv_blocks import PART_KIND as CONV
from .conv_blocks import conv_part
from .direct import PART_KIND as DIRECT
from .direct import direct_part
from .direct_panels import PART_KIND as DIRECT_PANELS
from .direct_panels import direct_panel_part
from .depthwise_parts import PART_KIND as DEPTHWISE
from .depthwise_parts import depthwise_part
from .winograd_bands import PART_KIND as WINOGRAD
from .winograd_bands import band_part
from .few_rows import few_rows_part
from .gemm import PART_KIND as PANEL_GEMM
from .gemm import gemm_part as panel_gemm_part
from .pointwise import PART_KIND as POINTWISE
from .pool import PART_KIND as POOL
from .pool import pool_part
from .pointwise import SMALL_MAP_PART_KIND as SMALL_MAP
from .pointwise import pointwise_part, small_map_part
from .one_pass import ADD_PART_KIND as SUM
from .one_pass import ACTIVATE_PART_KIND as ACTIVATE
from .one_pass import AFFINE_PART_KIND as AFFINE
from .one_pass import activate_part, add_part, affine_part
from .normalization import ROWS_PART_KIND as ROWS
from .normalization import rows_part


@kernel
def serve_parts(control: np.ndarray, seen: int, rounds: int, masks: np.ndarray, own_loop: bool) -> int:
    """Run the parts posted to this helper's ``control`` row until none came for ``rounds``
    rounds (returns the last sequence number) or the team stops (returns -1); each off its
    poster's core (`keep_off_poster`, ``masks``), unless another thread took it first
    (`take_part`: the poster takes a part over by running this loop for one round, its masks
    empty, ``own_loop`` false, `SpinTeam.wait`). The helper's ``own_loop`` is flagged awake
    while it runs, asleep from the moment it returns (`flag_asleep`)."""
    if own_loop:
        flag_asleep(control, 0)
    while True:
        seq = next_post(control, seen, rounds)
        if seq == seen or seq < 0:
            if own_loop:
                flag_asleep(control, 1)
            return seq
        keep_off_poster(control, masks)
        seen = seq
        if not take_part(control, seq):
            continue
        if control[KIND] == ATTENTION:
            attention_part(control)
        elif control[KIND] == ATTENTION_PRODUCTS:
            products_part(control)
        elif control[KIND] == CONV:
            conv_part(control)
        elif control[KIND] == GEMM:
            gemm_part(control)
        elif control[KIND] == PANEL_GEMM:
            panel_gemm_part(control)
        elif control[KIND] == WINOGRAD:
            band_part(control)
        elif control[KIND] == DEPTHWISE:
            depthwise_part(control)
        elif control[KIND] == POINTWISE:
            pointwise_part(control)
        elif control[KIND] == SMALL_MAP:
            small_map_part(control)
        elif control[KIND] == POOL:
            pool_part(control)
        elif control[KIND] == DIRECT:
            direct_part(control)
        elif control[KIND] == DIRECT_PANELS:
            direct_panel_part(control)
        elif control[KIND] == SUM:
            add_part(control)
        elif control[KIND] == AFFINE:
            affine_part(control)
        elif control[KIND] == ACTIVATE:
            activate_part(control)
        elif control[KIND] == ROWS:
            rows_part(control)
        else:
            few_rows_part(control)
        mark_done(control, seq)
