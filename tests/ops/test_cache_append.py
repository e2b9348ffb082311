"""Concat that grows a KV cache in place (`ops.cache_append`): the definition's values always,
no copy of the past when a step's present is fed back, and no view ever changed afterwards."""
from __future__ import annotations

import gc
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from asyncinfer.ops import cache_append
from asyncinfer.ops import shape as shape_ops
from asyncinfer.ops.cache_append import SPARE, concat_growing, pad_growing


def _cache(length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 3, length, 4)).astype(np.float32)


def test_equals_concatenate_and_leaves_room():
    past, new = _cache(5), _cache(1, seed=1)
    present = concat_growing([past, new], 2)
    np.testing.assert_array_equal(present, np.concatenate([past, new], 2))
    assert present.base is not None and present.base.shape[2] == 6 + SPARE


def test_a_fed_back_present_is_appended_in_place_and_earlier_views_keep_their_values():
    present = concat_growing([_cache(5), _cache(1, seed=1)], 2)
    root = present.base
    expected = present.copy()
    history = [present]
    for step in range(2, 10):
        new = _cache(1, seed=step)
        past = history[-1][:, :, 1:] if step % 2 else history[-1]  # the engine drops leading padding
        grown = concat_growing([past, new], 2)
        assert grown.base is root  # no new buffer: the past was not copied
        expected = np.concatenate([expected[:, :, 1:] if step % 2 else expected, new], 2)
        np.testing.assert_array_equal(grown, expected)
        history.append(grown)
    np.testing.assert_array_equal(history[0], concat_growing([_cache(5), _cache(1, seed=1)], 2))


def test_a_stale_view_is_copied_never_written_over():
    first = concat_growing([_cache(5), _cache(1, seed=1)], 2)
    second = concat_growing([first, _cache(1, seed=2)], 2)
    kept = second.copy()
    again = concat_growing([first, _cache(1, seed=3)], 2)  # first no longer ends at the mark
    assert again.base is not first.base
    np.testing.assert_array_equal(second, kept)
    np.testing.assert_array_equal(again, np.concatenate([first, _cache(1, seed=3)], 2))


def test_when_the_room_is_used_up_a_new_buffer_takes_over():
    present = concat_growing([_cache(3), _cache(1, seed=1)], 2)
    expected = present.copy()
    buffers = {id(present.base)}
    for step in range(SPARE + 3):
        new = _cache(1, seed=step + 2)
        present = concat_growing([present, new], 2)
        expected = np.concatenate([expected, new], 2)
        buffers.add(id(present.base))
    np.testing.assert_array_equal(present, expected)
    assert len(buffers) == 2


def test_several_inputs_other_axes_and_promotion_follow_concatenate():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    grown = concat_growing([a, a[:, :1] * 2, a[:, :2] * 3], 1)
    np.testing.assert_array_equal(grown, np.concatenate([a, a[:, :1] * 2, a[:, :2] * 3], 1))
    more = concat_growing([grown, np.ones((2, 1, 4), np.float64)], 1)  # promotes, as concatenate does
    assert more.dtype == np.float64 and more.base is not grown.base
    np.testing.assert_array_equal(more, np.concatenate([grown, np.ones((2, 1, 4))], 1))


def test_mismatched_shapes_raise_as_concatenate_does_never_broadcast():
    present = concat_growing([_cache(4), _cache(1, seed=1)], 2)
    with pytest.raises(ValueError):
        concat_growing([present, np.zeros((2, 3, 1, 1), np.float32)], 2)
    with pytest.raises(ValueError):
        concat_growing([present, np.zeros((2, 3, 1), np.float32)], 2)


def test_two_threads_fed_the_same_past_both_get_the_definition():
    past = concat_growing([_cache(8), _cache(1, seed=1)], 2)
    results: dict[int, np.ndarray] = {}
    news = {i: _cache(1, seed=10 + i) for i in range(8)}
    barrier = threading.Barrier(8)

    def append(i: int) -> None:
        barrier.wait()
        results[i] = concat_growing([past, news[i]], 2)

    threads = [threading.Thread(target=append, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, grown in results.items():
        np.testing.assert_array_equal(grown, np.concatenate([past, news[i]], 2))
    assert sum(r.base is past.base for r in results.values()) == 1  # exactly one appended in place


def test_a_freed_buffer_leaves_the_registry():
    present = concat_growing([_cache(4), _cache(1, seed=1)], 2)
    key = id(present.base)
    assert cache_append._arenas[key].buffer() is present.base
    del present
    gc.collect()
    assert key not in cache_append._arenas


def test_an_array_that_reuses_a_freed_buffers_id_is_not_taken_for_it():
    """Arenas are found by the id of their buffer; a later array may get a dead one's id, and
    must then be concatenated as any other array, not written into."""
    present = concat_growing([_cache(4), _cache(1, seed=1)], 2)
    stale = cache_append._arenas[id(present.base)]
    impostor = np.zeros((2, 3, 40, 4), np.float32)
    cache_append._arenas[id(impostor)] = stale  # as if impostor had been given the dead buffer's id
    past = impostor[:, :, :5]
    grown = concat_growing([past, _cache(1, seed=2)], 2)
    assert grown.base is not impostor and np.all(impostor == 0)
    np.testing.assert_array_equal(grown, np.concatenate([past, _cache(1, seed=2)], 2))


def _decoder_step_model() -> onnx.ModelProto:
    """present = Concat(past, x * 2) (marked); other = Concat(x * 2, past) (not: its first input
    is no graph input)."""
    past = helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, 2, "t", 3])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 1, 3])
    nodes = [helper.make_node("Add", ["x", "x"], ["x2"]),
             helper.make_node("Concat", ["past", "x2"], ["present"], axis=2),
             helper.make_node("Concat", ["x2", "past"], ["other"], axis=2)]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, "u", 3]) for n in ("present", "other")]
    graph = helper.make_graph(nodes, "step", [past, x], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_optimizer_marks_the_cache_concat_and_runs_stay_exact():
    model = ai.load_model(_decoder_step_model().SerializeToString())
    marked = {layer.outputs[0]: layer.appends_cache for layer in model.layers if layer.op_type == "Concat"}
    assert marked == {"present": True, "other": False}
    assert model.optimizations["mark_cache_appends"] == 1
    rng = np.random.default_rng(0)
    past = np.zeros((1, 2, 0, 3), np.float32)
    with ai.Worker(model, "cpu") as worker:
        for _ in range(5):
            x = rng.standard_normal((1, 2, 1, 3)).astype(np.float32)
            out = worker.run_blocking({"past": past, "x": x})
            present, other = np.asarray(out["present"]), np.asarray(out["other"])
            np.testing.assert_array_equal(present, np.concatenate([past, 2 * x], 2))
            np.testing.assert_array_equal(other, np.concatenate([2 * x, past], 2))
            past = present


def test_a_padded_cache_is_np_pad_with_room_and_its_next_concat_appends_in_place():
    """`pad_growing` (the generation engine's padding of a cache to its block) equals np.pad along
    the axis; the Concat that extends it then writes only the new entries, into the same buffer."""
    past = np.arange(2 * 3 * 5 * 4, dtype=np.float32).reshape(2, 3, 5, 4)
    padded = pad_growing(past, 3, axis=2)
    np.testing.assert_array_equal(padded, np.pad(past, ((0, 0), (0, 0), (3, 0), (0, 0))))
    new = np.full((2, 3, 1, 4), -1, np.float32)
    grown = concat_growing([padded[:, :, 1:], new], axis=2)  # the engine drops a leading column a step
    np.testing.assert_array_equal(grown, np.concatenate([padded[:, :, 1:], new], axis=2))
    assert grown.base is padded.base  # appended in place: the padded buffer had room
    np.testing.assert_array_equal(padded, np.pad(past, ((0, 0), (0, 0), (3, 0), (0, 0))))  # unchanged


# -- chains of Concats (DenseNet's dense blocks): Layer.grow_room -------------------------------------
def _dense_block(layers: int, growth: int = 3, batch: int | str = 1, extra_reader: bool = False) -> onnx.ModelProto:
    """A dense block: each layer's features (a 1x1 conv of everything so far) concatenated to all
    before, Concat after Concat; ``extra_reader``: a second Concat also reads the first link's
    output (then that link has two Concat readers and is no chain's)."""
    rng = np.random.default_rng(0)
    nodes, inits, channels, current = [], [], 4, "x"
    for i in range(layers):
        w = rng.standard_normal((growth, channels, 1, 1)).astype(np.float32)
        inits.append(onnx.numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("Conv", [current, f"w{i}"], [f"f{i}"], kernel_shape=[1, 1]))
        nodes.append(helper.make_node("Concat", [current, f"f{i}"], [f"c{i}"], axis=1))
        current, channels = f"c{i}", channels + growth
    outputs = [helper.make_tensor_value_info(current, TensorProto.FLOAT, None)]
    if extra_reader:
        nodes.append(helper.make_node("Concat", ["c0", "f1"], ["side"], axis=1))
        outputs.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4, 5, 6])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_chain_of_concats_is_marked_with_the_room_the_rest_of_it_adds():
    model = ai.load_model(_dense_block(4, growth=3))
    concats = [layer for layer in model.layers if layer.op_type == "Concat"]
    assert [layer.grow_room for layer in concats] == [9, 6, 3, 0]
    assert model.optimizations["mark_concat_chains"] == 4


def test_a_concat_read_by_two_concats_starts_no_chain_there():
    model = ai.load_model(_dense_block(3, extra_reader=True))
    rooms = {layer.outputs[0]: layer.grow_room for layer in model.layers if layer.op_type == "Concat"}
    assert rooms["c0"] is None and rooms["side"] is None  # c0 has two Concat readers
    assert rooms["c1"] == 3 and rooms["c2"] == 0  # the chain starts after it


def test_a_chain_link_appends_in_place_after_the_one_before():
    a, f = np.ones((1, 4, 2, 3), np.float32), np.full((1, 2, 2, 3), 2.0, np.float32)
    first = concat_growing([a, f], 1, 4)
    second = concat_growing([first, f * 2], 1, 2)
    third = concat_growing([second, f * 3], 1, 0)
    assert first.base.shape[1] == 10 and second.base is first.base and third.base is first.base
    np.testing.assert_array_equal(third, np.concatenate([a, f, f * 2, f * 3], 1))
    np.testing.assert_array_equal(first, np.concatenate([a, f], 1))  # earlier links keep their values
    fourth = concat_growing([third, f], 1, 0)  # no room left: a new buffer, the others untouched
    assert fourth.base is not first.base
    np.testing.assert_array_equal(fourth, np.concatenate([a, f, f * 2, f * 3, f], 1))


@pytest.mark.parametrize("batch", [1, 2])
def test_a_dense_block_runs_to_the_definition_with_its_links_in_one_buffer(batch, monkeypatch):
    """Every link's result is the definition's; with one image the links share one buffer (each
    appended in place), with two (non-contiguous slices) they concatenate as usual."""
    proto = _dense_block(5, batch="N")
    x = np.random.default_rng(1).standard_normal((batch, 4, 5, 6)).astype(np.float32)
    names = [f"c{i}" for i in range(5)]
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        for _ in range(2):
            got = worker.run_blocking(x, outputs=names)
    reference = ReferenceEvaluator(proto).run(names, {"x": x})
    for name, want in zip(names, reference):
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5)

    bases = []
    original = concat_growing

    def spy(arrays, axis, room=cache_append.SPARE):
        out = original(arrays, axis, room)
        bases.append(out.base)
        return out

    monkeypatch.setattr(shape_ops, "concat_growing", spy)
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        worker.run_blocking(x)
    if batch == 1:
        assert len(bases) == 5 and all(base is bases[0] for base in bases)
    else:
        assert bases == []  # (np.concatenate: contiguous results for the kernels that read them)


def test_an_overstated_room_is_capped():
    """The room comes from the model's declared shapes, which an untrusted file may overstate: a
    chain whose shapes claim a million more channels leaves at most `MAX_ROOM_RATIO` times the
    link's own, and still computes the definition."""
    proto = _dense_block(2)
    f1 = helper.make_tensor_value_info("f1", TensorProto.FLOAT, [1, 1_000_000, 5, 6])  # a lie
    proto.graph.value_info.append(f1)
    model = ai.load_model(proto)
    first = next(layer for layer in model.layers if layer.op_type == "Concat")
    assert first.grow_room == 1_000_000
    x = np.random.default_rng(2).standard_normal((1, 4, 5, 6)).astype(np.float32)
    bases = []
    original = concat_growing

    def spy(arrays, axis, room=cache_append.SPARE):
        out = original(arrays, axis, room)
        bases.append(out.base.shape[1])
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shape_ops, "concat_growing", spy)
        with ai.Worker(model, "cpu") as worker:
            got = worker.run_blocking(x)["c1"]
    assert bases and bases[0] <= (1 + shape_ops.MAX_ROOM_RATIO) * 7  # 4 + 3 channels held
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(["c1"], {"x": x})[0], rtol=1e-5, atol=1e-5)
