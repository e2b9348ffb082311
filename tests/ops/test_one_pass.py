"""`ops.fused_add`: ``Add`` and ``Sum`` of two float32 maps of one shape with the layer's fused
activation, in one compiled pass (`compiled.sums`), alone and shared with the spin team: the very
bits of NumPy's add followed by the standalone activation op, and the other cases left to NumPy."""
from __future__ import annotations

import types

import numpy as np
import pytest

from asyncinfer.ops import one_pass as fused_add_module
from asyncinfer.ops.one_pass import TEAM_MIN_VALUES, fused_add

from .op_testing import EPILOGUE_ACTIVATIONS, activation_op, make_op, reference_run, spin_team_bound


def _strewn(rng, shape, scale=3.0):
    """Random float32 values with NaN, ±inf and -0.0 strewn in."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    x.flat[::17] = np.nan
    x.flat[5::29] = np.inf
    x.flat[7::31] = -np.inf
    x.flat[3::23] = -0.0
    return x


def _separately(op_type, a, b, activation):
    act, extras = activation_op(activation)
    return act(make_op(op_type, n_inputs=2)(a, b)[0], *extras)[0]


@pytest.mark.parametrize("activation", sorted(EPILOGUE_ACTIVATIONS))
@pytest.mark.parametrize("op_type", ["Add", "Sum"])
def test_the_fused_activation_gives_the_bits_of_the_standalone_op(op_type, activation, rng):
    a, b = _strewn(rng, (2, 5, 7, 9)), _strewn(rng, (2, 5, 7, 9))
    act, extras = activation_op(activation)
    with np.errstate(all="ignore"):
        fused = make_op(op_type, n_inputs=2)(a, b, activations=[(act, extras)])[0]
        separate = _separately(op_type, a, b, activation)
    assert fused.dtype == np.float32 and fused.shape == a.shape
    np.testing.assert_array_equal(fused, separate)
    np.testing.assert_array_equal(np.signbit(fused), np.signbit(separate))


def test_helpers_not_done_within_the_compiled_spin_are_waited_for_the_slow_way(rng, monkeypatch):
    """`finish_add` giving up at once (no spin rounds) leaves the caller to wait through
    `SpinTeam.wait_posted`: the same bits as the sum alone."""
    a, b = _strewn(rng, (TEAM_MIN_VALUES * 2,)), _strewn(rng, (TEAM_MIN_VALUES * 2,))
    act, extras = activation_op("Relu")
    alone = fused_add(a, b, [(act, extras)])
    # (the compiled wait's rounds only: the team's own wait spins)
    monkeypatch.setattr(fused_add_module, "spin_team",
                        types.SimpleNamespace(WAIT_ROUNDS=0, range_cuts=fused_add_module.spin_team.range_cuts))
    with spin_team_bound(1) as runs:
        waited = []
        real = runs.team.wait_posted
        runs.team.wait_posted = lambda helpers: (waited.append(helpers), real(helpers))
        shared = fused_add(a, b, [(act, extras)])
    assert runs.shared == 1 and waited == [1]
    np.testing.assert_array_equal(shared, alone)


@pytest.mark.parametrize("op_type", ["Add", "Sum"])
def test_the_sum_with_relu_matches_the_onnx_reference(op_type, rng):
    a, b = rng.standard_normal((1, 8, 6, 6)).astype(np.float32), rng.standard_normal((1, 8, 6, 6)).astype(np.float32)
    act, extras = activation_op("Relu")
    got = make_op(op_type, n_inputs=2)(a, b, activations=[(act, extras)])[0]
    expected = reference_run("Relu", [reference_run(op_type, [a, b])[0]])[0]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("size", [TEAM_MIN_VALUES, TEAM_MIN_VALUES * 3 + 7])
@pytest.mark.parametrize("helpers", [1, 2])
def test_shared_with_the_spin_team_gives_the_same_bits(size, helpers, rng):
    """Large sums go to the team in ranges of the flat arrays (a plain sum too): the same bits
    as one thread, whatever the cuts."""
    a, b = _strewn(rng, (size,)), _strewn(rng, (size,))
    act, extras = activation_op("Relu")
    with np.errstate(all="ignore"):
        alone = fused_add(a, b, [(act, extras)])
        with spin_team_bound(helpers) as runs:
            shared = fused_add(a, b, [(act, extras)])
            plain = fused_add(a, b, ())
            with runs.busy():
                busy = fused_add(a, b, [(act, extras)])
    assert runs.shared == 2
    np.testing.assert_array_equal(shared, alone)
    np.testing.assert_array_equal(busy, alone)
    np.testing.assert_array_equal(plain, np.add(a, b))


@pytest.mark.parametrize("activation", ["Relu", "LeakyRelu", None])
@pytest.mark.parametrize("helpers", [0, 1])
def test_a_sum_into_its_first_operand_gives_the_bits_of_a_fresh_one(activation, helpers, rng):
    """``into=a`` (a conv's result taking its residual in place: `ops/residual_conv.py`): the
    same bits as into a fresh array, alone and shared with the team, any size (a plain sum into
    its operand takes the compiled pass even when small)."""
    activations = [activation_op(activation)] if activation else []
    for size in (37, TEAM_MIN_VALUES * 2 + 5):
        a, b = _strewn(rng, (3, size)), _strewn(rng, (3, size))
        with np.errstate(all="ignore"):
            fresh = fused_add(a, b, activations) if activations else np.add(a, b)
            if helpers:
                with spin_team_bound(helpers):
                    got = fused_add(a, b, activations, into=a)
            else:
                got = fused_add(a, b, activations, into=a)
        assert got is a
        np.testing.assert_array_equal(a.view(np.uint32), fresh.view(np.uint32))


def test_other_cases_are_left_to_numpy(rng):
    """Broadcasting, other dtypes, views out of order, chains the epilogue cannot do and small
    plain sums: None (the op's NumPy way, then the activations)."""
    a = rng.standard_normal((4, 6)).astype(np.float32)
    relu = [activation_op("Relu")]
    assert fused_add(a, a[:1], relu) is None
    assert fused_add(a.astype(np.float64), a.astype(np.float64), relu) is None
    assert fused_add(a.T, a.T, relu) is None
    assert fused_add(a, a, relu * 2) is None
    assert fused_add(a, a, ()) is None
    assert fused_add(a[:0], a[:0], relu) is None
    assert fused_add(a, a, relu) is not None


@pytest.mark.parametrize("op_type", ["Add", "Sum"])
def test_the_ops_still_apply_activations_numpy_computes(op_type, rng, monkeypatch):
    """Where the compiled pass does not apply (broadcasting, a chain of two activations), the op
    applies its activations itself after NumPy's add."""
    a, b = rng.standard_normal((3, 4, 5)).astype(np.float32), rng.standard_normal((4, 5)).astype(np.float32)
    relu, clip = activation_op("Relu"), activation_op("Clip")
    op = make_op(op_type, n_inputs=2)
    got = op(a, b, activations=[relu, clip])[0]
    expected = clip[0](relu[0](np.add(a, b))[0], *clip[1])[0]
    np.testing.assert_array_equal(got, expected)
    monkeypatch.setattr(fused_add_module, "TEAM_MIN_VALUES", 1)  # (no team here: NumPy all the same)
    np.testing.assert_array_equal(op(a, a)[0], np.add(a, a))


def test_sum_of_three_and_old_add_take_numpy(rng):
    a = rng.standard_normal((2, 3)).astype(np.float32)
    relu = activation_op("Relu")
    np.testing.assert_array_equal(make_op("Sum", n_inputs=3)(a, a, -a, activations=[relu])[0],
                                  np.maximum(a + a - a, 0))
    old_add = make_op("Add", {"broadcast": 1, "axis": 1}, version=6, n_inputs=2)
    bias = np.array([1.0, -1.0, 0.5], np.float32)
    np.testing.assert_array_equal(old_add(a, bias, activations=[relu])[0], np.maximum(a + bias, 0))


# -- BatchNormalization: act(x · scale[c] + shift[c]) -------------------------------------------------
def _bn_operands(rng, shape):
    c = shape[1]
    stats = [rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32),
             rng.standard_normal(c).astype(np.float32), (rng.random(c) + 0.5).astype(np.float32)]
    return _strewn(rng, shape), stats


@pytest.mark.parametrize("activation", sorted(EPILOGUE_ACTIVATIONS))
def test_batch_norm_with_its_activation_gives_the_bits_of_the_two_ops(activation, rng):
    x, stats = _bn_operands(rng, (2, 5, 6, 7))
    bn = make_op("BatchNormalization", {"epsilon": 1e-3}, version=15, n_inputs=5)
    act, extras = activation_op(activation)
    with np.errstate(all="ignore"):
        fused = bn(x, *stats, activations=[(act, extras)])[0]
        separate = act(bn(x, *stats)[0], *extras)[0]
    np.testing.assert_array_equal(fused, separate)
    np.testing.assert_array_equal(np.signbit(fused), np.signbit(separate))


@pytest.mark.parametrize("shape", [(1, 4, 5, 5), (2, 3, 17), (3, 2)])
def test_batch_norm_with_relu_matches_the_onnx_reference(shape, rng):
    """A map (compiled pass), a 1-D map and a (N, C) input (NumPy's broadcast)."""
    x = rng.standard_normal(shape).astype(np.float32)
    _, stats = _bn_operands(rng, shape)
    bn = make_op("BatchNormalization", {"epsilon": 1e-3}, version=15, n_inputs=5)
    got = bn(x, *stats, activations=[activation_op("Relu")])[0]
    expected = reference_run("Relu", [reference_run("BatchNormalization", [x, *stats], {"epsilon": 1e-3},
                                                    opset=15)[0]])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("helpers", [1, 2])
def test_batch_norm_shared_with_the_spin_team_gives_the_same_bits(helpers, rng):
    x, stats = _bn_operands(rng, (1, 7, 96, 100))  # (over TEAM_MIN_VALUES; planes in parts of 2-4)
    bn = make_op("BatchNormalization", {"epsilon": 1e-5}, version=15, n_inputs=5)
    relu = [activation_op("Relu")]
    with np.errstate(all="ignore"):
        alone = bn(x, *stats, activations=relu)[0]
        with spin_team_bound(helpers) as runs:
            shared = bn(x, *stats, activations=relu)[0]
    assert runs.shared == 1
    np.testing.assert_array_equal(shared, alone)


@pytest.mark.parametrize("helpers", [0, 1, 2])
def test_a_scale_per_image_and_channel_gives_numpys_product(helpers, rng):
    """A squeeze-and-excitation gate (`ops.fused.SqueezeExcite`): ``x · scale[i, c] + -0.0`` is
    NumPy's ``x · scale[i, c]``, -0.0, NaN and infinities included, alone and on the team."""
    from asyncinfer.ops.one_pass import fused_affine

    x = _strewn(rng, (3, 5, 70, 80))  # (over TEAM_MIN_VALUES: planes in parts)
    gate = _strewn(rng, (3, 5))
    gate[0, :2] = -0.0
    expected = np.multiply(x, gate.reshape(3, 5, 1, 1))
    scale = gate.reshape(-1)
    with np.errstate(all="ignore"):
        if helpers:
            with spin_team_bound(helpers) as runs:
                got = fused_affine(x, scale, np.full_like(scale, -0.0), ())
            assert runs.shared == 1
        else:
            got = fused_affine(x, scale, np.full_like(scale, -0.0), ())
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert fused_affine(x, scale[:-1], np.full_like(scale[:-1], -0.0), ()) is None  # neither C nor N·C values


def test_batch_norm_outside_the_compiled_pass_is_unchanged(rng):
    """float64 maps, views out of order and planes under MIN_PLANE take NumPy's way, then the
    activations; the training mode applies them to its first output only."""
    from asyncinfer.ops.one_pass import MIN_PLANE, fused_affine

    x, stats = _bn_operands(rng, (1, 3, 4, 4))
    relu = [activation_op("Relu")]
    assert fused_affine(x, *stats[:2], relu) is not None
    assert fused_affine(x.astype(np.float64), *stats[:2], relu) is None
    assert fused_affine(x.transpose(0, 1, 3, 2), *stats[:2], relu) is None
    assert fused_affine(x[:, :, :1, :MIN_PLANE - 1], *stats[:2], relu) is None
    bn = make_op("BatchNormalization", {"epsilon": 1e-3}, version=15, n_inputs=5)
    x64 = x.astype(np.float64)
    stats64 = [s.astype(np.float64) for s in stats]
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(bn(x64, *stats64, activations=relu)[0],
                                      np.maximum(bn(x64, *stats64)[0], 0))
    training = make_op("BatchNormalization", {"epsilon": 1e-3, "training_mode": 1}, version=15, n_inputs=5,
                       n_outputs=3)
    y = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    fused = training(y, *stats, activations=relu)
    plain = training(y, *stats)
    np.testing.assert_array_equal(fused[0], np.maximum(plain[0], 0))
    for got, want in zip(fused[1:], plain[1:]):
        np.testing.assert_array_equal(got, want)


# -- standalone activations: act(x) -------------------------------------------------------------------
UNARY_ACTIVATIONS = sorted(name for name in EPILOGUE_ACTIVATIONS if not name.startswith("Clip"))


def _numpy_way(op, x):
    """The op's NumPy form (what it ran before the compiled pass): its in-place function on a
    copy, or its function."""
    if op.spec.inplace is None:
        return op.spec.fn(np, x, **op.values)
    return op.spec.inplace(np, np.array(x, copy=True), **op.values)


@pytest.mark.parametrize("activation", UNARY_ACTIVATIONS)
def test_a_standalone_activation_gives_the_bits_of_its_numpy_form(activation, rng):
    x = _strewn(rng, (3, 4, 11, 13))
    op, _ = activation_op(activation)
    with np.errstate(all="ignore"):
        got = op(x)[0]
        expected = _numpy_way(op, x)
    assert got.dtype == np.float32 and got.shape == x.shape and not np.shares_memory(got, x)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))


@pytest.mark.parametrize("helpers", [1, 2])
def test_a_standalone_activation_shared_with_the_spin_team_gives_the_same_bits(helpers, rng):
    x = _strewn(rng, (TEAM_MIN_VALUES * 2 + 5,))
    op, _ = activation_op("HardSwish")
    with np.errstate(all="ignore"):
        alone = op(x)[0]
        with spin_team_bound(helpers) as runs:
            shared = op(x)[0]
    assert runs.shared == 1
    np.testing.assert_array_equal(shared, alone)


@pytest.mark.parametrize("helpers", [0, 1])
def test_an_activation_in_place_gives_the_bits_of_a_fresh_one(helpers, rng):
    """``in_place`` (a fused activation on a fresh result without an epilogue of its own): the
    same bits as into a fresh array, alone and shared with the team."""
    from asyncinfer.ops.epilogue import Epilogue
    for activation in ("Relu", "LeakyRelu", "HardSwish"):
        epilogue = Epilogue.of([activation_op(activation)], np.dtype(np.float32))
        x = _strewn(rng, (TEAM_MIN_VALUES * 2 + 3,))
        with np.errstate(all="ignore"):
            fresh = fused_add_module.activated(x, epilogue)
            if helpers:
                with spin_team_bound(helpers):
                    got = fused_add_module.activated(x, epilogue, in_place=True)
            else:
                got = fused_add_module.activated(x, epilogue, in_place=True)
        assert got is x
        np.testing.assert_array_equal(x.view(np.uint32), fresh.view(np.uint32))


def test_standalone_activations_outside_the_compiled_pass(rng):
    """float64 and views out of order keep NumPy's way."""
    from asyncinfer.ops.one_pass import activated

    x = rng.standard_normal((5, 6)).astype(np.float32)
    relu = activation_op("Relu")
    epilogue = relu[0].epilogue
    assert epilogue is not None and activated(x, epilogue) is not None
    assert activated(x.astype(np.float64), epilogue) is None
    assert activated(x.T, epilogue) is None
    assert activated(x, None) is None
    assert make_op("Elu").epilogue is None  # (an activation the epilogue lacks: NumPy's way)
    np.testing.assert_array_equal(relu[0](x.T)[0], np.maximum(x.T, 0))
    np.testing.assert_array_equal(relu[0](x.astype(np.float64))[0], np.maximum(x.astype(np.float64), 0))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("helpers", [0, 1, 2])
def test_gelu_in_place_gives_the_bits_of_its_compiled_loop(approximate, helpers, rng):
    """Gelu on a fresh result (a product's fused ``Add+Gelu``: `run_inplace`) takes the one-pass
    activation's Gelu codes, alone and shared with the spin team: the bits of
    `compiled.activations.gelu` (those of the NumPy form, `test_compiled_activations`)."""
    from asyncinfer.ops.compiled import activations

    x = _strewn(rng, (TEAM_MIN_VALUES * 2 + 7,))
    want = x.copy()
    with np.errstate(all="ignore"):
        (activations.gelu_tanh if approximate == "tanh" else activations.gelu)(want)
        op = make_op("Gelu", {"approximate": approximate})
        got = x.copy()
        if helpers:
            with spin_team_bound(helpers) as runs:
                out = op.run_inplace(got)
            assert runs.shared == 1
        else:
            out = op.run_inplace(got)
    assert out is got
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
