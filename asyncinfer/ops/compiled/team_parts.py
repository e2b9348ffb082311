"""The serve loop of the CPU backend's spin team: which compiled kernels its helpers run.

A `concurrency.spin_team.SpinTeam` helper runs a compiled serve loop that never returns to
Python between parts; this one runs the parts of the kernels that split across the team: a
few-row GEMM's block of K (`few_rows`), an attention's heads (`attention`: a decode step's, or
an encoder's as two products a head), a tiled
conv's blocks (`conv_blocks`), a Winograd conv's bands (`winograd_bands`), a depthwise conv's
images or channels (`depthwise_parts`), a 1x1 expansion and its depthwise conv's panels or rows
(`expand_depthwise`), a 1x1 conv's panels (`pointwise`), a pool's planes
(`pool`), a stem conv's output rows (`direct`), a deep conv's panels of channels by output rows
(`direct_panels`), a band of a GEMM (`blas_call`), a GEMM's panels (`gemm`), a range of a sum,
activation or channel affine map (`one_pass`), a range of rows of a softmax or of row maxima
(`normalization`) and a squeeze-and-excitation block's channels (`squeeze_excite`), told apart by the kind each poster writes (`PART_KIND` of each module).

The loop calls each kind's part through its **runner**, a C function compiled for that kind
alone (`prepare_part`, when a layer first hands that kind to the team) whose address sits in
`RUNNERS`. Calling every kind's part directly, the loop compiled every kernel of the team (125
of the 154 s SqueezeNet's first run took on an empty numba cache, on two cores) before its first
part of any kind; now a model compiles the kinds it runs.
"""
from __future__ import annotations

import threading
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...concurrency.spin_team import KIND, ROW, flag_asleep, keep_off_poster, mark_done, next_post, take_part
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
from .expand_depthwise import PART_KIND as EXPAND_DEPTHWISE
from .expand_depthwise import expand_depthwise_part
from .winograd_bands import PART_KIND as WINOGRAD
from .winograd_bands import band_part
from .few_rows import PART_KIND as FEW_ROWS
from .few_rows import few_rows_part
from .gemm import PART_KIND as PANEL_GEMM
from .gemm import gemm_part as panel_gemm_part
from .pointwise import PART_KIND as POINTWISE
from .pool import FIRST_PART_KIND as FIRST_POOL
from .pool import (COLUMNS_FIRST, FLAT, ROWS_FIRST, THREE_BY_ONE_MAX, THREE_BY_ONE_MEAN, THREE_BY_ONE_SUM, THREE_BY_TWO,
                   TILES, flat_pool, pool2d, pool2d_columns_first, pool_part, three_by_one_max_range,
                   three_by_one_mean_range, three_by_one_sum_range, three_by_two_range, tiles_range)
from .pointwise import SMALL_MAP_PART_KIND as SMALL_MAP
from .pointwise import pointwise_part, small_map_part
from .one_pass import ADD_PART_KIND as SUM
from .one_pass import ACTIVATE_PART_KIND as ACTIVATE
from .one_pass import AFFINE_PART_KIND as AFFINE
from .one_pass import activate_part, add_part, affine_part
from .normalization import ROWS_PART_KIND as ROWS
from .normalization import rows_part
from .squeeze_excite import PART_KIND as SQUEEZE_EXCITE
from .squeeze_excite import squeeze_excite_part


@intrinsic
def _run(typingctx: Any, address: Any, row: Any) -> Any:
    """Call the runner at ``address`` on the control row ``row`` (compiled code only)."""
    signature = types.void(types.int64, row)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[1])(context, builder, args[1]).data
        runner = ir.FunctionType(ir.VoidType(), [data.type])
        builder.call(builder.inttoptr(args[0], runner.as_pointer()), [data])
        return context.get_dummy_value()

    return signature, codegen


@kernel
def serve_loop(control: np.ndarray, seen: int, rounds: int, masks: np.ndarray, own_loop: bool,
               runners: np.ndarray) -> int:
    """Run the parts posted to this helper's ``control`` row until none came for ``rounds``
    rounds (returns the last sequence number) or the team stops (returns -1); each off its
    poster's core (`keep_off_poster`, ``masks``), unless another thread took it first
    (`take_part`: the poster takes a part over by running this loop for one round, its masks
    empty, ``own_loop`` false, `SpinTeam.wait`), by the runner ``runners`` holds for its kind.
    The helper's ``own_loop`` is flagged awake while it runs, asleep from the moment it returns
    (`flag_asleep`)."""
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
        _run(runners[control[KIND]], control)
        mark_done(control, seq)


def serve_parts(control: np.ndarray, seen: int, rounds: int, masks: np.ndarray, own_loop: bool) -> int:
    """`serve_loop` on `RUNNERS`: the serve loop a CPU backend's `SpinTeam` runs (called once a
    wake-up of a helper, or once a part a caller takes over)."""
    return serve_loop(control, seen, rounds, masks, own_loop, RUNNERS)


# -- the runners: one C function a kind, compiled when that kind is first handed to the team -------
# (Each a function of its own at module level, not one made by a factory: numba finds a compiled
# function in its disk cache by the defining file, name and line, and a closure made per kind
# would share one.)
@numba.njit(inline="always")
def _row(address: Any) -> np.ndarray:
    """The control row at ``address``."""
    return numba.carray(address, (ROW,))


def _run_few_rows(row: Any) -> None:
    few_rows_part(_row(row))


def _run_attention(row: Any) -> None:
    attention_part(_row(row))


def _run_conv(row: Any) -> None:
    conv_part(_row(row))


def _run_gemm(row: Any) -> None:
    gemm_part(_row(row))


def _run_winograd(row: Any) -> None:
    band_part(_row(row))


def _run_depthwise(row: Any) -> None:
    depthwise_part(_row(row))


def _run_expand_depthwise(row: Any) -> None:
    expand_depthwise_part(_row(row))


def _run_pointwise(row: Any) -> None:
    pointwise_part(_row(row))


def _run_small_map(row: Any) -> None:
    small_map_part(_row(row))


def _run_pool_rows_first(row: Any) -> None:
    pool_part(_row(row), pool2d)


def _run_pool_columns_first(row: Any) -> None:
    pool_part(_row(row), pool2d_columns_first)


def _run_pool_tiles(row: Any) -> None:
    pool_part(_row(row), tiles_range)


def _run_pool_flat(row: Any) -> None:
    pool_part(_row(row), flat_pool)


def _run_pool_three_by_two(row: Any) -> None:
    pool_part(_row(row), three_by_two_range)


def _run_pool_three_by_one_sum(row: Any) -> None:
    pool_part(_row(row), three_by_one_sum_range)


def _run_pool_three_by_one_mean(row: Any) -> None:
    pool_part(_row(row), three_by_one_mean_range)


def _run_pool_three_by_one_max(row: Any) -> None:
    pool_part(_row(row), three_by_one_max_range)


def _run_direct(row: Any) -> None:
    direct_part(_row(row))


def _run_sum(row: Any) -> None:
    add_part(_row(row))


def _run_affine(row: Any) -> None:
    affine_part(_row(row))


def _run_activate(row: Any) -> None:
    activate_part(_row(row))


def _run_direct_panels(row: Any) -> None:
    direct_panel_part(_row(row))


def _run_panel_gemm(row: Any) -> None:
    panel_gemm_part(_row(row))


def _run_products(row: Any) -> None:
    products_part(_row(row))


def _run_rows(row: Any) -> None:
    rows_part(_row(row))


def _run_squeeze_excite(row: Any) -> None:
    squeeze_excite_part(_row(row))


_RUNNER_SOURCES = {FEW_ROWS: _run_few_rows, ATTENTION: _run_attention, CONV: _run_conv, GEMM: _run_gemm,
                   WINOGRAD: _run_winograd, DEPTHWISE: _run_depthwise, EXPAND_DEPTHWISE: _run_expand_depthwise,
                   POINTWISE: _run_pointwise,
                   SMALL_MAP: _run_small_map, DIRECT: _run_direct, SUM: _run_sum,
                   AFFINE: _run_affine, ACTIVATE: _run_activate, DIRECT_PANELS: _run_direct_panels,
                   PANEL_GEMM: _run_panel_gemm, ATTENTION_PRODUCTS: _run_products, ROWS: _run_rows,
                   SQUEEZE_EXCITE: _run_squeeze_excite,
                   # a pool's kind is its loop's (`compiled.pool.LOOP_RANGES`): each compiles alone
                   FIRST_POOL + ROWS_FIRST: _run_pool_rows_first, FIRST_POOL + COLUMNS_FIRST: _run_pool_columns_first,
                   FIRST_POOL + TILES: _run_pool_tiles, FIRST_POOL + FLAT: _run_pool_flat,
                   FIRST_POOL + THREE_BY_TWO: _run_pool_three_by_two,
                   FIRST_POOL + THREE_BY_ONE_SUM: _run_pool_three_by_one_sum,
                   FIRST_POOL + THREE_BY_ONE_MEAN: _run_pool_three_by_one_mean,
                   FIRST_POOL + THREE_BY_ONE_MAX: _run_pool_three_by_one_max}
#: Each kind's runner address (0: not compiled yet), indexed by the kind.
RUNNERS = np.zeros(max(_RUNNER_SOURCES) + 1, np.int64)
_RUNNER_SIGNATURE = types.void(types.CPointer(types.int64))
_runners: dict[int, Any] = {}  # the compiled runners by kind (held: `RUNNERS` points into them)
_compiling = threading.Lock()


def prepare_part(kind: int) -> None:
    """Make the team's helpers able to run parts of ``kind`` (a `PART_KIND`): its runner compiled
    (or loaded from numba's cache) and its address in `RUNNERS`. Called before a part of that kind
    is posted (`SpinTeam.ready`); the first call for a kind takes its compilation."""
    if kind in _runners:
        return
    with _compiling:
        if kind not in _runners:
            runner = numba.cfunc(_RUNNER_SIGNATURE, cache=True, error_model="numpy")(_RUNNER_SOURCES[kind])
            RUNNERS[kind] = runner.address
            _runners[kind] = runner
