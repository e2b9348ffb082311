"""The ops the loader's fusions create (asyncinfer/ops/fused.py): MaskedAttention against the
composition of the ONNX ops it replaces, on its compiled path (float32, 4-D: a decode step's
shapes, with the KV cache a view of its arena) and on its general one."""
from __future__ import annotations

import numpy as np
import pytest

import asyncinfer.ops as ops
from asyncinfer.model.ir import Layer
from asyncinfer.ops.fused import FUSED_DOMAIN

RNG = np.random.default_rng(11)
FILL = np.float32(np.finfo(np.float32).min)


def _op(divides: bool = True):
    layer = Layer(name="attention", op_type="MaskedAttention", domain=FUSED_DOMAIN, version=1,
                  inputs=["q", "k", "v", "scale", "keep", "fill", "bias"], outputs=["y"],
                  attrs={"scale_divides": int(divides)})
    return ops.create(layer)


def _definition(q, k, v, scale, divides, keep, bias):
    """The unfused layers in float64: MatMul, Div (or Mul), Where, Add, Softmax, MatMul."""
    s = np.matmul(q.astype(np.float64), np.swapaxes(k, -1, -2).astype(np.float64))
    s = s / scale if divides else s * scale
    if keep is not None:
        s = np.where(keep, s, np.float64(FILL))
    if bias is not None:
        s = s + bias
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)


def _masks(batch, queries, keys):
    keep = np.tril(np.ones((queries, keys), bool), k=keys - queries)[None, None]
    bias = np.where(RNG.random((batch, 1, 1, keys)) < 0.3, FILL, 0).astype(np.float32)
    bias[..., -1] = 0
    return keep, bias


@pytest.mark.parametrize("batch,heads,kv_heads,queries,keys", [(1, 12, 12, 1, 40), (3, 4, 4, 5, 9), (2, 6, 1, 2, 17)])
@pytest.mark.parametrize("divides", [True, False])
def test_compiled_path_matches_the_definition_on_a_cache_view(batch, heads, kv_heads, queries, keys, divides):
    depth = 16
    arena = RNG.standard_normal((batch, kv_heads, keys + 32, depth)).astype(np.float32)
    k = arena[:, :, :keys]  # as the cache arrives: a view of the arena it grows in
    v = RNG.standard_normal((batch, kv_heads, keys, depth)).astype(np.float32)
    q = RNG.standard_normal((batch, heads, queries, depth)).astype(np.float32)
    keep, bias = _masks(batch, queries, keys)
    scale = np.float32(4.0 if divides else 0.25)
    op = _op(divides)
    assert op._compiled(q, k, v, scale, keep, FILL, bias) is not None  # the path under test
    got = op.run(q, k, v, scale, keep, FILL, bias)
    np.testing.assert_allclose(got, _definition(q, k, v, scale, divides, keep, bias), rtol=1e-5, atol=1e-5)


def test_a_row_has_the_same_result_alone_as_in_a_batch():
    """A stream's attention must not depend on who shares its decode step."""
    q = RNG.standard_normal((4, 3, 1, 8)).astype(np.float32)
    k = RNG.standard_normal((4, 3, 10, 8)).astype(np.float32)
    v = RNG.standard_normal((4, 3, 10, 8)).astype(np.float32)
    _, bias = _masks(4, 1, 10)
    op = _op()
    together = op.run(q, k, v, np.float32(2.0), None, None, bias)
    for r in range(4):
        alone = op.run(q[r:r + 1], k[r:r + 1], v[r:r + 1], np.float32(2.0), None, None, bias[r:r + 1])
        np.testing.assert_array_equal(alone, together[r:r + 1])


@pytest.mark.parametrize("helpers", [1, 3])
@pytest.mark.parametrize("batch,heads,kv_heads,queries", [(8, 12, 12, 1), (2, 8, 2, 3), (1, 2, 1, 1)])
def test_heads_shared_with_the_spin_team_have_the_bits_of_one_thread(batch, heads, kv_heads, queries, helpers,
                                                                       monkeypatch):
    """With the CPU backend's spinning helpers bound (as on its pool threads), an attention large
    enough is cut into bands of heads, one per thread: every value must equal the one-thread
    result bit for bit (a view of the cache arena, grouped K/V heads, both masks), and a team
    another caller holds leaves the whole attention on this thread."""
    from asyncinfer.concurrency.spin_team import SpinTeam
    from asyncinfer.ops import fused
    from asyncinfer.ops.compiled.team_parts import prepare_part, serve_parts

    keys, depth = 70, 64
    arena = RNG.standard_normal((batch, kv_heads, keys + 32, depth)).astype(np.float32)
    k, v = arena[:, :, :keys], arena[:, :, 5:keys + 5] * 0.5  # views with the arena's strides
    q = RNG.standard_normal((batch, heads, queries, depth)).astype(np.float32)
    keep, bias = _masks(batch, queries, keys)
    op = _op()
    group = heads // kv_heads  # query heads per K/V head, as `run` finds them in a head repeat

    def attend() -> np.ndarray:
        return op._compiled(q, k, v, np.float32(8.0), keep, FILL, bias, group)

    alone = attend()  # no team bound: one thread
    monkeypatch.setattr(fused, "ATTENTION_SPLIT_MIN_MACS", 0)
    team = SpinTeam(helpers, serve_parts, prepare_part, name="test-team")
    split: list[int] = []
    heads_on_team = fused._heads_on_team
    monkeypatch.setattr(fused, "_heads_on_team", lambda *args: split.append(1) or heads_on_team(*args))
    _shared_and_held_alike(attend, alone, team, monkeypatch)
    assert len(split) == 2
    k_full, v_full = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    np.testing.assert_allclose(alone, _definition(q, k_full, v_full, np.float32(8.0), True, keep, bias),
                               rtol=1e-5, atol=1e-5)


@pytest.fixture(params=["blas", "panels"])
def products(request, monkeypatch):
    """The two products a head in BLAS and on the panel GEMM (`fused.PANEL_PRODUCTS`: the panels
    where the CPU has AVX-512, BLAS elsewhere; both run on any CPU)."""
    from asyncinfer.ops import fused
    monkeypatch.setattr(fused, "PANEL_PRODUCTS", request.param == "panels")
    return request.param


def _requires_blas_call():
    from asyncinfer.ops.compiled import blas_call
    if not blas_call.available():
        pytest.skip("NumPy's BLAS exports no cblas_sgemm asyncinfer can call: many query rows take the general path")


@pytest.mark.parametrize("batch,heads,kv_heads,queries,keys", [(1, 2, 2, 128, 128), (2, 4, 2, 9, 40), (1, 3, 1, 40, 1)])
@pytest.mark.parametrize("masks", ["both", "bias", "none"])
def test_many_query_rows_take_two_products_per_head_and_match_the_definition(batch, heads, kv_heads, queries, keys,
                                                                               masks, products, monkeypatch):
    """More than `FEW_QUERY_ROWS` query rows (an encoder, a prefill) run as BLAS products a head
    with the masking and softmax between them. Q, K and V heads of one count are read in place
    from ``(B, S, H, D)`` tensors through the op's perms, the result made in the merged heads'
    layout; grouped K/V heads come as a head repeat's inputs, shared, never copied."""
    from asyncinfer.ops import fused
    _requires_blas_call()
    depth, group = 16, heads // kv_heads
    perms = {"q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3], "out_perm": [0, 2, 1, 3]}
    names = ["q", "k", "v", "scale", "keep", "fill", "bias"] + (["ke", "ks", "ve", "vs"] if group > 1 else [])
    layer = Layer(name="attention", op_type="MaskedAttention", domain=FUSED_DOMAIN, version=1, inputs=names,
                  outputs=["y"], attrs={"scale_divides": 1} | ({} if group > 1 else perms))
    q = RNG.standard_normal((batch, heads, queries, depth)).astype(np.float32)
    k, v = (RNG.standard_normal((batch, kv_heads, keys, depth)).astype(np.float32) for _ in range(2))
    keep, bias = _masks(batch, queries, keys)
    keep, bias = (keep if masks == "both" else None), (None if masks == "none" else bias)
    repeats = []
    if group > 1:
        repeats = [np.array([batch, kv_heads, group, keys, depth]), np.array([batch, heads, keys, depth])] * 2
        feeds = (q, k, v)
    else:
        feeds = tuple(x.transpose(0, 2, 1, 3).copy() for x in (q, k, v))  # (B, S, H, D), as projected
    calls: list[int] = []
    run_products = fused.products_from
    monkeypatch.setattr(fused, "products_from", lambda *args: calls.append(1) or run_products(*args))
    got = ops.create(layer).run(*feeds, np.float32(4.0), keep, None if keep is None else FILL, bias, *repeats)
    assert calls, "the two-product path did not run"
    expected = _definition(q, np.repeat(k, group, axis=1), np.repeat(v, group, axis=1), np.float32(4.0), True, keep,
                           bias)
    if group == 1:
        assert got.shape == (batch, queries, heads, depth) and got.flags.c_contiguous  # (the merge's Reshape: a view)
        expected = expected.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("helpers", [1, 3])
def test_two_product_heads_shared_with_the_spin_team_have_the_bits_of_one_thread(helpers, products, monkeypatch):
    """Bands of heads on the spinning helpers give the one-thread result bit for bit, and a team
    another caller holds leaves every head on this thread."""
    from asyncinfer.concurrency.spin_team import SpinTeam
    from asyncinfer.ops.compiled.team_parts import prepare_part, serve_parts
    _requires_blas_call()
    q = RNG.standard_normal((2, 6, 33, 32)).astype(np.float32)
    k, v = (RNG.standard_normal((2, 6, 50, 32)).astype(np.float32) for _ in range(2))
    keep, bias = _masks(2, 33, 50)
    op = _op()

    def attend() -> np.ndarray:
        return op.run(q, k, v, np.float32(8.0), keep, FILL, bias)

    alone = attend()
    _shared_and_held_alike(attend, alone, SpinTeam(helpers, serve_parts, prepare_part, name="test-team"), monkeypatch)
    np.testing.assert_allclose(alone, _definition(q, k, v, np.float32(8.0), True, keep, bias), rtol=1e-5, atol=1e-5)


def test_without_a_callable_blas_many_query_rows_keep_a_compiled_pass_per_row(monkeypatch):
    from asyncinfer.ops.compiled import blas_call
    q = RNG.standard_normal((1, 2, 20, 8)).astype(np.float32)
    k, v = (RNG.standard_normal((1, 2, 30, 8)).astype(np.float32) for _ in range(2))
    _, bias = _masks(1, 20, 30)
    expected = _definition(q, k, v, np.float32(2.0), True, None, bias)
    monkeypatch.setattr(blas_call, "available", lambda: False)
    got = _op().run(q, k, v, np.float32(2.0), None, None, bias)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_perm_that_does_not_fit_the_input_is_a_clear_error():
    from asyncinfer.errors import AsyncInferError
    layer = Layer(name="attention", op_type="MaskedAttention", domain=FUSED_DOMAIN, version=1,
                  inputs=["q", "k", "v"], outputs=["y"], attrs={"q_perm": [0, 2, 1, 3]})
    x = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(AsyncInferError, match="Q of rank 3 cannot take the perm"):
        ops.create(layer).run(x, x, x)
    layer.attrs["q_perm"] = [0, 2, 2, 3]
    with pytest.raises(AsyncInferError, match="not a permutation"):
        ops.create(layer)


def _shared_and_held_alike(attend, alone: np.ndarray, team, monkeypatch) -> None:
    """``attend()`` with ``team`` bound (as on the CPU backend's pool threads) gives ``alone``, the
    one-thread result, bit for bit; so does it while another caller holds the team (every head
    then runs on this thread). Closes the team."""
    from asyncinfer.concurrency import parallel, spin_team
    # (more helpers than cores, on a small machine: parts they miss would have the team decline
    # the claim below for a while, `SpinTeam._take_over`)
    monkeypatch.setattr(spin_team, "ABSENT_COUNT", 1 << 62)
    try:
        with parallel.pool_bound(None, team.helpers + 1, team):
            shared = attend()
            assert team._threads, "the helpers never ran a part"
            np.testing.assert_array_equal(shared, alone)
            held = team.claim()
            assert held is not None
            try:
                np.testing.assert_array_equal(attend(), alone)
            finally:
                team.release()
    finally:
        team.close()


@pytest.mark.parametrize("case", ["three_d", "float64", "mask_widens_scores"])
def test_general_path_matches_the_definition(case):
    q = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    k = RNG.standard_normal((2, 5, 4)).astype(np.float32)
    v = RNG.standard_normal((2, 5, 6)).astype(np.float32)
    keep = np.tril(np.ones((3, 5), bool), k=2)[None]
    bias = np.zeros((1, 3, 5), np.float32)
    if case == "float64":
        q, k, v, bias = (x.astype(np.float64) for x in (q, k, v, bias))
        q, k, v, keep, bias = q[None], k[None], v[None], keep[None], bias[None]
    elif case == "mask_widens_scores":  # a bias with a leading axis of 2 broadcasts the scores up
        q, k, v, keep, bias = q[:1, None], k[:1, None], v[:1, None], keep[None], np.zeros((2, 1, 3, 5), np.float32)
    op = _op()
    if q.ndim == 4 and q.dtype == np.float32:
        assert op._compiled(q, k, v, np.float32(2.0), keep, FILL, bias) is None
    got = op.run(q, k, v, np.asarray(2.0, q.dtype), keep, np.asarray(FILL, q.dtype), bias)
    np.testing.assert_allclose(got, _definition(q, k, v, 2.0, True, keep, bias), rtol=1e-5, atol=1e-5)


def test_repeated_attention_takes_the_short_way_with_the_bits_of_the_full_one(monkeypatch):
    """A MaskedAttention remembers its last compiled case (`MaskedAttention._remember`): calls in
    the same case (the cache one longer, the same scale, fill and head-repeat shapes) skip the
    parsing, any other takes the full way again; every result has the bits of a fresh op's."""
    from asyncinfer.ops.fused import MaskedAttention

    short = []
    again = MaskedAttention._again
    monkeypatch.setattr(MaskedAttention, "_again", lambda self, known, inputs: short.append(
        again(self, known, inputs) is not None) or again(self, known, inputs))
    layer = Layer(name="attention", op_type="MaskedAttention", domain=FUSED_DOMAIN, version=1,
                  inputs=["q", "k", "v", "scale", "keep", "fill", "bias", "ke", "ks", "ve", "vs"], outputs=["y"],
                  attrs={"scale_divides": 1, "out_perm": [0, 2, 1, 3]})
    op = ops.create(layer)
    scale, depth = np.float32(4.0), 8

    shapes: dict[int, list] = {}  # the head repeats' shape arrays, by cache length (as a plan's constants)

    def call(keys, *, scale=scale, keep=True, bias_dtype=np.float32, kv_heads=4, group=1, queries=1, reuse=False):
        arena = RNG.standard_normal((2, kv_heads, 64, depth)).astype(np.float32)
        k, v = arena[:, :, :keys], RNG.standard_normal((2, kv_heads, keys, depth)).astype(np.float32)
        q = RNG.standard_normal((2, kv_heads * group, queries, depth)).astype(np.float32)
        masks = _masks(2, queries, keys)
        repeat = ([np.array([2, kv_heads, group, keys, depth]), np.array([2, kv_heads * group, keys, depth])] * 2
                  if group > 1 else [None] * 4)
        repeat = shapes.setdefault(keys, repeat) if reuse else repeat
        inputs = (q, k, v, scale, masks[0] if keep else None, FILL, masks[1].astype(bias_dtype), *repeat)
        got = op.run(*inputs)
        np.testing.assert_array_equal(got, ops.create(layer).run(*inputs))
        return short.pop() if short else None

    two = np.float32(2.0)
    assert call(10) is None  # the first call takes the full way, and remembers
    assert call(11) is True and call(12) is True  # the cache one longer: the short way
    assert call(12, scale=two) is False  # another scale (remembered in turn)
    assert call(13, scale=two) is True
    assert call(13, scale=two, keep=False) is False  # a mask fewer
    assert call(13, scale=two, bias_dtype=np.float64) is False  # a mask to convert (not remembered)
    assert call(14, scale=two, keep=False) is True
    assert call(13, scale=two, queries=2) is False  # other shapes
    assert call(14, scale=two, kv_heads=2, group=2) is False  # shared heads: their shapes' arrays are
    assert call(14, scale=two, kv_heads=2, group=2) is False  # new objects each call here
    assert call(15, scale=two, kv_heads=2, group=2, reuse=True) is False
    assert call(15, scale=two, kv_heads=2, group=2, reuse=True) is True  # the same ones
    refilled = np.array(2.0, np.float32)
    assert call(15, scale=refilled) is False
    refilled[...] = 3.0  # the same array, another value: the short way reads it again
    assert call(15, scale=refilled) is True


def test_mismatched_shapes_are_a_clear_error():
    from asyncinfer.errors import AsyncInferError

    q = np.zeros((1, 2, 1, 4), np.float32)
    with pytest.raises(AsyncInferError, match="do not make an attention"):
        _op().run(q, np.zeros((1, 2, 5, 3), np.float32), np.zeros((1, 2, 5, 4), np.float32))


@pytest.mark.parametrize("split,end,width", [(4, 8, 8), (4, 1 << 62, 8), (3, 8, 6), (0, 6, 6), (6, 6, 6)])
@pytest.mark.parametrize("x_shape,table_shape,compiled", [
    ((2, 3, 5, None), (2, 1, 5, None), True),  # cos/sin broadcast over heads, as Llama's
    ((3, 5, None), (5, None), True),           # lower ranks
    ((2, 2, 3, 5, None), (5, None), False),    # rank 5: NumPy, as the layers
    ((2, 3, 5, None), (2, 3, 5, 1), False),    # tables of one column: NumPy
    ("heads_view", "transposed", True),        # Llama's: Q a transposed view, the tables transposed
])
def test_rotary_half_embedding_is_its_layers(split, end, width, x_shape, table_shape, compiled, monkeypatch):
    """``x·cos + Concat(-x[..., split:end], x[..., :split])·sin``, bounds clamped as Slice clamps
    them, bit for bit, on the compiled pass (`compiled.rotary`) and off it."""
    from asyncinfer.ops import fused
    from asyncinfer.ops.compiled import rotary
    layer = Layer(name="rope", op_type="RotaryHalfEmbedding", domain=FUSED_DOMAIN, version=1,
                  inputs=["x", "cos", "sin"], outputs=["y"], attrs={"split": split, "end": end})
    if x_shape == "heads_view":  # (B, S, H, D) split into heads by a view, the tables (D, S) transposed
        x = RNG.standard_normal((1, 5, 3, width)).astype(np.float32).transpose(0, 2, 1, 3)
        cos, sin = (RNG.standard_normal((width, 5)).astype(np.float32).T[None, None] for _ in range(2))
    else:
        x = RNG.standard_normal(tuple(width if d is None else d for d in x_shape)).astype(np.float32)
        cos, sin = (RNG.standard_normal(tuple(width if d is None else d for d in table_shape)).astype(np.float32)
                    for _ in range(2))
    x[(0,) * x.ndim] = np.nan  # (IEEE specials: the layers' results too)
    x[(0,) * (x.ndim - 1) + (1,)] = np.inf
    x[(0,) * (x.ndim - 1) + (-1,)] = -0.0
    rotated = np.concatenate([-x[..., split:min(end, width)], x[..., :split]], axis=-1)
    op = ops.create(layer)
    calls: list[int] = []
    monkeypatch.setattr(fused, "rotate_half", lambda *args: calls.append(1) or rotary.rotate_half(*args))
    with np.errstate(all="ignore"):
        got, expected = op.run(x, cos, sin), x * cos + rotated * sin
    np.testing.assert_array_equal(got, expected)
    assert bool(calls) == compiled
