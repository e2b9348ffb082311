"""The depthwise Conv kernels (asyncinfer/ops/conv_kernels.py on the compiled loops of
asyncinfer/ops/compiled/depthwise.py, and the flat-window fallback in conv.py) against onnx's
reference implementation, the definition.

Every 2-D case runs down each loop order, forced by patching the dispatch rule: ``rows`` (SIMD
along output rows), ``channels_last`` (SIMD over channels), ``stride2`` (the row loop on column
phases) and ``flat`` (padded planes, unit stride only: strided cases take the row loop there),
each also split into parts on a thread pool (``*_threads``), as large layers are. A spy checks the
loop really taken.
"""
from __future__ import annotations

import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from asyncinfer.concurrency import parallel
from asyncinfer.ops import conv as conv_module
from asyncinfer.ops import conv_kernels

from .op_testing import (EPILOGUE_ACTIVATIONS, assert_fused_activation_bits, make_op, randn, reference_run,
                         spin_team_bound)

# name: (x shape, channel multiplier, kernel, attrs)
DEPTHWISE_CASES = {
    "3x3": ((1, 6, 9, 9), 1, (3, 3), dict(pads=[1, 1, 1, 1])),
    "3x3_stride2": ((1, 6, 10, 10), 1, (3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "5x5_stride2_odd": ((1, 5, 11, 11), 1, (5, 5), dict(strides=[2, 2], pads=[2, 2, 2, 2])),
    "5x5": ((1, 4, 8, 8), 1, (5, 5), dict(pads=[2, 2, 2, 2])),
    "7x7_convnext": ((1, 4, 9, 9), 1, (7, 7), dict(pads=[3, 3, 3, 3])),
    "dilation2": ((1, 4, 12, 11), 1, (3, 3), dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    "dilation2_even_width": ((1, 4, 9, 12), 1, (3, 5), dict(dilations=[2, 2], pads=[2, 4, 2, 4])),
    "dilation_stride": ((1, 3, 13, 12), 1, (3, 3), dict(dilations=[2, 1], strides=[1, 2], pads=[2, 1, 2, 1])),
    "asym_pads_strides": ((1, 5, 11, 10), 1, (3, 3), dict(strides=[2, 1], pads=[0, 1, 2, 0])),
    "rect_kernel": ((1, 4, 9, 12), 1, (3, 5), dict(strides=[1, 2], pads=[1, 2, 1, 2])),
    "no_pads": ((1, 4, 8, 9), 1, (3, 3), {}),
    "same_upper": ((1, 4, 10, 9), 1, (4, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    "same_lower": ((1, 4, 10, 9), 1, (4, 3), dict(auto_pad="SAME_LOWER", strides=[2, 2])),
    "valid": ((1, 4, 10, 9), 1, (3, 3), dict(auto_pad="VALID", strides=[2, 1])),
    "multiplier2": ((1, 4, 8, 8), 2, (3, 3), dict(strides=[1, 2], pads=[1, 1, 1, 1])),
    "multiplier3_stride1": ((1, 3, 7, 7), 3, (5, 5), dict(pads=[2, 2, 2, 2])),
    "batch3": ((3, 5, 9, 8), 1, (3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "batch2_stride1": ((2, 6, 8, 8), 1, (5, 5), dict(pads=[2, 2, 2, 2])),
    "window_past_end": ((1, 4, 8, 8), 1, (3, 3), dict(strides=[3, 3], pads=[1, 1, 0, 0])),
    "narrow_2_columns": ((1, 3, 5, 2), 1, (3, 3), dict(pads=[1, 1, 1, 1])),
    "one_column": ((1, 3, 6, 1), 1, (3, 3), dict(pads=[1, 1, 1, 1])),
    "wide_pads": ((1, 2, 4, 5), 1, (3, 3), dict(pads=[2, 3, 2, 3], dilations=[1, 2])),
    # channels last: several vector groups, the last one partial; rows of several vector tiles
    "many_channels_wide": ((1, 37, 9, 35), 1, (3, 3), dict(strides=[1, 2], pads=[1, 1, 1, 1])),
    # channels last: a map large enough to go in blocks of 16 channels (the last one of 4)
    "channel_blocks": ((1, 20, 128, 128), 1, (3, 3), dict(pads=[1, 1, 1, 1])),
    # flat, in registers: strips of 32 columns and a partial one, blocks of 4 rows and a partial one
    "wide_5x5": ((1, 3, 22, 71), 1, (5, 5), dict(pads=[2, 2, 2, 2])),
    "wide_7x7_asym_pads": ((1, 2, 19, 37), 1, (7, 7), dict(pads=[1, 3, 5, 2])),
}
PATHS = ("rows", "channels_last", "rows_threads", "channels_last_threads", "stride2", "stride2_threads", "flat",
         "flat_threads", "registers", "registers_threads")
_LOOPS = ("depthwise_rows", "depthwise_channels_last", "depthwise_rows_stride2", "depthwise_flat")
_HELPERS = ThreadPoolExecutor(2, thread_name_prefix="test-conv-helpers")


def _route(monkeypatch, path: str) -> list:
    """Force ``path`` for every depthwise 2-D conv; return the list of loops the spies saw."""
    calls: list = []
    for name in _LOOPS:
        real = getattr(conv_kernels, name)

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(conv_kernels, name, spy)
    channels_last = path.startswith("channels_last")
    monkeypatch.setattr(conv_kernels, "known_window_pays", lambda mult, *a: channels_last and mult == 1)
    monkeypatch.setattr(conv_kernels, "channels_last_pays", lambda mult, *a: channels_last and mult == 1)
    stride2 = path.startswith("stride2")  # whatever the width: every stride-2, undilated layer
    monkeypatch.setattr(conv_kernels, "stride2_rows_pay", lambda sw, dw, *a: stride2 and sw == 2 and dw == 1)
    flat = path.startswith("flat")  # whatever the width: every unit-stride layer
    monkeypatch.setattr(conv_kernels, "flat_pays", lambda sh, sw, *a: flat and sh == sw == 1)
    # every square window of 3, 5 or 7 at equal strides of 1 or 2 (the flat paths' unit-stride
    # ones take the sums in registers too, inside `depthwise_flat`)
    registers = path.startswith("registers")
    monkeypatch.setattr(conv_kernels, "registers_pay", lambda *a: registers and _in_registers(*a))
    if path.endswith("threads"):  # three parts on a pool, whatever the size and the machine
        monkeypatch.setattr(conv_kernels, "threads_for", lambda macs: 3)
        monkeypatch.setattr(conv_module, "threads_for", lambda macs: 3)
        # as on a CPU backend's pool thread: kernels may split into 3 parts handed to helpers
        monkeypatch.setattr(parallel._local, "submit", _HELPERS.submit, raising=False)
        monkeypatch.setattr(parallel._local, "width", 3, raising=False)
    return calls


def _in_registers(kernel, strides, dilations, out_width=0) -> bool:
    """Whether `depthwise_flat` can sum a layer in registers (a square window of 3, 5 or 7 at equal
    strides of 1 or 2, unit dilation)."""
    return (kernel[0] == kernel[1] and kernel[0] in (3, 5, 7) and strides[0] == strides[1]
            and strides[0] in (1, 2) and tuple(dilations) == (1, 1))


def _expected_loop(path: str, mult: int, attrs: dict | None = None, kernel=(3, 3)) -> str:
    attrs = attrs or {}
    if path.startswith("registers") and _in_registers(kernel, attrs.get("strides") or [1, 1],
                                                      attrs.get("dilations") or [1, 1]):
        return "depthwise_flat"
    if path.startswith("flat") and (attrs.get("strides") or [1, 1]) == [1, 1]:
        return "depthwise_flat"
    if path.startswith("stride2") and (attrs.get("strides") or [1, 1])[-1] == 2 \
            and (attrs.get("dilations") or [1, 1])[-1] == 1 and "auto_pad" not in attrs:
        return "depthwise_rows_stride2"
    return "depthwise_channels_last" if path.startswith("channels_last") and mult == 1 else "depthwise_rows"


def _inputs(rng, shape, mult, kernel, dtype=np.float32, bias=True):
    c = shape[1]
    x = randn(rng, *shape, dtype=dtype)
    w = randn(rng, c * mult, 1, *kernel, dtype=dtype)
    b = randn(rng, c * mult, dtype=dtype) if bias else None
    return x, w, b


def _check(x, w, b, attrs, rtol, atol, reference_dtype=None):
    attrs = dict(attrs, group=x.shape[1], kernel_shape=list(w.shape[2:]))
    inputs = [x, w] + ([b] if b is not None else [])
    ref_inputs = inputs if reference_dtype is None else [a.astype(reference_dtype) for a in inputs]
    expected = reference_run("Conv", ref_inputs, attrs)[0]
    before = [a.copy() for a in inputs]
    got = make_op("Conv", attrs, n_inputs=len(inputs))(*inputs)[0]
    for a, a0 in zip(inputs, before):
        np.testing.assert_array_equal(a, a0, err_msg="an input was modified")
    assert got.dtype == x.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    assert got.flags.c_contiguous
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(DEPTHWISE_CASES))
def test_depthwise_paths_match_reference(name, path, rng, monkeypatch):
    calls = _route(monkeypatch, path)
    shape, mult, kernel, attrs = DEPTHWISE_CASES[name]
    x, w, b = _inputs(rng, shape, mult, kernel, bias=name != "no_pads")
    _check(x, w, b, attrs, rtol=1e-4, atol=1e-5)
    if "auto_pad" in attrs:  # SAME pads: the stride depends on the output size; any loop of the path
        assert calls and set(calls) <= {_expected_loop(path, mult), "depthwise_rows_stride2", "depthwise_rows"}
    else:
        assert calls and set(calls) == {_expected_loop(path, mult, attrs, kernel)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_depthwise_float16_and_float64(dtype, path, rng, monkeypatch):
    calls = _route(monkeypatch, path)
    x, w, b = _inputs(rng, (2, 5, 9, 9), 1, (3, 3), dtype=dtype)
    attrs = dict(strides=[2, 1], pads=[1, 1, 1, 1])
    if dtype == np.float16:  # float32 arithmetic, one rounding to float16 (as ORT)
        _check(x, w, b, attrs, rtol=2e-3, atol=2e-3, reference_dtype=np.float32)
    else:
        _check(x, w, b, attrs, rtol=1e-12, atol=1e-12)
    assert calls and set(calls) == {_expected_loop(path, 1, attrs)}


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_depthwise_flat_float16_and_float64(dtype, rng, monkeypatch):
    calls = _route(monkeypatch, "flat")
    x, w, b = _inputs(rng, (2, 5, 9, 9), 1, (5, 5), dtype=dtype)
    attrs = dict(pads=[2, 1, 2, 3])
    if dtype == np.float16:
        _check(x, w, b, attrs, rtol=2e-3, atol=2e-3, reference_dtype=np.float32)
    else:
        _check(x, w, b, attrs, rtol=1e-12, atol=1e-12)
    assert set(calls) == {"depthwise_flat"}


@pytest.mark.parametrize("kernel", [3, 5, 7])
def test_flat_in_registers_makes_nan_of_an_infinite_weight_times_the_padding(kernel, rng, monkeypatch):
    """A channel with an infinite tap takes the padded plane, whose zeros times that tap are NaN
    as ONNX defines them (the sums in registers read no padding); the other channels do not."""
    calls = _route(monkeypatch, "flat")
    x, w, b = _inputs(rng, (1, 3, 24, 24), 1, (kernel, kernel))
    w[1, 0, 0, 0] = np.inf
    attrs = dict(pads=[kernel // 2] * 4, group=3, kernel_shape=[kernel, kernel])
    got = make_op("Conv", attrs, n_inputs=3)(x, w, b)[0]
    want = reference_run("Conv", [x, w, b], attrs)[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 1, 0, 0]) and not np.isnan(got[0, [0, 2]]).any()
    finite = ~np.isnan(want) & ~np.isinf(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5)
    assert set(calls) == {"depthwise_flat"}


@pytest.mark.parametrize("stride", [1, 2])
def test_an_infinite_tap_keeps_a_padded_copy_by_default(stride, rng, monkeypatch):
    """A 3x3 layer that would be summed in registers, with an infinite tap, takes a loop that
    reads a zero-padded copy (NaN where that tap meets the padding, as ONNX defines it)."""
    calls = []
    for name in _LOOPS:
        real = getattr(conv_kernels, name)
        monkeypatch.setattr(conv_kernels, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    x, w, b = _inputs(rng, (1, 4, 48, 48), 1, (3, 3))
    w[2, 0, 0, 0] = -np.inf
    attrs = dict(strides=[stride, stride], pads=[1, 1, 1, 1], group=4, kernel_shape=[3, 3])
    got = make_op("Conv", attrs, n_inputs=3)(x, w, b)[0]
    want = reference_run("Conv", [x, w, b], attrs)[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 2, 0]).all() and calls and "depthwise_flat" not in calls


@pytest.mark.parametrize("name, shape, kernel, attrs", [
    ("1d", (2, 6, 20), (5,), dict(strides=[2], pads=[2, 1])),
    ("1d_dilated", (1, 4, 17), (3,), dict(dilations=[2], pads=[2, 2])),
    ("3d", (1, 4, 6, 7, 8), (3, 3, 3), dict(pads=[1, 0, 1, 1, 0, 1], strides=[2, 1, 2])),
    ("3d_batch2", (2, 3, 5, 5, 6), (3, 3, 3), dict(pads=[1] * 6)),
])
def test_depthwise_1d_and_3d_match_reference(name, shape, kernel, attrs, rng, monkeypatch):
    calls = _route(monkeypatch, "channels_last")
    x, w, b = _inputs(rng, shape, 1, kernel)
    _check(x, w, b, attrs, rtol=1e-4, atol=1e-5)
    # 1-D convs run as 2-D ones over a map one row high; the compiled loops are 2-D only
    assert bool(calls) == name.startswith("1d")


@pytest.mark.parametrize("kernel, stride", [(3, 1), (5, 1), (3, 2), (5, 2), (7, 1), (3, 3), (7, 2)])
def test_channels_last_rows_of_every_block_size(kernel, stride, rng, monkeypatch):
    """Rows of 1 to 17 outputs (blocks of 8, then one of each smaller size) through the
    channels-last loop, whose kernel rows of 3 or 5 taps at stride 1 or 2 (or 7 at 1) load each
    input once for all the taps reading it (`depthwise_block.KNOWN_WINDOWS`), others a load per tap."""
    calls = _route(monkeypatch, "channels_last")
    for wo in range(1, 18):
        width = (wo - 1) * stride + 1  # pads of kernel // 2 on either side: wo columns out
        x, w, b = _inputs(rng, (1, 17, 3, width), 1, (kernel, kernel))
        _check(x, w, b, dict(strides=[1, stride], pads=[kernel // 2] * 4), rtol=1e-5, atol=1e-5)
    assert set(calls) == {"depthwise_channels_last"}


@pytest.mark.parametrize("activation", sorted(EPILOGUE_ACTIVATIONS))
@pytest.mark.parametrize("path", ["rows", "channels_last", "stride2", "flat"])
@pytest.mark.parametrize("helpers", [0, 1, 2])
def test_fused_activation_gives_the_bits_of_the_standalone_op(activation, path, helpers, rng, monkeypatch):
    """Each loop's activation (the channels-last loop's on its sums before they go back to
    NCHW, the others' after their part is stored; alone and shared with the spinning team, by
    channels, and with 2 helpers for 40 channels by rows) equals the depthwise conv followed by
    the activation op, bit for bit."""
    calls = _route(monkeypatch, path)
    monkeypatch.setattr(conv_kernels, "TEAM_MIN_MACS", 0)
    shape, stride = ((1, 40, 9, 11), 1) if path in ("rows", "flat") else ((1, 40, 14, 12), 2)
    x, w, b = _inputs(rng, shape, 1, (3, 3))
    attrs = dict(strides=[stride, stride], pads=[1, 1, 1, 1], group=shape[1], kernel_shape=[3, 3])
    if helpers:  # (the parts run compiled, `depthwise_parts`: no loop is called from Python)
        with spin_team_bound(helpers) as runs:
            assert_fused_activation_bits(make_op("Conv", attrs, n_inputs=3), x, w, b, activation)
        assert runs.shared
    else:
        assert_fused_activation_bits(make_op("Conv", attrs, n_inputs=3), x, w, b, activation)
        assert set(calls) == {_expected_loop(path, 1, attrs)}


def test_depthwise_helpers_not_done_within_the_spin_are_waited_for_the_slow_way(rng, monkeypatch):
    """A compiled wait that gives up spinning at once (its rounds 0) leaves the caller to wait
    through `SpinTeam.wait_posted`: the same bits as the conv alone."""
    monkeypatch.setattr(conv_kernels, "TEAM_MIN_MACS", 0)
    x, w, b = _inputs(rng, (1, 40, 14, 12), 1, (3, 3))
    attrs = dict(strides=[1, 1], pads=[1, 1, 1, 1], group=40, kernel_shape=[3, 3])
    alone = make_op("Conv", attrs, n_inputs=3)(x, w, b)[0]
    monkeypatch.setattr(conv_kernels, "spin_team",  # (the team's own wait spins)
                        types.SimpleNamespace(WAIT_ROUNDS=0, PARTS_DONE=conv_kernels.spin_team.PARTS_DONE))
    with spin_team_bound(1) as runs:
        waited = []
        real = runs.team.wait_posted
        runs.team.wait_posted = lambda helpers: (waited.append(helpers), real(helpers))
        shared = make_op("Conv", attrs, n_inputs=3)(x, w, b)[0]
    assert runs.shared == 1 and waited == [1]
    np.testing.assert_array_equal(shared, alone)



def test_depthwise_helpers_found_asleep_are_woken_before_the_callers_part(rng, monkeypatch):
    """Where the posting finds a helper asleep, the compiled call returns before running the
    caller's part; the caller wakes the team, then runs its part and waits (`finish_depthwise`):
    the same bits as the conv alone."""
    from asyncinfer.concurrency.spin_team import HELPERS_ASLEEP
    from asyncinfer.ops.compiled.depthwise_parts import post_depthwise

    monkeypatch.setattr(conv_kernels, "TEAM_MIN_MACS", 0)
    x, w, b = _inputs(rng, (1, 40, 14, 12), 1, (3, 3))
    attrs = dict(strides=[1, 1], pads=[1, 1, 1, 1], group=40, kernel_shape=[3, 3])
    alone = make_op("Conv", attrs, n_inputs=3)(x, w, b)[0]
    posted = []

    def post_only(control, loop, x, taps, bias, out, parts, geometry, multiplier, block, scratch, own, act, numbers,
                  rounds):
        posted.append(post_depthwise(control, loop, x, taps, bias, out, parts, geometry, multiplier, block, scratch,
                                     act, numbers))
        return HELPERS_ASLEEP
    monkeypatch.setattr(conv_kernels, "post_and_finish_depthwise", post_only)
    with spin_team_bound(1) as runs:
        shared = make_op("Conv", attrs, n_inputs=3)(x, w, b)[0]
    assert runs.shared == 1 and len(posted) == 1 and runs.wakes == 1
    np.testing.assert_array_equal(shared, alone)

DISPATCH_CASES = [
    ((1, 32, 56, 56), 3, 1, 1, "depthwise_flat"),           # 3x3 from 20 columns: in registers, NCHW
    ((1, 16, 20, 20), 3, 1, 1, "depthwise_flat"),
    ((1, 64, 14, 14), 3, 1, 1, "depthwise_channels_last"),  # 3x3 under 20 columns: channels last
    ((1, 16, 40, 40), 4, 1, 1, "depthwise_flat"),           # other windows, unit stride: flat planes from
    ((1, 16, 20, 20), 9, 1, 1, "depthwise_flat"),           # 20 columns out
    ((1, 64, 14, 14), 5, 1, 1, "depthwise_channels_last"),  # 14 columns out: channels last
    ((1, 16, 56, 56), 7, 1, 1, "depthwise_channels_last"),  # ConvNeXt's 7x7: channels last
    ((1, 16, 56, 56), 9, 1, 1, "depthwise_flat"),           # larger kernels: flat
    ((1, 8, 28, 28), 3, 1, 2, "depthwise_flat"),            # channel multiplier
    ((1, 16, 56, 56), 5, 1, 1, "depthwise_channels_last"),  # 5x5: channels last, whatever the map
    ((1, 64, 7, 7), 5, 1, 1, "depthwise_channels_last"),    # 7 columns out: channels last
    ((1, 8, 14, 14), 17, 1, 1, "depthwise_channels_last"),  # window larger than the map: no padded plane
    ((1, 32, 28, 28), 3, 2, 1, "depthwise_flat"),            # 3x3/2 from 14 columns out: in registers
    ((1, 32, 24, 24), 3, 2, 1, "depthwise_channels_last"),  # 3x3/2, 12 columns out: channels last
    ((1, 32, 40, 40), 3, 2, 1, "depthwise_flat"),
    ((1, 16, 112, 112), 3, 2, 1, "depthwise_flat"),
    ((1, 16, 160, 160), 3, 2, 1, "depthwise_flat"),         # (80 columns: not the stride-2 row loop)
    ((1, 8, 160, 160), 5, 2, 1, "depthwise_channels_last"),  # strided 5x5
    ((1, 8, 40, 40), 3, 2, 2, "depthwise_flat"),            # channel multiplier, 20 columns out
    ((1, 8, 160, 160), 3, (1, 2), 1, "depthwise_rows_stride2"),  # unequal strides, 80 columns out
]


def _strides(stride: int | tuple[int, int]) -> list[int]:
    return list(stride) if isinstance(stride, tuple) else [stride, stride]


@pytest.mark.parametrize("shape, kernel, stride, mult, want", DISPATCH_CASES)
def test_dispatch_rule(shape, kernel, stride, mult, want, rng, monkeypatch):
    """The default rules (conv_kernels.registers_pay, flat_pays, stride2_rows_pay,
    channels_last_pays) on real-sized layers, checked against the reference."""
    calls: list = []
    for name in _LOOPS:
        real = getattr(conv_kernels, name)
        monkeypatch.setattr(conv_kernels, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    x, w, b = _inputs(rng, shape, mult, (kernel, kernel))
    _check(x, w, b, dict(strides=_strides(stride), pads=[kernel // 2] * 4), rtol=1e-4, atol=1e-4)
    assert set(calls) == {want}


@pytest.mark.parametrize("shape, kernel, stride, mult, want", DISPATCH_CASES)
@pytest.mark.parametrize("helpers", [1, 2])
def test_depthwise_shared_with_the_spin_team_has_the_bits_of_one_thread(shape, kernel, stride, mult, want, helpers,
                                                                        rng, monkeypatch):
    """Images or bands of channels (channels-last blocks whole) on this thread and the team's
    helpers (`compiled.depthwise_parts`): each loop computes every value as on one thread."""
    monkeypatch.setattr(conv_kernels, "TEAM_MIN_MACS", 0)
    x, w, b = _inputs(rng, shape, mult, (kernel, kernel))
    attrs = dict(strides=_strides(stride), pads=[kernel // 2] * 4, group=shape[1], kernel_shape=[kernel, kernel])
    conv = make_op("Conv", attrs, n_inputs=3)
    alone = conv(x, w, b)[0]
    with spin_team_bound(helpers) as runs:
        shared = conv(x, w, b)[0]
    # channels last keeps SIMD-wide blocks of 16 channels whole: 8 or 16 channels share bands of rows
    assert runs.shared == 1
    np.testing.assert_array_equal(shared, alone)
    np.testing.assert_allclose(shared, reference_run("Conv", [x, w, b], attrs)[0], rtol=1e-4, atol=1e-4)


# Ungrouped convs with and without bias, batches, strides, dilations, 1-D (all on the tiled GEMM).
DENSE_CASES = {
    "flat_3x3_batch3": ((3, 5, 9, 8), 6, (3, 3), dict(pads=[1, 1, 1, 1])),
    "flat_7x7_stride2_stem": ((2, 3, 19, 17), 8, (7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3])),
    "exact_3x3_stride2_batch2": ((2, 4, 11, 10), 6, (3, 3), dict(strides=[2, 2], pads=[1, 0, 1, 2])),
    "exact_patchify_4x4_s4": ((1, 3, 16, 12), 8, (4, 4), dict(strides=[4, 4])),
    "exact_same_lower_1d": ((2, 3, 15), 4, (3,), dict(strides=[2], auto_pad="SAME_LOWER")),
    "dilated_no_exact": ((1, 4, 12, 12), 5, (3, 3), dict(strides=[2, 2], dilations=[2, 2], pads=[2, 2, 2, 2])),
    "one_input_channel": ((2, 1, 9, 9), 4, (3, 3), dict(strides=[2, 1], pads=[1, 1, 1, 1])),  # cg == 1, group 1
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(DENSE_CASES))
def test_dense_conv_matches_reference(name, bias, rng):
    shape, m, kernel, attrs = DENSE_CASES[name]
    x = randn(rng, *shape)
    w = randn(rng, m, shape[1], *kernel)
    b = randn(rng, m) if bias else None
    attrs = dict(attrs, kernel_shape=list(kernel))
    inputs = [x, w] + ([b] if bias else [])
    expected = reference_run("Conv", inputs, attrs)[0]
    got = make_op("Conv", attrs, n_inputs=len(inputs))(*inputs)[0]
    assert got.shape == expected.shape and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_depthwise_is_thread_safe(rng):
    """The kernels reuse per-thread scratch buffers: concurrent calls must not see each other's."""
    from concurrent.futures import ThreadPoolExecutor

    op = make_op("Conv", dict(group=96, pads=[2, 2, 2, 2], kernel_shape=[5, 5]), n_inputs=2)
    xs = [randn(rng, 1, 96, 7 + i, 7 + i) for i in range(4)]
    w = randn(rng, 96, 1, 5, 5)
    expected = [op.run(x, w) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda k: op.run(xs[k % 4], w), range(64)))
    for k, y in enumerate(results):
        np.testing.assert_array_equal(y, expected[k % 4])


def test_scratch_keeps_a_view_per_shape_of_one_buffer_per_thread_and_slot():
    """Layers asking in turn for shapes of one slot get the same views again (no new NumPy
    objects a layer), all of one buffer; a larger shape grows the buffer; another thread or slot
    has its own."""
    scratch = conv_kernels.scratch
    a, b = scratch((3, 5), np.float32, "test_slot"), scratch((7,), np.float64, "test_slot")
    assert scratch((3, 5), np.float32, "test_slot") is a and scratch((7,), np.float64, "test_slot") is b
    assert a.shape == (3, 5) and a.dtype == np.float32 and b.shape == (7,) and b.dtype == np.float64
    assert np.shares_memory(a, b) and a.ctypes.data % 64 == 0  # (one buffer, from a cache line)
    assert not np.shares_memory(a, scratch((3, 5), np.float32, "other_slot"))
    with ThreadPoolExecutor(1) as pool:
        assert not np.shares_memory(a, pool.submit(scratch, (3, 5), np.float32, "test_slot").result())
    big = scratch((1 << 19,), np.float32, "test_slot")  # (2 MiB: past the first buffer's 1 MiB)
    assert big.shape == (1 << 19,) and not np.shares_memory(big, a)
    again = scratch((3, 5), np.float32, "test_slot")
    assert again is not a and np.shares_memory(again, big)  # (views of the new buffer from then on)
    for k in range(conv_kernels.SCRATCH_VIEWS + 1):  # (a slot keeps a bounded number of views)
        assert scratch((k + 1,), np.float32, "test_slot").shape == (k + 1,)
    assert np.shares_memory(scratch((1,), np.float32, "test_slot"), big)


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((1, 1, 640), (258, 1, 256), dict(strides=[128])),            # an STFT as a strided 1-D conv
    ((2, 2, 300), (5, 2, 80), dict(strides=[3], pads=[7, 2])),     # many taps, two channels, pads
    ((1, 1, 20, 20), (3, 1, 9, 9), dict(strides=[2, 2])),          # 81 taps in 2-D
])
def test_many_tap_kernels_take_the_tiled_gemm_and_match_the_reference(monkeypatch, x_shape, w_shape, attrs):
    from asyncinfer.ops import conv_direct

    monkeypatch.setattr(conv_direct, "PANEL_MIN_DEPTH", 1 << 40)  # (the 2-D one would take the direct panels)
    rng = np.random.default_rng(11)
    x, w = randn(rng, *x_shape), randn(rng, *w_shape)
    calls = []
    real = conv_module.conv2d_gemm
    monkeypatch.setattr(conv_module, "conv2d_gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    (got,) = make_op("Conv", attrs, version=11, n_inputs=2)(x, w)
    (want,) = reference_run("Conv", [x, w], attrs, opset=11)
    assert calls, "the tiled GEMM (exact im2col per block) was not taken"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape, kernel, strides, dilations, pads, out", [
    ((3, 9, 10), (3, 3), (2, 2), (1, 1), (1, 1), (5, 5)),
    ((2, 7, 8), (5, 3), (1, 3), (2, 1), (3, 0), (5, 2)),
    ((4, 5, 5), (4, 4), (4, 4), (1, 1), (0, 0), (1, 1)),
    ((1, 4, 6), (3, 3), (1, 1), (1, 1), (2, 2), (6, 8)),   # windows wholly in the padding
])
def test_compiled_im2col_matches_a_direct_loop(shape, kernel, strides, dilations, pads, out, rng):
    from asyncinfer.ops.compiled.im2col import im2col2d

    x = randn(rng, *shape)
    c, h, w = shape
    rows = c * kernel[0] * kernel[1]
    cols = np.full((rows + 1, out[0] * out[1]), 7.0, np.float32)  # the extra row must stay untouched
    im2col2d(x, cols, *kernel, out[1], *strides, *dilations, *pads, 0, out[0] * out[1])
    want = np.zeros((rows, out[0], out[1]), np.float32)
    for ci in range(c):
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                for oh in range(out[0]):
                    for ow in range(out[1]):
                        ih = oh * strides[0] + i * dilations[0] - pads[0]
                        iw = ow * strides[1] + j * dilations[1] - pads[1]
                        if 0 <= ih < h and 0 <= iw < w:
                            want[(ci * kernel[0] + i) * kernel[1] + j, oh, ow] = x[ci, ih, iw]
    np.testing.assert_array_equal(cols[:rows], want.reshape(rows, -1))
    assert (cols[rows] == 7.0).all()
    # any range of output positions alone, into the first columns of a block
    total = out[0] * out[1]
    for p0, p1 in [(0, 1), (1, total), (total // 3, total - total // 3), (total - 1, total)]:
        if p1 <= p0:
            continue
        block = np.full((rows + 1, p1 - p0 + 2), 7.0, np.float32)
        im2col2d(x, block, *kernel, out[1], *strides, *dilations, *pads, p0, p1)
        np.testing.assert_array_equal(block[:rows, :p1 - p0], want.reshape(rows, -1)[:, p0:p1])
        assert (block[:, p1 - p0:] == 7.0).all() and (block[rows] == 7.0).all()
