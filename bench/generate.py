"""Token generation: time to first token, per-token time and tokens/s, asyncinfer vs ONNX Runtime loops.

Two decoders with random weights, exported in the transformers/optimum convention (``input_ids``,
``attention_mask``, ``position_ids``, ``past_key_values.N.key|value`` → ``logits``,
``present.N.key|value``) and cached: a GPT-2-small-shaped one (12 layers of 768, 12 heads,
50257 logits) and a Llama-style one (rotary embeddings, grouped-query attention, RMSNorm, SiLU
MLP). On the same ONNX file, greedy, in one run:

- ``asyncinfer``: ``worker.generate(prompt, max_new_tokens=n)`` read with ``async for``; 8 streams
  are 8 concurrent tasks on one worker (its engine batches them);
- ``ort_iobinding``: a hand-written ONNX Runtime greedy loop with IO binding: the ``present.*``
  OrtValues are bound as the next step's ``past_key_values.*`` (never copied to NumPy), only the
  logits are read; 8 streams are 8 such loops on threads sharing the session, each awaited from
  the event loop through ``run_in_executor``;
- ``ort_genai``: onnxruntime-genai (where it installs) on the same ONNX file, with a
  ``genai_config.json`` written for the transformers convention; 8 streams are 8 generators on
  threads.

Per engine: time to first token (the prompt's run and one token), per-token time after it, and
tokens/s of one stream; aggregate tokens/s of 8 concurrent streams, and the lateness of a 1 ms
ticker on the event loop meanwhile (p50/p99/max). asyncinfer's tokens are timed when the event
loop receives them; the threaded engines', when their thread makes them (a small model's tokens
can outrun the loop). Greedy tokens are checked identical across
engines, and each of asyncinfer's 8 concurrent streams identical to its solo run, before any ratio
is reported (a ratio over different tokens would be meaningless). A round runs every engine's
solo stream back to back, then every engine's concurrent streams, the order rotating each round;
a ratio is the median of the rounds' own ratios (see ``ratios``). The rounds run with the heap
frozen (`common.frozen_heap`): a full garbage collection (50-60 ms once a GPT-2 worker is
loaded) would otherwise land in some engine's loop-lag maximum by chance.

    python3 bench/generate.py [--models gpt2 llama] [--tokens 64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import onnx

from bench import architectures, common
from bench.architectures import FLOAT, INT64, GraphBuilder, _conv1d_gpt, _merge_heads, _split_heads
from bench.overhead import _ticker

ENGINES = ("asyncinfer", "ort_iobinding", "ort_genai")
TICK_S = 0.001
STREAMS = 8
ROUNDS = 5  # odd: the median is one round's figure
#: genai's model type for both files: "llama" reads the transformers names; with "gpt2", genai 0.18
#: fails on our GPT-2 file with "Model input was not found: " (an empty input name).
GENAI_TYPE = "llama"
#: Bump to rebuild the cached decoders even when this file did not change.
BUILDER_VERSION = 1


# -- the decoders -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decoder:
    """The shape of one benchmark decoder (what genai_config.json needs, and the cache key)."""

    name: str
    style: str          # "gpt2" or "llama"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_positions: int

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    def build(self) -> onnx.ModelProto:
        return gpt2_decoder(self) if self.style == "gpt2" else llama_decoder(self)


DECODERS: dict[str, Decoder] = {d.name: d for d in [
    Decoder("gpt2", "gpt2", layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072, vocab=50257, max_positions=1024),
    Decoder("llama", "llama", layers=8, hidden=1024, heads=16, kv_heads=4, ffn=2816, vocab=32000,
            max_positions=2048),
]}


def _decoder_io(g: GraphBuilder, d: Decoder) -> list[tuple[str, str]]:
    """The transformers/optimum inputs; the (past key, past value) names of each layer."""
    g.input("input_ids", INT64, ["batch", "sequence"])
    g.input("attention_mask", INT64, ["batch", "total_sequence"])
    g.input("position_ids", INT64, ["batch", "sequence"])
    return [(g.input(f"past_key_values.{i}.key", FLOAT, ["batch", d.kv_heads, "past_sequence", d.head_size]),
             g.input(f"past_key_values.{i}.value", FLOAT, ["batch", d.kv_heads, "past_sequence", d.head_size]))
            for i in range(d.layers)]


def _masked_softmax(g: GraphBuilder, scores: str, q: str, k: str, causal_table: str, additive: str) -> str:
    """Causal mask sliced from a ``[1, 1, max, max]`` table at rows [k_len - q_len, k_len) (bounds
    from Shape, as exports compute them), applied by Where, then the padding mask added."""
    [q_len] = g.shape_dims(q, [2])
    [k_len] = g.shape_dims(k, [2])
    causal = g.op("Slice", causal_table, g.op("Sub", k_len, q_len), k_len, g.ints([2]))
    causal = g.op("Slice", causal, g.ints([0]), k_len, g.ints([3]))
    masked = g.op("Where", causal, scores, g.scalar(float(np.finfo(np.float32).min)))
    return g.op("Softmax", g.op("Add", masked, additive), axis=-1)


def _padding_mask(g: GraphBuilder) -> str:
    """``(1 - attention_mask[:, None, None, :]) * finfo.min``: what transformers adds to the scores."""
    m = g.op("Cast", g.op("Unsqueeze", "attention_mask", g.ints([1, 2])), to=FLOAT)
    return g.op("Mul", g.op("Sub", g.scalar(1.0), m), g.scalar(float(np.finfo(np.float32).min)))


def _outputs(g: GraphBuilder, d: Decoder, logits: str, presents: list[str]) -> onnx.ModelProto:
    g.output(logits, "logits", FLOAT, ["batch", "sequence", d.vocab])
    for i in range(d.layers):
        for j, kind in enumerate(("key", "value")):
            g.output(presents[2 * i + j], f"present.{i}.{kind}", FLOAT,
                     ["batch", d.kv_heads, "total_sequence", d.head_size])
    return g.model()


def gpt2_decoder(d: Decoder) -> onnx.ModelProto:
    """GPT-2 as transformers exports it with past: token + position embeddings, per layer
    LayerNorm, Conv1D (Reshape/Gemm/Reshape) to qkv, Split, heads, present = Concat(past, new),
    causal mask from the ``bias`` table and the padding mask, Softmax, projection, gelu_new MLP;
    final LayerNorm and an lm_head MatMul to ``vocab`` logits."""
    g = GraphBuilder(f"{d.name}_decoder", seed=20)
    hidden, heads, hd = d.hidden, d.heads, d.head_size
    pasts = _decoder_io(g, d)
    h = g.op("Add", g.op("Gather", g.weight([d.vocab, hidden], 1, gain=0.3), "input_ids", axis=0),
             g.op("Gather", g.weight([d.max_positions, hidden], 1, gain=0.1), "position_ids", axis=0))
    table = g.const(np.tril(np.ones((d.max_positions, d.max_positions), dtype=bool))[None, None], "causal_bias")
    additive = _padding_mask(g)
    presents = []
    for i, (past_k, past_v) in enumerate(pasts):
        with g.scope(f"h.{i}.attn"):
            qkv = _conv1d_gpt(g, g.layernorm(h, hidden), hidden, 3 * hidden)
            q, k, v = g.op("Split", qkv, g.ints([hidden] * 3), axis=2, outputs=3)
            q = _split_heads(g, q, heads, hd, [0, 2, 1, 3])
            present_k = g.op("Concat", past_k, _split_heads(g, k, heads, hd, [0, 2, 1, 3]), axis=-2)
            present_v = g.op("Concat", past_v, _split_heads(g, v, heads, hd, [0, 2, 1, 3]), axis=-2)
            presents += [present_k, present_v]
            scores = g.op("Div", g.op("MatMul", q, g.op("Transpose", present_k, perm=[0, 1, 3, 2])),
                          g.scalar(math.sqrt(hd)))
            probs = _masked_softmax(g, scores, q, present_k, table, additive)
            h = g.op("Add", _conv1d_gpt(g, _merge_heads(g, g.op("MatMul", probs, present_v), hidden), hidden, hidden), h)
        with g.scope(f"h.{i}.mlp"):
            f = g.act(_conv1d_gpt(g, g.layernorm(h, hidden), hidden, d.ffn, gain=math.sqrt(2.0)), "gelu_tanh")
            h = g.op("Add", _conv1d_gpt(g, f, d.ffn, hidden), h)
    logits = g.op("MatMul", g.layernorm(h, hidden), g.weight([hidden, d.vocab], hidden))
    return _outputs(g, d, logits, presents)


def llama_decoder(d: Decoder, theta: float = 10000.0) -> onnx.ModelProto:
    """A Llama decoder as transformers exports it with past: embeddings by Gather; rotary cos/sin
    from ``position_ids`` (inv_freq MatMul, Cos, Sin) applied with rotate_half; per layer RMSNorm
    (Pow/ReduceMean/Add/Sqrt/Div/Mul), q/k/v/o projections without bias, ``kv_heads`` KV heads
    cached and repeated for the query heads (Unsqueeze/Expand/Reshape: grouped-query attention),
    causal and padding masks, SiLU-gated MLP; final RMSNorm, untied lm_head."""
    g = GraphBuilder(f"{d.name}_decoder", seed=21)
    hidden, heads, kv, hd = d.hidden, d.heads, d.kv_heads, d.head_size
    pasts = _decoder_io(g, d)
    h = g.op("Gather", g.weight([d.vocab, hidden], 1, gain=0.5), "input_ids", axis=0)
    with g.scope("rotary"):
        inv_freq = (1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)).astype(np.float32)
        pos = g.op("Unsqueeze", g.op("Cast", "position_ids", to=FLOAT), g.ints([1]))            # [b, 1, s]
        freqs = g.op("Transpose", g.op("MatMul", g.const(inv_freq[None, :, None], "inv_freq"), pos), perm=[0, 2, 1])
        emb = g.op("Concat", freqs, freqs, axis=-1)                                              # [b, s, hd]
        cos = g.op("Unsqueeze", g.op("Cos", emb), g.ints([1]))
        sin = g.op("Unsqueeze", g.op("Sin", emb), g.ints([1]))

    def rope(t: str) -> str:
        x1 = g.op("Slice", t, g.ints([0]), g.ints([hd // 2]), g.ints([-1]))
        x2 = g.op("Slice", t, g.ints([hd // 2]), g.ints([hd]), g.ints([-1]))
        return g.op("Add", g.op("Mul", t, cos), g.op("Mul", g.op("Concat", g.op("Neg", x2), x1, axis=-1), sin))

    def repeat_kv(t: str) -> str:  # [b, kv, s, hd] -> [b, heads, s, hd]
        b, s = g.shape_dims(t, [0, 2])
        wide = g.op("Expand", g.op("Unsqueeze", t, g.ints([2])),
                    g.op("Concat", b, g.ints([kv, heads // kv]), s, g.ints([hd]), axis=0))
        return g.op("Reshape", wide, g.op("Concat", b, g.ints([heads]), s, g.ints([hd]), axis=0))

    table = g.const(np.tril(np.ones((d.max_positions, d.max_positions), dtype=bool))[None, None], "causal_bias")
    additive = _padding_mask(g)
    presents = []
    for i, (past_k, past_v) in enumerate(pasts):
        with g.scope(f"layers.{i}.self_attn"):
            n = g.rmsnorm(h, hidden)
            q = rope(_split_heads(g, g.linear(n, hidden, hidden, bias=False), heads, hd, [0, 2, 1, 3]))
            k = rope(_split_heads(g, g.linear(n, hidden, kv * hd, bias=False), kv, hd, [0, 2, 1, 3]))
            v = _split_heads(g, g.linear(n, hidden, kv * hd, bias=False), kv, hd, [0, 2, 1, 3])
            present_k = g.op("Concat", past_k, k, axis=-2)
            present_v = g.op("Concat", past_v, v, axis=-2)
            presents += [present_k, present_v]
            keys, values = repeat_kv(present_k), repeat_kv(present_v)
            scores = g.op("Div", g.op("MatMul", q, g.op("Transpose", keys, perm=[0, 1, 3, 2])), g.scalar(math.sqrt(hd)))
            probs = _masked_softmax(g, scores, q, keys, table, additive)
            ctx = _merge_heads(g, g.op("MatMul", probs, values), hidden)
            h = g.op("Add", h, g.linear(ctx, hidden, hidden, bias=False))
        with g.scope(f"layers.{i}.mlp"):
            n = g.rmsnorm(h, hidden)
            gate = g.act(g.linear(n, hidden, d.ffn, bias=False, gain=math.sqrt(2.0)), "silu")
            up = g.linear(n, hidden, d.ffn, bias=False)
            h = g.op("Add", h, g.linear(g.op("Mul", gate, up), d.ffn, hidden, bias=False))
    logits = g.op("MatMul", g.rmsnorm(h, hidden), g.weight([hidden, d.vocab], hidden))
    return _outputs(g, d, logits, presents)


# -- the cache --------------------------------------------------------------------------------------
_BUILDERS = (_decoder_io, _masked_softmax, _padding_mask, _outputs, gpt2_decoder, llama_decoder)


def builder_key(d: Decoder) -> str:
    """Changes when the decoder's shape, its builders (here or in architectures.py) or onnx do."""
    import hashlib
    import inspect

    digest = hashlib.sha256(repr(d).encode())
    for fn in _BUILDERS:
        digest.update(inspect.getsource(fn).encode())
    digest.update(f"{BUILDER_VERSION}/{architectures.builder_key()}".encode())
    return digest.hexdigest()[:12]


def model_dir(d: Decoder) -> Path:
    """``<bench cache>/generate-<name>-<key>/``: ``model.onnx`` and its ``genai_config.json``,
    built first if missing."""
    folder = architectures.cache_dir() / f"generate-{d.name}-{builder_key(d)}"
    path = folder / "model.onnx"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"model.onnx.{os.getpid()}.tmp")
        tmp.write_bytes(d.build().SerializeToString())
        os.replace(tmp, path)  # atomic: a concurrent reader sees no file or the whole one
        for stale in folder.parent.glob(f"generate-{d.name}-*"):
            if stale != folder and stale.is_dir():
                for f in stale.iterdir():
                    f.unlink(missing_ok=True)
                stale.rmdir()
    config = folder / "genai_config.json"
    config.write_text(json.dumps(genai_config(d), indent=2))
    return folder


def genai_config(d: Decoder, max_length: int | None = None) -> dict[str, Any]:
    """onnxruntime-genai's configuration for our file: the transformers names, a KV cache that
    grows (no shared past/present buffer: the file's past and present lengths differ), greedy."""
    return {
        "model": {
            "type": GENAI_TYPE, "vocab_size": d.vocab, "context_length": d.max_positions,
            # genai wants an eos id in the vocabulary: the last one (the token check would show it generated)
            "bos_token_id": 0, "eos_token_id": d.vocab - 1, "pad_token_id": 0,
            "decoder": {
                "filename": "model.onnx", "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "head_size": d.head_size, "hidden_size": d.hidden, "num_attention_heads": d.heads,
                "num_key_value_heads": d.kv_heads, "num_hidden_layers": d.layers,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "position_ids": "position_ids", "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "max_length": max_length or d.max_positions,
                   "min_length": 0, "past_present_share_buffer": False, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
                   "repetition_penalty": 1.0, "length_penalty": 1.0, "early_stopping": True,
                   "no_repeat_ngram_size": 0, "num_return_sequences": 1, "diversity_penalty": 0.0},
    }


#: Small variants: the --quick profile and the smoke test (seconds to build and run, same graphs).
SMALL: dict[str, Decoder] = {
    "gpt2": Decoder("gpt2_small_test", "gpt2", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=512,
                    max_positions=256),
    "llama": Decoder("llama_small_test", "llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=512,
                     max_positions=256),
}


def prompts(d: Decoder, streams: int, length: int = 16) -> list[list[int]]:
    """``streams`` prompts of ``length - 2i % 7`` tokens (different lengths: the batch pads them)."""
    rng = np.random.default_rng(7)
    return [rng.integers(1, d.vocab - 1, length - (2 * i) % 7).tolist() for i in range(streams)]


# -- one stream's timing ----------------------------------------------------------------------------
@dataclass
class StreamTiming:
    """When each token of one stream arrived, from the moment it was requested (seconds)."""

    start: float
    arrivals: list[float]
    tokens: list[int]

    @property
    def ttft_ms(self) -> float:
        return (self.arrivals[0] - self.start) * 1e3

    @property
    def per_token_ms(self) -> float:
        """Mean time between tokens after the first (the decode steps)."""
        n = len(self.arrivals)
        return (self.arrivals[-1] - self.arrivals[0]) * 1e3 / (n - 1) if n > 1 else math.nan

    @property
    def end(self) -> float:
        return self.arrivals[-1]


def summarize_solo(runs: Sequence[StreamTiming]) -> dict[str, Any]:
    """Medians over the rounds of one stream alone: time to first token, per-token time, tokens/s
    (``tokens_per_s``: every token over request-to-last-token; ``decode_tokens_per_s``: after the first)."""
    per_token = statistics.median(r.per_token_ms for r in runs)
    return {"ttft_ms": statistics.median(r.ttft_ms for r in runs), "ttft_ms_rounds": [r.ttft_ms for r in runs],
            "per_token_ms": per_token, "per_token_ms_rounds": [r.per_token_ms for r in runs],
            "tokens_per_s": statistics.median(len(r.tokens) / (r.end - r.start) for r in runs),
            "decode_tokens_per_s": 1e3 / per_token}


def summarize_concurrent(rounds: Sequence[list[StreamTiming]], lags: list[float]) -> dict[str, Any]:
    """Medians over the rounds of N concurrent streams: aggregate tokens/s (every token of every
    stream over first request to last token), each stream's time to first token and per-token
    time, and the ticker's lateness over all rounds."""
    def aggregate(streams: list[StreamTiming]) -> float:
        return sum(len(s.tokens) for s in streams) / (max(s.end for s in streams) - min(s.start for s in streams))

    return {"aggregate_tokens_per_s": statistics.median(aggregate(r) for r in rounds),
            "aggregate_tokens_per_s_rounds": [aggregate(r) for r in rounds],
            "ttft_ms": statistics.median(statistics.median(s.ttft_ms for s in r) for r in rounds),
            "per_token_ms": statistics.median(statistics.median(s.per_token_ms for s in r) for r in rounds),
            "loop_lag": {"ticks": len(lags), **common.percentiles_ms(lags, (50, 99))}}


# -- the engines ------------------------------------------------------------------------------------
class Engine:
    """One contestant: generates greedy tokens for a prompt, one stream or several at once, from
    an asyncio event loop."""

    name = ""

    async def solo(self, prompt: list[int], n: int) -> StreamTiming:
        """``n`` greedy tokens of one stream, timed as the event loop receives them."""
        return await self._stream(prompt, n)

    async def concurrent(self, prompts: Sequence[list[int]], n: int) -> list[StreamTiming]:
        """One stream per prompt, all at once."""
        return list(await asyncio.gather(*(self._stream(p, n) for p in prompts)))

    async def _stream(self, prompt: list[int], n: int) -> StreamTiming:
        raise NotImplementedError

    def close(self) -> None:
        pass


class AsyncinferEngine(Engine):
    """``worker.generate`` read with ``async for``; concurrent streams share the worker."""

    name = "asyncinfer"

    def __init__(self, path: Path, threads: int):
        import asyncinfer as ai

        self.worker = ai.Worker(ai.load_model(path), "cpu", threads=threads)

    async def _stream(self, prompt: list[int], n: int) -> StreamTiming:
        start = time.perf_counter()
        arrivals: list[float] = []
        stream = self.worker.generate(prompt, max_new_tokens=n)
        async for _ in stream:
            arrivals.append(time.perf_counter())
        return StreamTiming(start, arrivals, stream.tokens)

    def close(self) -> None:
        self.worker.dispose()


class _ThreadedEngine(Engine):
    """An engine whose loop blocks: each stream runs on an executor thread (what an asyncio user
    does with a blocking library), handing each token to the event loop as it comes."""

    def __init__(self, streams: int):
        self.pool = ThreadPoolExecutor(max_workers=streams, thread_name_prefix=f"{self.name}-stream")

    def generate(self, prompt: list[int], n: int, on_token: Callable[[int], None]) -> None:
        raise NotImplementedError

    async def _stream(self, prompt: list[int], n: int) -> StreamTiming:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()

        def produce() -> None:
            # Stamped when made, on the loop's thread: a small model's tokens can outrun the loop
            # (asyncinfer's are stamped when the loop receives them, which only counts against it).
            try:
                self.generate(prompt, n, lambda t: loop.call_soon_threadsafe(queue.put_nowait,
                                                                             (t, time.perf_counter())))
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        start = time.perf_counter()
        done = loop.run_in_executor(self.pool, produce)
        arrivals: list[float] = []
        tokens: list[int] = []
        while (item := await queue.get()) is not None:
            tokens.append(item[0])
            arrivals.append(item[1])
        await done  # re-raises the loop's error, if any
        return StreamTiming(start, arrivals, tokens)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class OrtIoBindingEngine(_ThreadedEngine):
    """A hand-written ONNX Runtime greedy loop with IO binding, on one shared session: each step
    binds the previous step's ``present.*`` OrtValues as ``past_key_values.*`` (the cache never
    becomes NumPy), lets ORT allocate the outputs, and reads the logits' last row only."""

    name = "ort_iobinding"

    def __init__(self, path: Path, d: Decoder, threads: int, streams: int):
        super().__init__(streams)
        self.session = common.ort_session(path, threads)
        self.layers = d.layers
        self.empty = np.zeros((1, d.kv_heads, 0, d.head_size), np.float32)

    def generate(self, prompt: list[int], n: int, on_token: Callable[[int], None]) -> None:
        import onnxruntime as ort

        binding = self.session.io_binding()
        names = [(f"past_key_values.{i}.{kind}", f"present.{i}.{kind}")
                 for i in range(self.layers) for kind in ("key", "value")]
        past = {name: ort.OrtValue.ortvalue_from_numpy(self.empty) for name, _ in names}
        feed = np.asarray([prompt], np.int64)
        cached = 0
        for _ in range(n):
            total = cached + feed.shape[1]
            binding.bind_cpu_input("input_ids", feed)
            binding.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
            binding.bind_cpu_input("position_ids", np.arange(cached, total, dtype=np.int64)[None])
            for name, _ in names:
                binding.bind_ortvalue_input(name, past[name])
            binding.bind_output("logits")
            for _, present in names:
                binding.bind_output(present)
            self.session.run_with_iobinding(binding)
            outputs = binding.get_outputs()
            token = int(np.argmax(outputs[0].numpy()[0, -1]))
            past = {name: value for (name, _), value in zip(names, outputs[1:])}
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            on_token(token)
            feed, cached = np.asarray([[token]], np.int64), total


class GenaiEngine(_ThreadedEngine):
    """onnxruntime-genai on the same file (its folder holds our genai_config.json): one
    ``Generator`` per stream, greedy, the model shared."""

    name = "ort_genai"

    def __init__(self, folder: Path, threads: int, streams: int):
        import onnxruntime_genai as og

        super().__init__(streams)
        config = og.Config(str(folder))
        config.clear_providers()  # the CPU
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.og = og
        self.model = og.Model(config)

    def generate(self, prompt: list[int], n: int, on_token: Callable[[int], None]) -> None:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + n, do_sample=False)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.asarray([prompt], np.int32))
        while not generator.is_done():
            generator.generate_next_token()
            on_token(int(generator.get_next_tokens()[0]))


def genai_unavailable_reason() -> str | None:
    """Why onnxruntime-genai cannot take part here (not installed), or None."""
    return common.missing_modules("onnxruntime_genai")


# -- measuring one decoder --------------------------------------------------------------------------
async def _with_ticker(work: Callable[[], Any]) -> tuple[Any, list[float]]:
    """Await ``work()`` with a 1 ms ticker on the loop alongside; its result and the lateness of
    every tick (seconds)."""
    stop = asyncio.Event()
    lags: list[float] = []
    ticker = asyncio.create_task(_ticker(stop, TICK_S, lags))
    try:
        return await work(), lags
    finally:
        stop.set()
        await ticker


def _engines(d: Decoder, folder: Path, threads: int, streams: int, skip: Sequence[str]) -> tuple[dict[str, Engine],
                                                                                                  dict[str, str]]:
    """The contestants that can run, and why the others cannot."""
    engines: dict[str, Engine] = {}
    why: dict[str, str] = {}
    path = folder / "model.onnx"
    engines["asyncinfer"] = AsyncinferEngine(path, threads)
    engines["ort_iobinding"] = OrtIoBindingEngine(path, d, threads, streams)
    if "ort_genai" in skip:
        why["ort_genai"] = "not asked for"
    elif (reason := genai_unavailable_reason()) is not None:
        why["ort_genai"] = reason
    else:
        try:
            engines["ort_genai"] = GenaiEngine(folder, threads, streams)
        except Exception as exc:  # noqa: BLE001 - genai refusing the model is a finding, not a crash
            why["ort_genai"] = f"onnxruntime-genai cannot load the model: {common.error_text(exc)}"
    return engines, why


async def measure_async(d: Decoder, *, tokens: int = 64, streams: int = STREAMS, rounds: int = ROUNDS,
                        threads: int | None = None, skip: Sequence[str] = ()) -> dict[str, Any]:
    """Every engine on decoder ``d``: tokens checked first, then ``rounds`` alternating rounds of
    one stream and of ``streams`` concurrent ones (see the module docstring)."""
    threads = threads or common.default_threads()
    folder = model_dir(d)
    batch = prompts(d, streams)
    load_before = os.getloadavg()[0]  # other tenants of a shared machine skew every figure: say so
    engines, unavailable = _engines(d, folder, threads, streams, skip)
    try:
        # warm-up and the reference: ORT's and asyncinfer's solo tokens for every prompt (the
        # other engines are checked on the first prompt's solo runs and on their concurrent streams)
        solo_tokens = {name: [(await e.solo(p, tokens)).tokens for p in (batch if name in ("asyncinfer", "ort_iobinding")
                                                                          else batch[:1])]
                       for name, e in engines.items()}
        reference = solo_tokens["ort_iobinding"]
        identical = {name: got == reference[:len(got)] for name, got in solo_tokens.items()}
        solo: dict[str, list[StreamTiming]] = {name: [] for name in engines}
        together: dict[str, list[list[StreamTiming]]] = {name: [] for name in engines}
        lags: dict[str, list[float]] = {name: [] for name in engines}
        names = list(engines)
        with common.frozen_heap():
            for round_ in range(rounds):
                shift = round_ % len(names)  # rotate the order: no engine always runs right after another
                order = names[shift:] + names[:shift]
                # A round's solo runs back to back, then its concurrent ones: the engines compared
                # in one round ran seconds apart, under the same state of a shared machine
                for name in order:
                    await asyncio.sleep(common.SETTLE_S)
                    solo[name].append(await engines[name].solo(batch[0], tokens))
                for name in order:
                    await asyncio.sleep(common.SETTLE_S)
                    streams_run, block_lags = await _with_ticker(lambda: engines[name].concurrent(batch, tokens))
                    together[name].append(streams_run)
                    lags[name] += block_lags
        for name in names:  # every solo run equals the reference, every concurrent stream its prompt's solo run
            same = all(run.tokens == reference[0] for run in solo[name])
            same = same and all([s.tokens for s in run] == reference for run in together[name])
            identical[name] = identical[name] and same
        own_solo = all([s.tokens for s in run] == solo_tokens["asyncinfer"] for run in together["asyncinfer"])
    finally:
        for engine in engines.values():
            engine.close()
    result: dict[str, Any] = {"decoder": dict(d.__dict__), "tokens": tokens, "streams": streams, "rounds": rounds,
                              "threads": threads, "prompt_lengths": [len(p) for p in batch],
                              "identical_tokens": identical, "asyncinfer_streams_equal_solo": own_solo,
                              "unavailable": unavailable, "load_average": [load_before, os.getloadavg()[0]],
                              "engines": {}}
    for name in names:
        one = summarize_solo(solo[name])
        many = summarize_concurrent(together[name], lags[name])
        many["x_one_stream"] = many["aggregate_tokens_per_s"] / one["tokens_per_s"]
        result["engines"][name] = {"one_stream": one, f"{streams}_streams": many}
    result["ratios"] = ratios(result["engines"], identical, streams)
    return result


def ratios(engines: dict[str, Any], identical: dict[str, bool], streams: int) -> dict[str, dict[str, float | None]]:
    """asyncinfer / each other engine: per-token time and time to first token of one stream,
    aggregate tokens/s of ``streams``; None where either engine's tokens were not the reference's
    (a ratio over different tokens means nothing).

    Each is the median over the rounds of the round's own ratio: the engines of one round ran
    seconds apart, so a shared machine's slow and fast spells (this VM's speed switches between
    two levels about 25% apart, for every engine alike) cancel within a round instead of landing
    in one engine's median. The ratio of the medians is kept as ``<figure>_of_medians``."""
    ours = engines["asyncinfer"]
    out: dict[str, dict[str, float | None]] = {}
    for name, theirs in engines.items():
        if name == "asyncinfer":
            continue
        trusted = identical["asyncinfer"] and identical[name]
        figures = {"per_token": ("one_stream", "per_token_ms"), "ttft": ("one_stream", "ttft_ms"),
                   "aggregate_tokens_per_s": (f"{streams}_streams", "aggregate_tokens_per_s")}
        out[name] = {}
        for key, (block, figure) in figures.items():
            a, b = ours[block], theirs[block]
            paired = [x / y for x, y in zip(a.get(f"{figure}_rounds", [a[figure]]),
                                            b.get(f"{figure}_rounds", [b[figure]]))]
            out[name][key] = statistics.median(paired) if trusted else None
            out[name][f"{key}_of_medians"] = a[figure] / b[figure] if trusted else None
    return out


def run(models: Sequence[str] = ("gpt2", "llama"), *, tokens: int = 64, streams: int = STREAMS, rounds: int = ROUNDS,
        small: bool = False, threads: int | None = None, skip: Sequence[str] = (),
        verbose: bool = True) -> dict[str, Any]:
    """Measure each decoder named (``small``: the few-layer variants of the quick profile)."""
    table = SMALL if small else DECODERS

    def measure(name: str) -> dict[str, Any]:
        if name not in table:
            raise FileNotFoundError(f"no decoder {name!r}; known: {', '.join(table)}")
        return asyncio.run(measure_async(table[name], tokens=tokens, streams=streams, rounds=rounds, threads=threads,
                                         skip=skip))

    return {"tokens": tokens, "streams": streams, "rounds": rounds, "small": small,
            "threads": threads or common.default_threads(), "models": common.measure_each(models, "generate", measure,
                                                                                            verbose)}


def print_report(result: dict[str, Any]) -> None:
    streams = result["streams"]
    rows = []
    for model, r in result["models"].items():
        if "error" in r:
            rows.append([model, "-", "-", "-", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        for engine, e in r["engines"].items():
            one, many = e["one_stream"], e[f"{streams}_streams"]
            lag = many["loop_lag"]
            rows.append([f"{model} {engine}", one["ttft_ms"], one["per_token_ms"], one["tokens_per_s"],
                         many["aggregate_tokens_per_s"], many["x_one_stream"], lag["p50_ms"], lag["p99_ms"],
                         lag["max_ms"], "" if r["identical_tokens"][engine] else "TOKENS DIFFER"])
        for engine, why in r["unavailable"].items():
            rows.append([f"{model} {engine}", "-", "-", "-", "-", "-", "-", "-", "-", why[:80]])
    common.print_table(["model / engine", "TTFT ms", "ms/token", "tok/s", f"{streams}-stream tok/s", "×1 stream",
                        "lag p50 ms", "lag p99 ms", "lag max ms", "note"], rows,
                       title=f"Greedy generation, {result['tokens']} new tokens, {result['threads']} threads, median "
                             f"of {result['rounds']} rounds; one stream, then {streams} concurrent ones (loop lag of "
                             "a 1 ms ticker meanwhile)")
    for model, r in result["models"].items():
        if "load_average" in r:
            print(f"{model}: 1-minute load average {r['load_average'][0]:.2f} before, {r['load_average'][1]:.2f} after "
                  f"(on {os.cpu_count()} cores)")
        for engine, ratio in r.get("ratios", {}).items():
            cells = ", ".join(f"{k} {common.fmt(v) if v is not None else '- (tokens differ)'}" for k, v in ratio.items()
                              if not k.endswith("_of_medians"))
            print(f"{model}: asyncinfer / {engine}, median of the rounds' ratios: {cells}")
            if (of_medians := ratio.get("per_token_of_medians")) is not None:
                print(f"{model}: asyncinfer / {engine}, per_token as the ratio of the medians: {common.fmt(of_medians)}")


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
# The --quick profile: the small GPT-2-style decoder, a few tokens, one round.
QUICK: dict[str, Any] = {"models": ("gpt2",), "tokens": 8, "rounds": 1, "small": True}
# The floors: per-token time of one stream within 1.2x the ORT IO-binding loop; 8
# concurrent streams at least 4x one stream's tokens/s; loop lag p99 at most 2 ms meanwhile.
PER_TOKEN_FLOOR, CONCURRENT_FLOOR, LAG_FLOOR = 1.2, 4.0, 2.0


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    return common.missing_modules("onnxruntime")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Per model: per-token time / the ORT IO-binding loop's and genai's, N-stream tokens/s as a
    multiple of one stream's, loop lag p99 while they run."""
    figures: dict[str, float | None] = {}
    n = result["streams"]
    for name, r in result["models"].items():
        figures[f"{name} ms/token ×ORT-iobinding"] = common.dig(r, "ratios", "ort_iobinding", "per_token")
        figures[f"{name} ms/token ×genai"] = common.dig(r, "ratios", "ort_genai", "per_token")
        figures[f"{name} {n}-stream tok/s ×1 stream"] = common.dig(r, "engines", "asyncinfer", f"{n}_streams",
                                                                   "x_one_stream")
        figures[f"{name} loop-lag p99 ms"] = common.dig(r, "engines", "asyncinfer", f"{n}_streams", "loop_lag",
                                                       "p99_ms")
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], help="decoders (default: gpt2 llama)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per stream (default 64)")
    parser.add_argument("--streams", type=int, default=STREAMS, help=f"concurrent streams (default {STREAMS})")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds, engines alternating (default {ROUNDS})")
    parser.add_argument("--small", action="store_true", help="the small few-layer decoders (a smoke run)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["ort_genai"], help="engines to leave out")
    common.add_engine_args(parser, "generate.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    result = run(args.models, tokens=args.tokens, streams=args.streams, rounds=args.rounds, small=args.small,
                 threads=args.threads, skip=args.skip)
    return common.report("generate", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
