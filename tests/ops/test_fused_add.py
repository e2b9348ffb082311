"""`ops.fused_add`: ``Add`` and ``Sum`` of two float32 maps of one shape with the layer's fused
activation, in one compiled pass (`compiled.sums`), alone and shared with the spin team: the very
bits of NumPy's add followed by the standalone activation op, and the other cases left to NumPy."""
from __future__ import annotations

import numpy as np
import pytest

from asyncinfer.ops import fused_add as fused_add_module
from asyncinfer.ops.fused_add import TEAM_MIN_VALUES, fused_add

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
