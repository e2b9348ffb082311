"""Token generation (``worker.generate``): greedy and sampled streams against an ONNX Runtime
loop, continuous batching, cancellation, limits and errors, on tiny decoders built here with
random weights (a GPT-2-style one with learned positions, a Llama-style one with rotary
embeddings and grouped-query attention; with and without past)."""
from __future__ import annotations

import asyncio
import gc
import math
import sys
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
from asyncinfer.ops.linalg import LastRowMatMul
from asyncinfer.runtime.execution import Execution
from asyncinfer.runtime.generation.sampling import StopMatcher
from conftest import TEST_DOMAIN
from pixel_testing import require_pixel

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
VOCAB, MAX_POSITIONS = 97, 64


# -- tiny decoders ----------------------------------------------------------------------------------
class _Graph:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def const(self, value) -> str:
        self.n += 1
        self.inits.append(numpy_helper.from_array(np.asarray(value), f"c{self.n}"))
        return f"c{self.n}"

    def weight(self, *shape: int, scale: float | None = None) -> str:
        scale = 1 / math.sqrt(shape[0]) if scale is None else scale
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs):
        self.n += 1
        outs = [f"{op_type}_{self.n}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{op_type}_{self.n}", domain=domain,
                                           **attrs))
        return outs[0] if outputs == 1 else outs

    def dims(self, x: str, axes: list[int]) -> list[str]:
        """``[Unsqueeze(Shape(x)[a])]``: the 1-element shape pieces exports concat into targets."""
        shape = self.op("Shape", x)
        return [self.op("Unsqueeze", self.op("Gather", shape, self.const(np.int64(a)), axis=0), self.const([0]))
                for a in axes]

    def heads(self, x: str, heads: int, d: int) -> str:
        b, s = self.dims(x, [0, 1])
        return self.op("Transpose", self.op("Reshape", x, self.op("Concat", b, s, self.const([heads, d]), axis=0)),
                       perm=[0, 2, 1, 3])

    def linear(self, x: str, cin: int, cout: int) -> str:
        return self.op("MatMul", x, self.weight(cin, cout))

    def layernorm(self, x: str, c: int) -> str:
        return self.op("LayerNormalization", x, self.const((1 + self.rng.normal(0, .1, c)).astype(np.float32)),
                       self.const(self.rng.normal(0, .1, c).astype(np.float32)), axis=-1, epsilon=1e-5)

    def rmsnorm(self, x: str, c: int) -> str:
        var = self.op("ReduceMean", self.op("Mul", x, x), axes=[-1], keepdims=1)
        y = self.op("Div", x, self.op("Sqrt", self.op("Add", var, self.const(np.float32(1e-6)))))
        return self.op("Mul", y, self.const((1 + self.rng.normal(0, .1, c)).astype(np.float32)))


def decoder(*, style: str = "gpt2", past: bool = True, mask: bool = True, positions: bool = True,
            logits: str = "logits", declare_vocab: bool = True, gate: str | None = None, layers: int = 2,
            hidden: int = 32, heads: int = 4, kv_heads: int = 2, max_positions: int = MAX_POSITIONS,
            seed: int = 0) -> onnx.ModelProto:
    """A decoder with the transformers/optimum IO names: ``input_ids``, optional
    ``attention_mask`` / ``position_ids`` / ``past_key_values.N.key|value`` → ``logits`` and
    ``present.N.key|value``. ``style="gpt2"``: learned positions, LayerNorm, one KV head per
    head, causal mask sliced from a ``bias`` table, Where; ``"llama"``: rotary embeddings gathered
    by position, RMSNorm, ``kv_heads`` KV heads repeated (grouped-query attention), SiLU MLP.
    Without ``position_ids``, positions count from the past length (as older exports do)."""
    g = _Graph(seed)
    d = hidden // heads
    kv = heads if style == "gpt2" else kv_heads
    ids = "input_ids"
    inputs = [helper.make_tensor_value_info("input_ids", INT64, ["batch", "sequence"])]
    if mask:
        inputs.append(helper.make_tensor_value_info("attention_mask", INT64, ["batch", "total_sequence"]))
    if positions:
        inputs.append(helper.make_tensor_value_info("position_ids", INT64, ["batch", "sequence"]))
        pos = "position_ids"
    else:
        [seq] = g.dims("input_ids", [1])
        start = g.dims("past_key_values.0.key", [2])[0] if past else g.const([0])
        pos = g.op("Unsqueeze", g.op("Range", g.op("Squeeze", start), g.op("Squeeze", g.op("Add", start, seq)),
                                     g.const(np.int64(1))), g.const([0]))
    if past:
        for i in range(layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", FLOAT,
                                                            ["batch", kv, "past_sequence", d]))
    if gate is not None:
        ids = g.op("Gate", ids, domain=TEST_DOMAIN, gate=gate)
    h = g.op("Gather", g.weight(VOCAB, hidden, scale=1.0), ids, axis=0)
    if style == "gpt2":
        h = g.op("Add", h, g.op("Gather", g.weight(max_positions, hidden, scale=0.3), pos, axis=0))
    else:  # rotary tables indexed by position (optimum's cos_cached[position_ids])
        inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
        angles = np.arange(max_positions)[:, None] * inv[None, :]
        angles = np.concatenate([angles, angles], axis=1).astype(np.float32)
        cos = g.op("Unsqueeze", g.op("Gather", g.const(np.cos(angles)), pos, axis=0), g.const([1]))
        sin = g.op("Unsqueeze", g.op("Gather", g.const(np.sin(angles)), pos, axis=0), g.const([1]))

        def rope(t: str) -> str:
            x1 = g.op("Slice", t, g.const([0]), g.const([d // 2]), g.const([-1]))
            x2 = g.op("Slice", t, g.const([d // 2]), g.const([d]), g.const([-1]))
            return g.op("Add", g.op("Mul", t, cos), g.op("Mul", g.op("Concat", g.op("Neg", x2), x1, axis=-1), sin))
    minimum = g.const(np.float32(np.finfo(np.float32).min))
    if mask:
        m = g.op("Cast", g.op("Unsqueeze", "attention_mask", g.const([1, 2])), to=FLOAT)
        additive = g.op("Mul", g.op("Sub", g.const(np.float32(1)), m), minimum)
    bias = g.const(np.tril(np.ones((max_positions, max_positions), bool))[None, None])
    presents = []
    for i in range(layers):
        n = g.layernorm(h, hidden) if style == "gpt2" else g.rmsnorm(h, hidden)
        q = g.heads(g.linear(n, hidden, hidden), heads, d)
        k = g.heads(g.linear(n, hidden, kv * d), kv, d)
        v = g.heads(g.linear(n, hidden, kv * d), kv, d)
        if style == "llama":
            q, k = rope(q), rope(k)
        if past:
            k = g.op("Concat", f"past_key_values.{i}.key", k, axis=2)
            v = g.op("Concat", f"past_key_values.{i}.value", v, axis=2)
            presents += [(k, f"present.{i}.key"), (v, f"present.{i}.value")]
        if kv != heads:  # repeat each KV head for heads // kv query heads
            k, v = (g.op("Reshape", g.op("Tile", g.op("Unsqueeze", t, g.const([2])), g.const([1, 1, heads // kv, 1, 1])),
                         g.const([0, heads, -1, d])) for t in (k, v))
        scores = g.op("Div", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), g.const(np.float32(math.sqrt(d))))
        [q_len] = g.dims(q, [2])
        [k_len] = g.dims(k, [2])
        causal = g.op("Slice", bias, g.op("Sub", k_len, q_len), k_len, g.const([2]))
        causal = g.op("Slice", causal, g.const([0]), k_len, g.const([3]))
        scores = g.op("Where", causal, scores, minimum)
        if mask:
            scores = g.op("Add", scores, additive)
        ctx = g.op("Transpose", g.op("MatMul", g.op("Softmax", scores, axis=-1), v), perm=[0, 2, 1, 3])
        b, s = g.dims(ctx, [0, 1])
        ctx = g.op("Reshape", ctx, g.op("Concat", b, s, g.const([hidden]), axis=0))
        h = g.op("Add", h, g.linear(ctx, hidden, hidden))
        n = g.layernorm(h, hidden) if style == "gpt2" else g.rmsnorm(h, hidden)
        f = g.linear(n, hidden, 4 * hidden)
        f = g.op("Mul", f, g.op("Sigmoid", g.op("Mul", f, g.const(np.float32(1.702)))))
        h = g.op("Add", h, g.linear(f, 4 * hidden, hidden))
    out = g.linear(g.layernorm(h, hidden) if style == "gpt2" else g.rmsnorm(h, hidden), hidden, VOCAB)
    outputs = [helper.make_tensor_value_info(logits, FLOAT, ["batch", "sequence", VOCAB if declare_vocab else "vocab"])]
    rename = {out: logits}
    for value, name in presents:
        rename[value] = name
        outputs.append(helper.make_tensor_value_info(name, FLOAT, ["batch", kv, "total_sequence", d]))
    for node in g.nodes:
        node.output[:] = [rename.get(o, o) for o in node.output]
        node.input[:] = [rename.get(x, x) for x in node.input]
    graph = helper.make_graph(g.nodes, f"{style}_tiny", inputs, outputs, g.inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(TEST_DOMAIN, 1)] if gate else [])
    model = helper.make_model(graph, opset_imports=opsets, producer_name="asyncinfer-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def reference_greedy(proto: onnx.ModelProto, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of one stream by a plain ONNX Runtime loop: the prompt, then one token per
    step, ``present.*`` fed back as ``past_key_values.*`` (or the whole prefix each step)."""
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    out_names = [o.name for o in session.get_outputs()]
    has_past = any(name.startswith("past_key_values.") for name in inputs)
    pasts = {name: np.zeros((1, info.shape[1], 0, info.shape[3]), np.float32)
             for name, info in inputs.items() if name.startswith("past_key_values.")}
    tokens, feed, cached, chosen = list(prompt), list(prompt), 0, []
    for _ in range(n):
        if not has_past:
            feed, cached = tokens, 0
        total = cached + len(feed)
        feeds = {"input_ids": np.array([feed], np.int64), "attention_mask": np.ones((1, total), np.int64),
                 "position_ids": np.arange(cached, total, dtype=np.int64)[None], **pasts}
        outputs = dict(zip(out_names, session.run(None, {k: v for k, v in feeds.items() if k in inputs})))
        token = int(np.argmax(outputs["logits"][0, -1]))
        chosen.append(token)
        tokens.append(token)
        pasts = {k.replace("present.", "past_key_values."): v for k, v in outputs.items() if k.startswith("present.")}
        feed, cached = [token], total
    return chosen


PROMPTS = [[5, 17, 3], [40, 2, 91, 7, 7], [1], [60, 61, 62, 63, 64, 65, 66], [9, 8], [33] * 11, [70, 3, 12, 5],
           [88, 14, 2, 50, 6, 19]]


@pytest.fixture(scope="module")
def gpt2():
    proto = decoder()
    return proto, ai.load_model(proto.SerializeToString())


@pytest.fixture(scope="module")
def long_gpt2():
    """A context long enough that a stream asked for 10,000 tokens is still running when the
    test stops it (the cancellation tests must not race its natural end)."""
    proto = decoder(max_positions=1024)
    return proto, ai.load_model(proto.SerializeToString())


@pytest.fixture(scope="module")
def llama():
    proto = decoder(style="llama", seed=1)
    return proto, ai.load_model(proto.SerializeToString())


async def eventually(condition, timeout: float = 10.0) -> None:
    """Wait (without blocking the loop) until ``condition()`` holds; fail after ``timeout`` s."""
    import anyio

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await anyio.sleep(0.01)


# -- greedy streams equal the reference loop ---------------------------------------------------------
def test_greedy_stream_equals_onnxruntime_loop(gpt2, any_backend):
    proto, model = gpt2
    backend = any_backend
    n = 12 if backend == "cpu" else 4  # llvmpipe compiles shaders for every new cache length
    with ai.Worker(model, backend) as worker:
        for prompt in PROMPTS[:3] if backend == "cpu" else PROMPTS[:1]:
            assert worker.generate_blocking(prompt, max_new_tokens=n) == reference_greedy(proto, prompt, n)


def test_llama_style_greedy_equals_onnxruntime_loop(llama):
    proto, model = llama
    with ai.Worker(model, "cpu") as worker:
        for prompt in PROMPTS[:3]:
            assert worker.generate_blocking(prompt, max_new_tokens=10) == reference_greedy(proto, prompt, 10)


def test_prompts_multiply_only_their_last_row_by_the_vocabulary(gpt2):
    """The engine reads one row of logits per stream: its plan's logits layer (a host MatMul of
    a constant matrix that no layer reads) multiplies only the last position, and a prompt's
    first token is still the reference's."""
    proto, model = gpt2
    with ai.Worker(model, "cpu") as worker:
        assert worker.generate_blocking(PROMPTS[0], max_new_tokens=3) == reference_greedy(proto, PROMPTS[0], 3)
        plan = worker._generation._plan
    logits = plan.nodes[plan.refs["logits"][0]]
    assert isinstance(logits.step.kernel, LastRowMatMul)
    assert not isinstance(worker._plan.nodes[logits.index].step.kernel, LastRowMatMul)  # runs are unchanged
    weight = model.constants[logits.layer.inputs[1]]
    assert logits.step.kernel._constants == {1: weight}  # bound like the plan's own ops: packed for batches


def test_model_without_past_recomputes_the_prefix():
    proto = decoder(past=False)
    with ai.Worker(ai.load_model(proto.SerializeToString()), "cpu") as worker:
        assert worker.generate_blocking(PROMPTS[1], max_new_tokens=8) == reference_greedy(proto, PROMPTS[1], 8)
        stats = worker.generation_stats()
        assert not stats.batching and "no past" in stats.why_unbatched
        assert stats.runs == 8  # one run of the whole prefix per token


@pytest.mark.parametrize("backend", ["gpu_pixel", "gpu_compute"])
def test_kv_cache_stays_on_the_device(gpt2, backend):
    """Only the logits come back to the host: the present.* values are fed back as they are."""
    if backend == "gpu_pixel":
        require_pixel()
    else:
        from asyncinfer.backends.cupy.device import cuda_unavailable_reason

        if cuda_unavailable_reason() is not None:
            pytest.skip(f"no gpu_compute backend on this machine: {cuda_unavailable_reason()}")
    _, model = gpt2
    with ai.Worker(model, backend) as worker:
        device = worker._backend
        downloads: list[tuple[int, ...]] = []
        start_download = device.start_download

        def counting(value):
            downloads.append(tuple(value.shape))
            return start_download(value)

        device.start_download = counting
        with worker.profile() as profile:
            tokens = worker.generate_blocking(PROMPTS[0], max_new_tokens=4)
        assert len(tokens) == 4
        assert downloads == [(1, 3, VOCAB)] + [(1, 1, VOCAB)] * 3  # the logits of each step, nothing else
        uploads = [s for s in profile.records if s.kind == "upload" and "past_key_values" in s.layer]
        assert uploads and all(s.nbytes == 0 for s in uploads)  # passed through, not copied


# -- sampling, stop, limits -------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_seeds_differ(gpt2):
    _, model = gpt2
    options = dict(max_new_tokens=16, temperature=1.5, top_k=40, top_p=0.95)
    with ai.Worker(model, "cpu") as worker:
        a = worker.generate_blocking(PROMPTS[0], seed=7, **options)
        b = worker.generate_blocking(PROMPTS[0], seed=7, **options)
        c = worker.generate_blocking(PROMPTS[0], seed=8, **options)
        greedy = worker.generate_blocking(PROMPTS[0], max_new_tokens=16)
        top1 = worker.generate_blocking(PROMPTS[0], max_new_tokens=16, temperature=2.0, top_k=1, seed=3)
    assert a == b and len(a) == 16
    assert a != c and a != greedy
    assert top1 == greedy  # top_k=1 leaves one candidate: greedy whatever the temperature


def test_eos_and_stop_sequences_end_the_stream_unyielded(gpt2):
    _, model = gpt2
    with ai.Worker(model, "cpu") as worker:
        full = worker.generate_blocking(PROMPTS[1], max_new_tokens=10)
        stream = worker.generate(PROMPTS[1], max_new_tokens=10, eos_token_id=[full[3], 10_000])
        assert stream.collect_blocking() == full[:full.index(full[3])]
        assert stream.finish_reason is ai.FinishReason.STOP
        stream = worker.generate(PROMPTS[1], max_new_tokens=10, stop=[[full[4], full[5]], [10_000]])
        assert stream.collect_blocking() == full[:4]
        assert stream.finish_reason is ai.FinishReason.STOP
        stream = worker.generate(PROMPTS[1], max_new_tokens=10, stop=[full[2], 10_000])  # a prefix, never completed
        assert stream.collect_blocking() == full and stream.finish_reason is ai.FinishReason.LENGTH


def test_stop_matcher_holds_back_only_possible_prefixes():
    matcher = StopMatcher(((1, 2, 3), (9,)))
    assert matcher.push(5) == ([5], False)
    assert matcher.push(1) == ([], False)
    assert matcher.push(2) == ([], False)
    assert matcher.push(4) == ([1, 2, 4], False)  # 1 2 4 cannot begin 1 2 3 any more
    assert matcher.push(1) == ([], False)
    assert matcher.push(1) == ([1], False)        # the tail 1 still may
    assert matcher.push(2) == ([], False)
    assert matcher.push(3) == ([], True)          # 1 2 3 completed: not released


def test_context_limits(gpt2):
    _, model = gpt2
    with ai.Worker(model, "cpu") as worker:
        with pytest.raises(ai.InputError, match=f"more than the model's context of {MAX_POSITIONS}"):
            worker.generate([1] * (MAX_POSITIONS + 1), max_new_tokens=1)
        stream = worker.generate([1] * (MAX_POSITIONS - 2), max_new_tokens=10)
        assert len(stream.collect_blocking()) == 3  # positions 62, 63 fed, then the context is full
        assert stream.finish_reason is ai.FinishReason.LENGTH


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_ids=[], max_new_tokens=4), "prompt_ids is empty"),
    (dict(prompt_ids=[1, VOCAB], max_new_tokens=4), "beyond the model's vocabulary"),
    (dict(prompt_ids=[1, -2], max_new_tokens=4), "non-negative integer"),
    (dict(prompt_ids="hello", max_new_tokens=4), "needs a tokenizer"),
    (dict(prompt_ids=[1], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_ids=[1], max_new_tokens=4, temperature=-1), "temperature"),
    (dict(prompt_ids=[1], max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(prompt_ids=[1], max_new_tokens=4, top_k=0), "top_k"),
    (dict(prompt_ids=[1], max_new_tokens=4, seed=-1), "seed"),
    (dict(prompt_ids=[1], max_new_tokens=4, stop="\n"), "stop"),
])
def test_bad_requests_are_clear_errors(gpt2, kwargs, message):
    _, model = gpt2
    with ai.Worker(model, "cpu") as worker:
        with pytest.raises(ai.InputError, match=message):
            worker.generate(kwargs.pop("prompt_ids"), **kwargs)


@pytest.mark.parametrize("build, message", [
    (lambda: decoder(logits="scores"), "no output named 'logits'"),
    (lambda: _renamed_input(decoder(), "input_ids", "tokens"), "no input named 'input_ids'"),
    (lambda: _renamed_input(decoder(), "present.1.value", "kv.1.value", output=True),
     "'past_key_values.1.value' has no matching output 'present.1.value'"),
])
def test_a_model_that_fits_no_convention_is_a_clear_error(build, message):
    with ai.Worker(ai.load_model(build().SerializeToString()), "cpu") as worker:
        with pytest.raises(ai.InputError, match=message):
            worker.generate([1, 2], max_new_tokens=2)


def _renamed_input(proto: onnx.ModelProto, old: str, new: str, output: bool = False) -> onnx.ModelProto:
    for info in (proto.graph.output if output else proto.graph.input):
        if info.name == old:
            info.name = new
    for node in proto.graph.node:
        node.input[:] = [new if x == old else x for x in node.input]
        node.output[:] = [new if x == old else x for x in node.output]
    return proto


def test_a_failed_run_reaches_the_stream_and_the_worker_stays_usable():
    proto = decoder(declare_vocab=False)  # no vocabulary declared: an id beyond the table reaches the Gather
    with ai.Worker(ai.load_model(proto.SerializeToString()), "cpu") as worker:
        stream = worker.generate([1, 500], max_new_tokens=4)
        with pytest.raises(ai.ExecutionError, match="Gather"):
            stream.collect_blocking()
        assert stream.finish_reason is ai.FinishReason.ERROR
        assert worker.generate_blocking(PROMPTS[0], max_new_tokens=4) == reference_greedy(proto, PROMPTS[0], 4)


# -- continuous batching ------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("which", ["gpt2", "llama"])
async def test_eight_concurrent_streams_equal_their_solo_runs_in_shared_runs(which, request):
    proto, model = request.getfixturevalue(which)
    n = 12
    async with ai.Worker(model, "cpu") as worker:
        solo = [await worker.generate(p, max_new_tokens=n).collect() for p in PROMPTS]
        await eventually(_idle(worker))
        before = worker.generation_stats()
        together = await asyncio.gather(*(worker.generate(p, max_new_tokens=n).collect() for p in PROMPTS))
        await eventually(_idle(worker))
        after = worker.generation_stats()
    assert together == solo
    assert solo[0] == reference_greedy(proto, PROMPTS[0], n)
    steps = len(PROMPTS) * n
    assert after.tokens - before.tokens == steps
    assert after.runs - before.runs < steps / 2  # batched: far fewer runs than tokens
    assert after.largest_batch > 1 and after.batching


@pytest.mark.asyncio
async def test_batched_steps_on_packed_weights_equal_the_solo_runs(monkeypatch):
    """Batched decode steps multiply their rows by weights packed in column panels (from 2 rows
    on; `ops/compiled/panels.py`), solo steps and prompts by the weights as they are, and a solo
    stream packs nothing: the streams' tokens are the same either way. (The test decoders'
    weights are under the packing threshold: lowered.)"""
    from asyncinfer.ops import linalg

    monkeypatch.setattr(linalg, "FEW_ROWS_MIN_B_BYTES", 0)
    proto = decoder(hidden=128, heads=4, kv_heads=2, seed=3)  # K = 128: deep enough for 8 rows
    n = 8
    async with ai.Worker(ai.load_model(proto.SerializeToString()), "cpu") as worker:
        solo = [await worker.generate(p, max_new_tokens=n).collect() for p in PROMPTS]
        plan = worker._generation._plan
        assert not any("panels" in node.step.op._derived for node in plan.nodes if node.step.op is not None)
        together = await asyncio.gather(*(worker.generate(p, max_new_tokens=n).collect() for p in PROMPTS))
        packed = [node.layer.op_type for node in plan.nodes if node.step.op is not None and "panels" in node.step.op._derived]
    assert together == solo
    assert solo[0] == reference_greedy(proto, PROMPTS[0], n)
    assert "MatMul" in packed or "Gemm" in packed


@pytest.mark.asyncio
async def test_streams_join_a_running_batch_at_step_boundaries(long_gpt2):
    _, model = long_gpt2
    async with ai.Worker(model, "cpu") as worker:
        solo = [await worker.generate(p, max_new_tokens=n).collect() for p, n in zip(PROMPTS[:4], (400, 20, 20, 20))]
        first = worker.generate(PROMPTS[0], max_new_tokens=400)  # long: still running when the others come
        got = [await first.__anext__() for _ in range(5)]
        late = await asyncio.gather(*(worker.generate(p, max_new_tokens=20).collect() for p in PROMPTS[1:4]))
        whole = await first.collect()  # every token, the five already read included
        largest = worker.generation_stats().largest_batch
    assert largest == 4  # the three late streams joined the first one's batch
    assert got == solo[0][:5] and whole == solo[0] and late == solo[1:4]


@pytest.mark.asyncio
async def test_a_model_that_cannot_batch_takes_turns(gpt2):
    proto = decoder(positions=False)  # positions from the past length: left padding would shift them
    async with ai.Worker(ai.load_model(proto.SerializeToString()), "cpu") as worker:
        stats = worker.generation_stats()
        assert not stats.batching and "position_ids" in stats.why_unbatched
        solo = [await worker.generate(p, max_new_tokens=6).collect() for p in PROMPTS[:3]]
        together = await asyncio.gather(*(worker.generate(p, max_new_tokens=6).collect() for p in PROMPTS[:3]))
        assert together == solo == [reference_greedy(proto, p, 6) for p in PROMPTS[:3]]
        assert worker.generation_stats().largest_batch == 1


@pytest.mark.asyncio
async def test_the_engine_thread_runs_a_lone_run_itself_and_hands_several_to_the_pool():
    """A step with one run (one stream, or one batch): the engine thread, which would only wait
    for it, runs its layers itself. A step with several (streams of a model that cannot batch)
    starts them together on the pool's lanes. The tokens are the reference's either way."""
    proto = decoder(positions=False)  # cannot batch: each stream runs on its own
    async with ai.Worker(ai.load_model(proto.SerializeToString()), "cpu", threads=2) as worker:
        with worker.profile() as alone:
            tokens = await worker.generate(PROMPTS[0], max_new_tokens=4).collect()
        assert tokens == reference_greedy(proto, PROMPTS[0], 4)
        assert {r.thread_name for r in alone.records} == {"asyncinfer-generate"}
        with worker.profile() as several:
            together = await asyncio.gather(*(worker.generate(p, max_new_tokens=4).collect() for p in PROMPTS[:3]))
        assert together == [reference_greedy(proto, p, 4) for p in PROMPTS[:3]]
        threads = {r.thread_name for r in several.records}
        assert any(name.startswith("asyncinfer-cpu") for name in threads), threads


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities exist on Linux only")
def test_the_generation_engine_thread_runs_at_the_compute_threads_priority(monkeypatch):
    """It runs decode steps itself (see the test above), so it is a compute thread too
    (`concurrency/priority.py`)."""
    import os

    from asyncinfer.concurrency import priority
    from asyncinfer.runtime.generation import engine

    monkeypatch.delenv("ASYNCINFER_CPU_NICE", raising=False)
    seen: list[int] = []
    real = engine.lower_this_thread

    def spy() -> None:
        real()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    monkeypatch.setattr(engine, "lower_this_thread", spy)
    with ai.Worker(ai.load_model(decoder().SerializeToString()), "cpu") as worker:
        assert len(worker.generate_blocking(PROMPTS[0], max_new_tokens=2)) == 2
    assert seen == [min(os.getpriority(os.PRIO_PROCESS, os.getpid()) + priority.DEFAULT_NICE, 19)]


def test_concurrent_streams_on_gpu_pixel_equal_their_solo_runs(gpt2):
    require_pixel()
    _, model = gpt2
    prompts = PROMPTS[:3]

    async def main(worker):
        return await asyncio.gather(*(worker.generate(p, max_new_tokens=3).collect() for p in prompts))

    with ai.Worker(model, "gpu_pixel") as worker:
        solo = [worker.generate_blocking(p, max_new_tokens=3) for p in prompts]
        assert asyncio.run(main(worker)) == solo
        assert worker.generation_stats().largest_batch > 1


# -- cancellation ---------------------------------------------------------------------------------------
def _idle(worker: ai.Worker):
    """No stream running and no KV cache held."""
    return lambda: (lambda s: s.active == 0 and s.cache_bytes == 0)(worker.generation_stats())


@pytest.mark.anyio
async def test_leaving_the_loop_cancelling_or_timing_out_stops_the_stream(long_gpt2):
    import anyio

    _, model = long_gpt2
    async with ai.Worker(model, "cpu") as worker:
        expected = await worker.generate(PROMPTS[0], max_new_tokens=6).collect()
        # aclose after break
        stream = worker.generate(PROMPTS[0], max_new_tokens=10_000)
        async for _ in stream:
            break
        await stream.aclose()
        assert stream.finish_reason is ai.FinishReason.CANCELLED
        await eventually(_idle(worker))
        # break without aclose: the dropped stream is collected and cancels itself
        async for _ in worker.generate(PROMPTS[1], max_new_tokens=10_000):
            break
        gc.collect()
        await eventually(_idle(worker))
        # a timeout around the consumer
        stream = worker.generate(PROMPTS[2], max_new_tokens=10_000)
        with anyio.move_on_after(0.05):
            await stream.collect()
        assert stream.finish_reason is ai.FinishReason.CANCELLED
        await eventually(_idle(worker))
        # the consuming task cancelled
        stream = worker.generate(PROMPTS[3], max_new_tokens=10_000)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream.collect)
            await eventually(lambda: len(stream.tokens) > 2)
            tg.cancel_scope.cancel()
        assert stream.finish_reason is ai.FinishReason.CANCELLED
        await eventually(_idle(worker))
        # ``async with`` cancels on exit
        async with worker.generate(PROMPTS[4], max_new_tokens=10_000) as stream:
            await stream.__anext__()
        assert stream.finish_reason is ai.FinishReason.CANCELLED
        await eventually(_idle(worker))
        assert await worker.generate(PROMPTS[0], max_new_tokens=6).collect() == expected


@pytest.mark.asyncio
async def test_fifty_cancelled_streams_leak_nothing(long_gpt2):
    _, model = long_gpt2
    async with ai.Worker(model, "cpu") as worker:
        expected = await worker.generate(PROMPTS[5], max_new_tokens=5).collect()
        await eventually(_idle(worker))
        gc.collect()
        executions = sum(isinstance(o, Execution) for o in gc.get_objects())
        threads = threading.active_count()
        for i in range(50):
            stream = worker.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=10_000)
            if i % 2:
                await stream.__anext__()  # some mid-stream, some before their first token
            await stream.aclose()
        await eventually(_idle(worker))
        gc.collect()
        assert sum(isinstance(o, Execution) for o in gc.get_objects()) <= executions
        assert threading.active_count() <= threads + 1  # at most the engine thread
        assert await worker.generate(PROMPTS[5], max_new_tokens=5).collect() == expected


@pytest.mark.asyncio
async def test_cancelling_a_stream_cancels_its_run_in_flight(gate):
    name, event = gate
    model = ai.load_model(decoder(gate=name).SerializeToString())
    async with ai.Worker(model, "cpu") as worker:
        stream = worker.generate(PROMPTS[0], max_new_tokens=4)
        await eventually(lambda: worker.generation_stats().runs == 1)  # its prefill waits at the gate
        await stream.aclose()
        event.set()  # the gate layer ends; every layer after it is skipped
        await eventually(_idle(worker))
        assert worker.generation_stats().tokens == 0  # the run never produced logits
        assert stream.tokens == [] and stream.finish_reason is ai.FinishReason.CANCELLED
        assert len(await worker.generate(PROMPTS[0], max_new_tokens=3).collect()) == 3


@pytest.mark.asyncio
async def test_disposing_the_worker_ends_its_streams(long_gpt2):
    _, model = long_gpt2
    worker = ai.Worker(model, "cpu")
    stream = worker.generate(PROMPTS[0], max_new_tokens=10_000)
    await stream.__anext__()
    await worker.dispose_async()
    with pytest.raises(ai.DisposedError):
        async for _ in stream:
            pass
    with pytest.raises(ai.DisposedError):
        worker.generate(PROMPTS[0], max_new_tokens=2)


def test_blocking_iteration_on_a_thread(gpt2):
    _, model = gpt2
    with ai.Worker(model, "cpu") as worker:
        expected = worker.generate_blocking(PROMPTS[0], max_new_tokens=6)
        got: list[int] = []
        thread = threading.Thread(target=lambda: got.extend(worker.generate(PROMPTS[0], max_new_tokens=6)))
        thread.start()
        thread.join(30)
    assert got == expected


# -- the decode step's speed: cache blocks, shape specialisation, sampling ----------------------------
def _steps_per_run(profile, model) -> list[tuple[int, set[tuple]]]:
    """For each profiled run, in order: how many steps ran, and the cache shapes it fed (the
    shapes of its ``present.*`` outputs, whichever layers made them)."""
    outputs = {layer.name: layer.outputs for layer in model.layers}
    runs: dict[int, list] = {}
    for record in profile.records:
        runs.setdefault(record.run, []).append(record)
    return [(len(records), {shape for r in records for name, shape in zip(outputs.get(r.layer, ()), r.output_shapes)
                            if name.startswith("present.")})
            for _, records in sorted(runs.items())]


def test_decode_steps_keep_the_cache_in_blocks_and_skip_the_shape_arithmetic(long_gpt2):
    """A host cache is kept to a multiple of CACHE_BLOCK columns, so decode steps repeat their
    input shapes and run the shape-specialised plan (Shape/Gather/Concat… of the reshape targets
    are not dispatched): the tokens still equal the unpadded reference loop's."""
    from asyncinfer.runtime.generation import engine

    proto, model = long_gpt2
    prompt, n = PROMPTS[1], 2 * engine.CACHE_BLOCK  # crosses into a second block
    with ai.Worker(model, "cpu") as worker:
        with worker.profile() as profile:
            tokens = worker.generate_blocking(prompt, max_new_tokens=n)
    assert tokens == reference_greedy(proto, prompt, n)
    runs = _steps_per_run(profile, model)
    assert len(runs) == n  # the prompt's run, then one per further token
    block = engine.CACHE_BLOCK
    for i, (_, shapes) in enumerate(runs[1:], start=1):  # present = past (a whole block) + 1
        cached = len(prompt) + i - 1
        assert shapes == {(1, 4, -(-cached // block) * block + 1, 8)}, (i, shapes)
    full = max(count for count, _ in runs)
    # after the first step of each block (which records its shape values), steps run fewer layers
    assert runs[2][0] < full and runs[-1][0] == runs[2][0]


@pytest.mark.asyncio
async def test_concurrent_streams_crossing_cache_blocks_equal_their_solo_runs(llama):
    """Rows of one batch cross block boundaries at different steps; each still equals its solo run."""
    from asyncinfer.runtime.generation import engine

    proto, model = llama
    prompts = [[3] * (engine.CACHE_BLOCK - 2), PROMPTS[0], [7] * (engine.CACHE_BLOCK + 1)]
    n = 6
    async with ai.Worker(model, "cpu") as worker:
        solo = [await worker.generate(p, max_new_tokens=n).collect() for p in prompts]
        together = await asyncio.gather(*(worker.generate(p, max_new_tokens=n).collect() for p in prompts))
    assert together == solo == [reference_greedy(proto, p, n) for p in prompts]


def _sampled_distribution(row: np.ndarray, temperature: float, top_k: int | None, top_p: float | None) -> np.ndarray:
    """The definition, computed the long way: scale, sort everything, keep top_k, renormalise,
    keep the smallest most-likely set reaching top_p, renormalise."""
    logits = row.astype(np.float64) / temperature
    order = np.argsort(-logits, kind="stable")
    if top_k is not None:
        order = order[:top_k]
    probs = np.exp(logits[order] - logits[order].max())
    probs /= probs.sum()
    if top_p is not None:
        keep = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    dist = np.zeros(len(row))
    dist[order] = probs
    return dist


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8),
                                                       (0.9, 12, 0.6), (1.0, None, 0.999)])
def test_sampling_draws_from_the_defined_distribution(temperature, top_k, top_p, monkeypatch):
    """choose() sorts only what the options need (nothing for temperature alone; a growing guess
    at the nucleus for top_p): it draws from exactly the tokens the definition keeps, with their
    probabilities."""
    from asyncinfer.runtime.generation import sampling

    monkeypatch.setattr(sampling, "NUCLEUS_GUESS", 4)  # the guess must grow on this small vocabulary
    row = (np.random.default_rng(3).standard_normal(60) * 2).astype(np.float32)
    expected = _sampled_distribution(row, temperature, top_k, top_p)
    rng = np.random.default_rng(11)
    options = sampling.Sampling(temperature, top_k, top_p)
    draws = 20_000
    counts = np.bincount([sampling.choose(row, options, rng) for _ in range(draws)], minlength=len(row))
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(expected))  # never a token the options exclude
    np.testing.assert_allclose(counts / draws, expected, atol=0.015)  # 20k draws: a few sigma of 0.0035


@pytest.mark.parametrize("m, transposed", [(1, False), (8, False), (3, True), (16, False)])
def test_few_row_gemms_of_decode_steps_split_across_the_pool_equal_numpy(m, transposed, monkeypatch):
    """A decode step's GEMMs have a row per stream: split into column bands across the pool (the
    few-row kernel for C-ordered weights, BLAS for transposed ones), they equal one matmul."""
    from concurrent.futures import ThreadPoolExecutor

    from asyncinfer.concurrency import parallel
    from asyncinfer.ops import linalg

    monkeypatch.setattr(linalg, "FEW_ROWS_MIN_B_BYTES", 0)
    monkeypatch.setattr(linalg, "SPLIT_MIN_B_BYTES", 0)
    monkeypatch.setattr(linalg, "SPLIT_MIN_MACS", 0)  # the transposed weight's column bands too
    calls = []
    real = parallel.run_parts
    monkeypatch.setattr(parallel, "run_parts", lambda count, part: (calls.append(count), real(count, part)))
    rng = np.random.default_rng(m)
    a = rng.standard_normal((m, 300)).astype(np.float32)
    b = rng.standard_normal((700, 300)).astype(np.float32).T if transposed else \
        rng.standard_normal((300, 700)).astype(np.float32)
    with ThreadPoolExecutor(2) as pool, parallel.pool_bound(pool.submit, 2):
        got = linalg.matmul(a, b)
    np.testing.assert_allclose(got, np.matmul(a, b), rtol=1e-5, atol=1e-4)
    assert got.shape == (m, 700) and calls == [2]
