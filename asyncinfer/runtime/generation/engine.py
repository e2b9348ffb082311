"""The generation engine of one worker: streams joined into batches, one model run per step.

One engine thread per worker (started by the first stream, ended after a while idle) loops over
*steps*. At each step boundary it drops the streams that finished or were cancelled, prefills the
streams that joined (one run each, the prompt alone: no padding), runs one decode step for every
batch, picks each stream's next token on the host from the last row of its logits, and hands it
to the stream. The thread waits on the runs' futures; the event loop never does.

**The KV cache stays where the model put it.** The ``present.*`` values of step t are fed as the
``past_key_values.*`` of step t+1 as they are: NumPy arrays on the CPU (no copy), device values
on gpu_pixel / gpu_compute (the plan's upload step passes a value already on its device through).
Only the logits are read back: one row per stream per decode step (a prefill reads its prompt's
logits once). When a batch changes (a stream joins or leaves), its caches are rebuilt on the host:
left-padded with zeros to a common length and stacked on the batch axis, or the leaving rows
sliced out; on a device that costs one download of the batch's caches per change, never per step.

**Batching.** A model that takes ``attention_mask`` and ``position_ids`` with a free batch axis
runs every stream in one batch: a stream's mask is 0 over its left padding and its positions
count its own tokens, so its tokens do not depend on who else is in the batch (greedy: the same
as alone, up to float rounding in the batched matrix products). Other models (and models without
past, whose padded prompts would attend to nothing) run one stream per run, every stream one step
per round: fair, but without the batching gain.

**A host cache keeps its length within a block** (models that batch: the same left padding).
Between steps the cache is brought to the smallest multiple of `CACHE_BLOCK` columns holding its
longest row (capped by the model's context): a step's one new column is absorbed by dropping a
leading all-padding column (a view, no copy), and once per block the cache is padded by a block
(one copy). The model's own ``Concat`` of past and new appends in place after such a view
(``ops/cache_append.py``), so a step copies only its new column. So consecutive decode steps feed the same input shapes, and **shape specialisation**
applies: the engine keeps its own `ShapePlans` (prompts and decode steps by input signature), so
the shape arithmetic of an exported decoder (about 560 of GPT-2's 885 layers) is computed once per
block instead of every step. Masked columns weigh exactly zero in attention, so a stream's tokens
are those of the unpadded run up to float rounding, as with batching. A cache held on a device is
fed back as it is (no padding, no specialisation): it never leaves the device.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...backends.base import HOST, StepKind
from ...concurrency.bridge import deferred_wakeups
from ...concurrency.future import TaskFuture
from ...concurrency.priority import lower_this_thread
from ...errors import DisposedError, ExecutionError, InputError
from ...model.ir import Model
from ...ops.cache_append import pad_growing
from ...ops.linalg import LastRowMatMul, packing_weights
from ...tensor import reraise
from ..execution import Execution
from ..plan import Plan
from ..specialise import ShapePlans, signature
from .convention import DecoderIO, detect
from .sampling import Sampling, StopMatcher, choose, stop_sequences, token_ids
from .stream import Sequence, TokenStream

#: How long the engine thread waits for new streams before it ends (a new stream restarts it).
IDLE_EXIT_S = 2.0
#: How often a thread waiting on a run checks that the engine was not closed meanwhile.
POLL_S = 0.5
#: A host cache's length is kept at a multiple of this many tokens (see the module docstring):
#: larger blocks copy the cache less often and record fewer signatures, but attend over more padding.
CACHE_BLOCK = 32

Schedule = Callable[[dict[str, TaskFuture], Plan | None, bool, Callable[[Execution], None]], Execution]


@dataclass(frozen=True)
class GenerationStats:
    """Counters of a worker's generation (a snapshot: `Worker.generation_stats()`).

    Attributes:
        runs: model runs scheduled: one per prompt, then one per step for each batch.
        tokens: tokens chosen, all streams together.
        active: streams running now.
        largest_batch: the most streams one run has served.
        cache_bytes: bytes of KV cache held now (a stream's goes once it ends).
        batching: whether this model's streams share runs (continuous batching).
        why_unbatched: when they do not, why.
    """

    runs: int
    tokens: int
    active: int
    largest_batch: int
    cache_bytes: int
    batching: bool
    why_unbatched: str


class _Batch:
    """Streams that share runs: one row each, all left-padded to ``length`` cached tokens."""

    def __init__(self, rows: list[Sequence], feed: np.ndarray, mask: np.ndarray, past: list[Any] | None,
                 ids: np.ndarray | None):
        self.rows = rows
        self.feed = feed          # [rows, T] token ids this step feeds (the prompt, then one per step)
        self.mask = mask          # [rows, length]: 1 over each row's cached tokens, 0 over its padding
        self.past = past          # cache values in DecoderIO.cache order ([rows, heads, length, size])
        self.ids = ids            # no-past models: [rows, length] the tokens so far (left-padded)
        self.past_device: Any = None  # the backend holding ``past`` when it is not on the host
        self.run_mask: np.ndarray | None = None  # ``mask`` with the run's tokens: the next ``mask``
        self.execution: Execution | None = None

    @property
    def length(self) -> int:
        return self.mask.shape[1]


class GenerationEngine:
    """Runs the generation streams of one worker (see the module docstring)."""

    def __init__(self, model: Model, plan: Plan, schedule: Schedule):
        self.model = model
        self.io: DecoderIO = detect(model)
        self.batching = self.io.batchable and self.io.has_past
        self._plan = last_row_logits(plan, self.io).for_serial_runs()  # its runs are serial
        # Only a batching model's runs repeat their input shapes (its cache kept to blocks).
        self._shapes = ShapePlans(self._plan) if self.batching else None
        self._schedule = schedule
        # where the outputs read every step come from (25 a GPT-2 step): (ref, device or None)
        self._output_sources = {name: self._source(name) for name in [self.io.logits, *(c.present for c in self.io.cache)]}
        self._cond = threading.Condition()
        self._joining: list[Sequence] = []
        self._batches: list[_Batch] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._runs = self._tokens = self._largest = 0

    # -- the caller's side ---------------------------------------------------------------------
    def submit(self, prompt_ids: Any, *, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, eos_token_id: Any = None,
               stop: Any = None) -> TokenStream:
        """Check the request and start its stream (see ``Worker.generate``)."""
        prompt = self._prompt(prompt_ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise InputError(f"seed must be a non-negative integer or None, got {seed!r}")
        sequence = Sequence(prompt, max_new_tokens=int(max_new_tokens),
                            sampling=Sampling.checked(temperature, top_k, top_p), seed=seed,
                            eos=frozenset(() if eos_token_id is None else token_ids(eos_token_id, "eos_token_id")),
                            stop=StopMatcher(stop_sequences(stop)), on_cancel=self._cancelled)
        with self._cond:
            if self._closed:
                raise DisposedError("this worker was disposed")
            self._joining.append(sequence)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="asyncinfer-generate", daemon=True)
                self._thread.start()
            self._cond.notify()
        return TokenStream(sequence)

    def _prompt(self, prompt_ids: Any) -> np.ndarray:
        ids = token_ids(prompt_ids.tolist() if isinstance(prompt_ids, np.ndarray) else prompt_ids, "prompt_ids")
        if not ids:
            raise InputError("prompt_ids is empty: give at least one token id")
        self.model.limits.check_shape((1, len(ids)), f"prompt of {len(ids)} tokens")
        io = self.io
        if io.vocab_size is not None and max(ids) >= io.vocab_size:
            raise InputError(f"prompt_ids holds token id {max(ids)}, beyond the model's vocabulary of {io.vocab_size}")
        if io.max_context is not None and len(ids) > io.max_context:
            raise InputError(f"the prompt has {len(ids)} tokens, more than the model's context of {io.max_context}")
        return np.asarray(ids, dtype=io.ids_dtype)

    def stats(self) -> GenerationStats:
        with self._cond:
            batches = list(self._batches)
            active = sum(not s.finished for s in self._joining) + sum(not s.finished for b in batches for s in b.rows)
            return GenerationStats(self._runs, self._tokens, active, self._largest,
                                   sum(_nbytes(v) for b in batches for v in (b.past or ())),
                                   self.batching, "" if self.batching else
                                   (self.io.why_unbatched or "it has no past (every step recomputes the prefix)"))

    def _cancelled(self, sequence: Sequence) -> None:
        """A stream was cancelled: cancel its run in flight if no live stream shares it, and
        wake the engine so its cache goes at the next step boundary."""
        with self._cond:
            batch = sequence.group
            if isinstance(batch, _Batch) and batch.execution is not None and all(s.cancelled for s in batch.rows):
                batch.execution.cancel()
            self._cond.notify()

    def close(self) -> None:
        """End every stream with a `DisposedError` and stop the thread (the worker is disposed)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            for batch in self._batches:
                if batch.execution is not None:
                    batch.execution.cancel()
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        self._fail_all()

    def _fail_all(self) -> None:
        with self._cond:
            streams = list(self._joining) + [s for b in self._batches for s in b.rows]
            self._joining, self._batches = [], []
        for sequence in streams:
            sequence.fail(DisposedError("the worker was disposed while this stream was generating"))

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        lower_this_thread()  # it runs decode steps: a compute thread (concurrency/priority.py)
        try:
            while True:
                with self._cond:
                    while not self._joining and not self._batches and not self._closed:
                        if not self._cond.wait(IDLE_EXIT_S) and not self._joining and not self._batches:
                            self._thread = None
                            return
                    if self._closed:
                        return
                    joining, self._joining = self._joining, []
                self._step(joining)
        except BaseException as exc:  # a bug here must not leave streams waiting forever
            with self._cond:
                self._thread = None
            error = exc if isinstance(exc, Exception) else ExecutionError(f"generation stopped: {exc!r}")
            with self._cond:
                streams = list(self._joining) + [s for b in self._batches for s in b.rows]
                self._joining, self._batches = [], []
            for sequence in streams:
                sequence.fail(error)
            if not isinstance(exc, Exception):
                raise

    def _step(self, joining: list[Sequence]) -> None:
        """One step boundary: drop what ended, prefill who joined, decode every batch once."""
        self._drop_ended()
        fresh = [self._new_batch(s) for s in joining if not s.cancelled]
        with self._cond:  # listed at once: stats count them, close() cancels their runs
            self._batches = fresh + self._batches
            batches = list(self._batches)
        # This thread would only wait for the step's runs, so it runs them itself, one after
        # another (no hand-off to a pool thread and back): a batching model's (the decode batch
        # and the prompts that joined: GPT-2, 8 prompts started together on two lanes took 0.5 s
        # where 8 in turn take 0.35, their GEMMs' parts no longer queueing behind each other),
        # or a lone run. Several streams of a model that cannot batch start together, on the
        # pool's lanes.
        here = self.batching or len(batches) == 1
        for batch in batches:
            # a batched decode step's GEMMs pack their weights (ops/compiled/panels.py)
            with packing_weights() if here and len(batch.rows) > 1 else nullcontext():
                self._start(batch, here)
        kept = [b for b in batches if self._finish(b)]
        with self._cond:
            self._batches = kept
        self._drop_ended()
        if self.batching and len(self._batches) > 1:
            merged = _merge(list(self._batches), self._host_past)
            with self._cond:
                self._batches = [merged]

    def _new_batch(self, sequence: Sequence) -> _Batch:
        io = self.io
        prompt = sequence.prompt[None, :]
        empty = np.zeros((1, 0), np.int8)
        past = [np.zeros((1, c.heads, 0, c.head_size), c.dtype) for c in io.cache] if io.has_past else None
        batch = _Batch([sequence], prompt, empty, past, None if io.has_past else np.zeros((1, 0), io.ids_dtype))
        sequence.group = batch
        return batch

    def _fit_cache(self, batch: _Batch) -> None:
        """Bring a host cache (of a batching model) to the length of its block: drop leading
        all-padding columns (views) or pad on the left (a copy), see the module docstring."""
        if not self.batching or batch.past_device is not None or not batch.past or batch.length == 0:
            return
        steps = batch.feed.shape[1]
        needed = int(batch.mask.sum(axis=1).max())  # the longest row's cached tokens
        target = -(-needed // CACHE_BLOCK) * CACHE_BLOCK
        if self.io.max_context is not None:  # never past the context, whose tables end there
            target = max(needed, min(target, self.io.max_context - steps))
        length = batch.length
        if target < length:  # rows are right-aligned: the leading length - needed columns are padding
            drop = length - target
            batch.mask = batch.mask[:, drop:]
            batch.past = [v[:, :, drop:] for v in batch.past]
        elif target > length:
            pad = target - length
            batch.mask = np.pad(batch.mask, ((0, 0), (pad, 0)))
            # (into a buffer with room: the step's Concat appends in place instead of copying it again)
            batch.past = [pad_growing(np.asarray(v), pad, axis=2) for v in batch.past]

    def _inputs(self, batch: _Batch) -> dict[str, TaskFuture]:
        io = self.io
        rows, steps = batch.feed.shape
        mask = batch.run_mask = np.concatenate([batch.mask, np.ones((rows, steps), np.int8)], axis=1)
        values: dict[str, Any] = {}
        if io.has_past:
            values[io.input_ids] = batch.feed
            start = batch.mask.sum(axis=1, dtype=np.int64)[:, None]  # each row's own token count
            positions = start + np.arange(steps, dtype=np.int64)[None, :]
            for cache, value in zip(io.cache, batch.past):  # type: ignore[arg-type]
                values[cache.name] = value
            if io.use_cache_branch is not None:
                values[io.use_cache_branch] = np.array([batch.length > 0])
        else:
            values[io.input_ids] = np.concatenate([batch.ids, batch.feed], axis=1)  # type: ignore[list-item]
            positions = np.maximum(np.cumsum(mask, axis=1, dtype=np.int64) - 1, 0)
        if io.attention_mask is not None:
            values[io.attention_mask] = mask.astype(io.mask_dtype)
        if io.position_ids is not None:
            values[io.position_ids] = positions.astype(io.positions_dtype)
        return {name: TaskFuture.completed([value], label=name) for name, value in values.items()}

    def _start(self, batch: _Batch, here: bool = False) -> None:
        """Schedule ``batch``'s run (``here``: run it on this thread, see `_step`)."""
        def submitted(execution: Execution) -> None:  # before any layer runs: cancellable from now
            with self._cond:
                batch.execution = execution
                self._runs += 1
                if batch.feed.shape[1] == 1:
                    self._largest = max(self._largest, len(batch.rows))
                if all(s.cancelled for s in batch.rows):  # cancelled while it was being scheduled
                    execution.cancel()
            if observe is not None:  # the first run of its signature records its shape values
                self._shapes.observe(observe, execution.step_future)

        observe = None
        try:
            self._fit_cache(batch)
            futures = self._inputs(batch)
            plan = self._plan
            if self._shapes is not None and self._shapes.enabled and batch.past_device is None:
                plan, observe = self._shapes.plan_for(signature(futures))
            self._schedule(futures, plan, here, submitted)
        except Exception as exc:  # noqa: BLE001 - e.g. the worker was disposed: the streams get it
            for sequence in batch.rows:
                sequence.fail(exc)
            batch.execution = None

    def _finish(self, batch: _Batch) -> bool:
        """Wait for ``batch``'s run, give every row its token; False when the batch is gone."""
        execution = batch.execution
        if execution is None:
            return False
        try:
            logits = self._last_logits(execution)
        except Exception as exc:  # noqa: BLE001 - the run failed: its streams end with the error
            with self._cond:
                batch.execution = None
            if self._closed:  # the run was cancelled by the worker's disposal: say so
                exc = DisposedError("the worker was disposed while this stream was generating")
            for sequence in batch.rows:
                sequence.fail(exc)  # (a cancelled stream has ended already: no-op)
            return False
        io = self.io
        with self._cond:
            batch.execution = None
        batch.mask = batch.run_mask  # (its run's mask: the same columns, one more per token fed)
        if io.has_past:
            batch.past, batch.past_device = self._presents(execution)
        else:
            batch.ids = np.concatenate([batch.ids, batch.feed], axis=1)  # type: ignore[list-item]
        counts = batch.mask.sum(axis=1)
        with self._cond:  # counted before any stream sees its token: a reader's stats include it
            self._tokens += len(batch.rows)
        chosen = np.empty((len(batch.rows), 1), dtype=io.ids_dtype)
        greedy = np.argmax(logits, axis=-1)
        with deferred_wakeups():  # the streams' readers' loops woken once, after every row's token
            for i, sequence in enumerate(batch.rows):
                token = int(greedy[i]) if sequence.sampling.greedy else choose(logits[i], sequence.sampling, sequence.rng)
                chosen[i, 0] = token
                if not sequence.cancelled:
                    sequence.add(token, io.max_context is not None and int(counts[i]) >= io.max_context)
        batch.feed = chosen
        return True

    def _wait(self, future: TaskFuture) -> None:
        while not future.wait(POLL_S):
            if self._closed:
                raise DisposedError("the worker was disposed while this stream was generating")

    def _output(self, execution: Execution, name: str) -> tuple[Any, Any]:
        """The value of output ``name`` once computed, and the device backend holding it (None: host)."""
        ref, device = self._output_sources[name]
        future = execution.futures[ref[0]]
        if not future.done():  # type: ignore[union-attr]
            self._wait(future)  # type: ignore[arg-type]
        if future.failed():  # type: ignore[union-attr]
            raise reraise(future.exception(), name)  # type: ignore[union-attr]
        return future.peek()[ref[1]], device  # type: ignore[union-attr]

    def _source(self, name: str) -> tuple[Any, Any]:
        """Output ``name``'s ref in the plan, and the device backend holding it (None: the host)."""
        ref = self._plan.refs[name]
        backend = self._plan.nodes[ref[0]].backend if ref[0] < len(self._plan.nodes) else None
        return ref, (backend if backend is not None and backend.device != HOST else None)

    def _last_logits(self, execution: Execution) -> np.ndarray:
        """The last row of logits of each stream, ``[rows, vocab]``, on the host."""
        value, device = self._output(execution, self.io.logits)
        if device is not None:
            value = self._download(device, value)
        array = np.asarray(value)
        if array.ndim != 3:
            raise ExecutionError(f"output {self.io.logits!r} has shape {array.shape}; generation needs "
                                 "[batch, sequence, vocab]")
        return array[:, -1, :]

    def _download(self, device: Any, value: Any) -> np.ndarray:
        download = device.start_download(value)
        self._wait(download)
        if download.failed():
            raise reraise(download.exception(), "download")
        return download.peek()

    def _presents(self, execution: Execution) -> tuple[list[Any], Any]:
        """The ``present.*`` values as they are (no copy), and the device holding them (None:
        the host; a cache split between host and device is brought to the host)."""
        outputs = [self._output(execution, cache.present) for cache in self.io.cache]
        devices = {device for _, device in outputs}
        if len(devices) == 1:
            return [value for value, _ in outputs], devices.pop()
        return [value if device is None else self._download(device, value) for value, device in outputs], None

    def _host_past(self, batch: _Batch) -> list[np.ndarray]:
        """``batch``'s cache on the host (downloaded from its device when it is there)."""
        if batch.past_device is None:
            return [np.asarray(v) for v in batch.past]  # type: ignore[union-attr]
        downloads = [batch.past_device.start_download(v) for v in batch.past]  # type: ignore[union-attr]
        values = []
        for download in downloads:
            self._wait(download)
            if download.failed():
                raise reraise(download.exception(), "KV cache")
            values.append(download.peek())
        return values

    def _drop_ended(self) -> None:
        """Take the rows of ended streams out of their batches (their caches go with them)."""
        changed = []
        for batch in list(self._batches):
            keep = [i for i, s in enumerate(batch.rows) if not s.finished]
            if len(keep) < len(batch.rows):
                changed.append((batch, keep))
        for batch, keep in changed:
            for i, sequence in enumerate(batch.rows):
                if i not in keep:
                    sequence.group = None
            if not keep:
                with self._cond:
                    self._batches.remove(batch)
                continue
            _keep_rows(batch, keep, self._host_past(batch) if batch.past is not None else None)


def last_row_logits(plan: Plan, io: DecoderIO) -> Plan:
    """``plan`` with its logits layer multiplying only the last position's row (`LastRowMatMul`):
    the engine reads nothing else, and a prompt's logits are its largest product (a 16-token
    GPT-2 prompt: 16 rows by 768 x 50257). Only where that is the same computation: a host MatMul
    of a constant matrix whose output no layer reads. Else ``plan`` itself."""
    ref = plan.refs.get(io.logits)
    if ref is None or ref[0] >= len(plan.nodes):
        return plan
    node = plan.nodes[ref[0]]
    layer = node.layer
    weight = plan.model.constants.get(layer.inputs[1]) if len(layer.inputs) == 2 else None
    if (node.step.kind is not StepKind.LAYER or node.backend.device != HOST or layer.op_type != "MatMul"
            or layer.domain or np.ndim(weight) != 2 or any(ref in n.inputs for n in plan.nodes)):
        return plan
    return plan.with_op(ref[0], LastRowMatMul(layer, plan.model.limits))


def _keep_rows(batch: _Batch, keep: list[int], past: list[np.ndarray] | None) -> None:
    """Slice ``batch`` down to rows ``keep``, then drop the leading columns all of them pad."""
    rows = np.asarray(keep)
    mask = batch.mask[rows]
    filled = mask.any(axis=0)
    start = int(np.argmax(filled)) if filled.any() else mask.shape[1]
    batch.rows = [batch.rows[i] for i in keep]
    batch.mask = mask[:, start:]
    batch.feed = batch.feed[rows]
    if past is not None:
        batch.past = [np.ascontiguousarray(v[rows][:, :, start:]) for v in past]
        batch.past_device = None
    if batch.ids is not None:
        batch.ids = batch.ids[rows][:, start:]


def _merge(batches: list[_Batch], host_past: Callable[[_Batch], list[np.ndarray]]) -> _Batch:
    """One batch of every row of ``batches``, left-padded to the longest cache."""
    length = max(b.length for b in batches)
    rows: list[Sequence] = []
    masks, feeds, pasts = [], [], []
    for batch in batches:
        pad = length - batch.length
        rows += batch.rows
        masks.append(np.pad(batch.mask, ((0, 0), (pad, 0))))
        feeds.append(batch.feed)
        pasts.append([np.pad(v, ((0, 0), (0, 0), (pad, 0), (0, 0))) for v in host_past(batch)])
    merged = _Batch(rows, np.concatenate(feeds), np.concatenate(masks),
                    [np.concatenate(values) for values in zip(*pasts)], None)
    for sequence in rows:
        sequence.group = merged
    return merged


def _nbytes(value: Any) -> int:
    nbytes = getattr(value, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    return int(np.prod(shape)) * np.dtype(dtype).itemsize if shape is not None and dtype is not None else 0
