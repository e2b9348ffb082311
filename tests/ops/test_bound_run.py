"""`Op.bound_run`: what a job calls per layer. Shape ops whose other inputs are the model's
constants keep their plan per input shape (`shape.bound_by_shape`); element-wise binary ops skip
their per-run opset test. Each must give `run`'s result, fall back to `run` for operands other than
the bound constants, and fail with `run`'s own error."""
from __future__ import annotations

import numpy as np
import pytest

from asyncinfer import ops
from asyncinfer.errors import ExecutionError
from asyncinfer.model.ir import Layer


def bound_op(op_type: str, version: int, constants: list, **attrs) -> ops.Op:
    """An op whose inputs after the first are ``constants`` (None: left out), bound as the
    plan binds a model's constants."""
    names = ["x"] + ["" if c is None else f"c{i}" for i, c in enumerate(constants, start=1)]
    while names and names[-1] == "":
        names.pop()
    layer = Layer(name=f"{op_type.lower()}0", op_type=op_type, inputs=names, outputs=["y"], attrs=attrs,
                  version=version)
    op = ops.create(layer)
    op.bind_constants({i: c for i, c in enumerate(constants, start=1) if c is not None})
    return op


def i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


CASES = [
    ("Reshape", 14, [i64(0, -1, 2)], {}, [(3, 4, 2), (1, 6, 4)]),
    ("Reshape", 14, [i64(2, 0, 0)], {"allowzero": 1}, [(2, 0, 0)]),
    ("Flatten", 13, [], {"axis": -2}, [(2, 3, 4), (5, 1, 2, 2)]),
    ("Squeeze", 13, [i64(0, -1)], {}, [(1, 3, 1), (1, 5, 2, 1)]),
    ("Squeeze", 13, [None], {}, [(1, 3, 1)]),
    ("Unsqueeze", 13, [i64(0, -1)], {}, [(3,), (2, 5)]),
    ("Unsqueeze", 11, [], {"axes": [1]}, [(3, 4)]),
    ("Transpose", 13, [], {"perm": [2, 0, -2]}, [(2, 3, 4), (1, 5, 2)]),
    ("Transpose", 13, [], {}, [(2, 3, 4), (6,)]),
    ("Slice", 13, [i64(1, -3), i64(100, -1), i64(0, 2), i64(1, 2)], {}, [(4, 5, 6), (3, 2, 9)]),
    ("Slice", 13, [i64(-1), i64(-100), i64(1), i64(-2)], {}, [(2, 7), (3, 1)]),
    ("Slice", 13, [i64(0), i64(2), None, None], {}, [(5, 3)]),
    ("Pad", 19, [i64(1, 2, 0, 3)], {"mode": "reflect"}, [(4, 5), (3, 6)]),
    ("Pad", 19, [i64(2, -1), None, i64(-1)], {"mode": "edge"}, [(3, 4), (2, 2)]),
    ("Pad", 19, [i64(1, 1, 2, 0), np.array(7.5, np.float32)], {"mode": "constant"}, [(2, 3), (1, 1)]),
    ("Pad", 19, [i64(0, 3, 0, 3)], {"mode": "wrap"}, [(2, 2)]),  # wider than one wrap: numpy.pad
    ("Add", 14, [np.array([0.5, -1, 2], np.float32)], {}, [(2, 3), (3,)]),
]


@pytest.mark.parametrize("op_type, version, constants, attrs, shapes", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_bound_run_gives_runs_result(op_type, version, constants, attrs, shapes, rng):
    """The same values and shape as `run` for every input shape, twice each (the second from the
    kept plan), and for operands equal to the constants but not them (`run` then)."""
    op = bound_op(op_type, version, constants, **attrs)
    bound = op.bound_run()
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32)
        expected = op.run(x, *constants)
        for _ in range(2):
            (got,) = bound([x, *constants])
            assert got.shape == expected.shape and got.dtype == expected.dtype
            np.testing.assert_array_equal(got, expected)
        copies = [None if c is None else c.copy() for c in constants]
        np.testing.assert_array_equal(bound([x, *copies])[0], expected)


@pytest.mark.parametrize("op_type, version, constants, attrs, shape", [
    ("Reshape", 14, [i64(4, -1)], {}, (3, 3)),
    ("Squeeze", 13, [i64(1)], {}, (2, 3)),
    ("Unsqueeze", 13, [i64(5)], {}, (2,)),
    ("Transpose", 13, [], {"perm": [0, 0]}, (2, 2)),
    ("Slice", 13, [i64(0), i64(1), i64(3)], {}, (2, 2)),
    ("Pad", 19, [i64(0, 1)], {"mode": "reflect"}, (3, 0)),
])
def test_a_bound_run_fails_with_runs_own_error(op_type, version, constants, attrs, shape):
    """Operands that do not fit the data: the error `run` raises, naming the layer, never a raw
    NumPy one."""
    op = bound_op(op_type, version, constants, **attrs)
    bound = op.bound_run()
    x = np.zeros(shape, np.float32)
    with pytest.raises(ExecutionError) as from_run:
        op.run(x, *constants)
    with pytest.raises(ExecutionError) as from_bound:
        bound([x, *constants])
    assert str(from_bound.value) == str(from_run.value) and op.layer.name in str(from_bound.value)


@pytest.mark.parametrize("seq, batch, bias, states", [(1, 1, True, True), (2, 1, True, False), (5, 3, False, True),
                                                     (3, 2, False, False)])
def test_an_lstm_bound_to_its_weights_gives_runs_bits(seq, batch, bias, states, rng):
    """An LSTM whose weights are the model's constants runs their transposes worked out once:
    `run`'s outputs bit for bit (Y, Y_h, Y_c), the same for copies of the weights (`run` itself),
    and `run`'s own error for a state of the wrong size."""
    hidden, inputs = 8, 5

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    w, r, b = randn(1, 4 * hidden, inputs), randn(1, 4 * hidden, hidden), randn(1, 8 * hidden) if bias else None
    names = ["x", "w", "r", "b" if bias else "", "", "h" if states else "", "c" if states else ""]
    layer = Layer(name="lstm0", op_type="LSTM", inputs=names, outputs=["y", "y_h", "y_c"],
                  attrs={"hidden_size": hidden}, version=22)
    op = ops.create(layer)
    op.bind_constants({i: c for i, c in ((1, w), (2, r), (3, b)) if c is not None})
    bound = op.bound_run()
    x, h, c = randn(seq, batch, inputs), randn(1, batch, hidden), randn(1, batch, hidden)
    args = [x, w, r, b, None, h if states else None, c if states else None]
    expected = op.run(*args)
    for operands in (args, [x, w.copy(), r.copy(), None if b is None else b.copy(), *args[4:]]):
        got = bound(operands)
        assert len(got) == 3
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype
            np.testing.assert_array_equal(g, e)
    if states:  # states that do not fit the plain case: whatever `run` makes of them
        wrong = [x, w, r, b, None, randn(1, batch, hidden + 1), c]
        with pytest.raises(Exception) as from_run:  # (the engine names the layer: `kernel_error`)
            op.run(*wrong)
        with pytest.raises(Exception) as from_bound:
            bound(wrong)
        assert type(from_bound.value) is type(from_run.value) and str(from_bound.value) == str(from_run.value)


def _relu() -> tuple:
    """A fused Relu, as the plan hands a layer's activations to its kernel: (op, extra inputs)."""
    return ((ops.create(Layer(name="relu0", op_type="Relu", inputs=["y"], outputs=["z"], version=14)), ()),)


@pytest.mark.parametrize("x_shape, w_shape, pads", [
    ((1, 6, 9), (4, 6, 3), [1, 1]),            # a voice detector's 1-D conv
    ((1, 8, 5, 5), (16, 8, 1, 1), [0] * 4),    # a 1x1 conv
    ((2, 3, 12, 12), (8, 3, 3, 3), [1] * 4),   # a stem
])
def test_a_conv_bound_with_its_activation_gives_runs_bits(x_shape, w_shape, pads, rng):
    """A conv with a fused Relu, bound as a job calls it: `run`'s bits on the first call (the full
    way) and on later ones (the short way its first call kept); for another weight object, or
    another input shape, whatever `run` gives for them."""
    layer = Layer(name="conv0", op_type="Conv", inputs=["x", "w", "b"], outputs=["y"], attrs={"pads": pads},
                  version=11)
    op, activations = ops.create(layer), _relu()
    w, b = rng.standard_normal(w_shape).astype(np.float32), rng.standard_normal(w_shape[0]).astype(np.float32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    expected = np.maximum(ops.create(layer).run(x, w, b), 0)
    bound = op.bound_run(activations)
    for _ in range(3):
        (got,) = bound([x, w, b])
        assert got.shape == expected.shape and got.dtype == np.float32
        np.testing.assert_array_equal(got, expected)
    assert op._known is not None  # (the short way was taken)
    other = -w
    np.testing.assert_array_equal(bound([x, other, b])[0], np.maximum(ops.create(layer).run(x, other, b), 0))
    wider = rng.standard_normal(x_shape[:-1] + (x_shape[-1] + 2,)).astype(np.float32)
    np.testing.assert_array_equal(bound([wider, w, b])[0], np.maximum(ops.create(layer).run(wider, w, b), 0))


def test_an_add_bound_with_its_activation_gives_runs_bits(rng):
    """An Add with a fused Relu, bound as a job calls it: `run` with the activation."""
    op = bound_op("Add", 14, [np.float32(0.25) * np.arange(12, dtype=np.float32).reshape(3, 4)])
    activations = _relu()
    x = rng.standard_normal((3, 4)).astype(np.float32)
    expected = op.run(x, op.bound_constant(1), activations=activations)
    (got,) = op.bound_run(activations)([x, op.bound_constant(1)])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, np.maximum(x + op.bound_constant(1), 0))


@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "BitwiseAnd", "Max"])
def test_a_binary_entry_of_one_ufunc_is_called_as_that_ufunc(op_type):
    """An entry whose ``fn`` is one ufunc call names it (the CPU op calls NumPy's straight), and
    gives that ufunc's result through its ``fn`` too (the device backends' way)."""
    from asyncinfer.ops.pointwise import BINARY_OPS

    fn = BINARY_OPS[op_type].fn
    a, b = np.array([6, 3, -2], np.int32), np.array([5, 1, 4], np.int32)
    ufunc = getattr(np, fn.ufunc)
    assert isinstance(ufunc, np.ufunc)
    np.testing.assert_array_equal(fn(np, a, b), ufunc(a, b))
