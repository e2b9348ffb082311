"""``Worker``: runs a model on a backend (Sentis's ``Worker``), with sync and async lifecycles."""
from __future__ import annotations

import enum
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..backends import Backend, BackendType, CPUBackend, create_backend, parse_backend_type
from ..concurrency import bridge
from ..errors import AsyncInferError, DisposedError
from ..model.ir import Model
from ..tensor import Tensor
from .execution import Execution
from .generation import GenerationEngine, GenerationStats, TextStream, TokenizerSource, TokenStream
from .generation.text import stop_strings
from .inputs import bind_inputs, example_inputs
from .outputs import OutputPlans
from .specialise import ShapePlans, signature
from .plan import Placement, Plan
from .profiling import Profile, RunRecorder
from .tuning import QuickRuns, RunModeTuner, mode_requested, run_mode


#: How long ``warmup()`` keeps running the model, after its first run (which pays the kernels'
#: loading), for the worker to choose serial or parallel runs (runtime/tuning.py); when it runs
#: out first, the choice is made from the runs timed so far (`RunModeTuner.settle`), so the
#: first request after ``warmup()`` runs as the steady state does.
WARMUP_TUNING_S = 1.0


class WorkerState(enum.Enum):
    """A worker's lifecycle: open until [`Worker.dispose`][asyncinfer.Worker.dispose], then disposed for good."""

    OPEN = "open"
    DISPOSED = "disposed"


class Worker:
    """Runs ``model`` on ``backend``; layers the backend lacks fall back to the CPU.

    Scheduling returns at once; outputs are read back when the caller awaits, polls or is called
    back. ``run`` is safe to call concurrently: each call has its own task graph.

    Every scheduling call (``schedule``, ``schedule_iterable``, ``run``…) takes two keyword-only
    options besides the inputs: ``outputs=[names]`` returns those values of the graph instead of
    the model's outputs (intermediate values included, kept alive for that run only), and
    ``profile=`` records that run's steps in a `Profile`. An input that happens to be
    named ``outputs`` or ``profile`` is given positionally or in a mapping.

    Args:
        model: a model from [`asyncinfer.load_model`][asyncinfer.load_model].
        backend: a [`BackendType`][asyncinfer.BackendType] or its name (``"cpu"``, ``"gpu_compute"``,
            ``"gpu_pixel"``), or a backend instance built with options (e.g.
            ``CuPyBackend(device_id=1)``); the worker owns it from then on and closes it when disposed.
        threads: CPU thread-pool size (default: the core count).
        warmup: run the model once now, on inputs built from its declared shapes, so the first
            real request runs at steady-state speed. The constructor cannot await: it blocks the
            calling thread for that one run (on an event loop, prefer ``await worker.warmup()``
            after construction). If the run fails, the worker is disposed and the error raised.

    Raises:
        BackendUnavailableError: the backend cannot run on this machine (says what is missing).
        InputError: ``warmup=True`` on a model whose example inputs cannot be made up (see
            `warmup()`).
        TypeError, ValueError: ``threads`` is not a positive integer.
    """

    def __init__(self, model: Model, backend: BackendType | str | Backend = BackendType.CPU, *,
                 threads: int | None = None, warmup: bool = False):
        self.model = model
        if isinstance(backend, Backend):
            self.backend_type = parse_backend_type(backend.name)
            self._backend = backend
        else:
            self.backend_type = parse_backend_type(backend)
            self._backend = create_backend(self.backend_type, threads=threads)
        self._fallback = None if isinstance(self._backend, CPUBackend) else CPUBackend(threads)
        try:
            self._plan = Plan(model, self._backend, self._fallback)
        except BaseException:
            self._close_backends()
            raise
        self._plans = OutputPlans(self._plan)
        self._shape_plans = ShapePlans(self._plan)
        # serial or parallel runs, chosen by timing both (runtime/tuning.py); device backends'
        # runs stay parallel (their steps are queued on the device, not run by the pool)
        self._run_mode = RunModeTuner(run_mode(mode_requested(), self._plan)
                                      if isinstance(self._backend, CPUBackend) else "parallel")
        # awaited runs quick enough to take their steps on the loop's thread (runtime/tuning.py)
        self._quick_runs = QuickRuns() if isinstance(self._backend, CPUBackend) else None
        self._profiles: tuple[Profile, ...] = ()  # attached by profile(): every run records into them
        self._latest: Execution | None = None
        self._owned_runs: weakref.WeakSet[Execution] = weakref.WeakSet()
        self._generation: GenerationEngine | None = None  # made by the first generate()
        self._tokenizer: TokenizerSource | None = None  # found by the first generate_text()
        self._state_lock = threading.Lock()
        self._state = WorkerState.OPEN
        if warmup:
            try:
                self.warmup_blocking()
            except BaseException:
                self.dispose()  # the caller never gets the worker: its threads must not outlive this
                raise

    # -- introspection -------------------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        """Which backend runs each layer, the CPU-fallback layers and the transfers they cost."""
        return self._plan.placement

    @property
    def state(self) -> WorkerState:
        """Where the worker is in its lifecycle."""
        return self._state

    @property
    def disposed(self) -> bool:
        """True once [`dispose`][asyncinfer.Worker.dispose] (or [`dispose_async`][asyncinfer.Worker.dispose_async])
        ran; the worker then refuses all calls."""
        return self._state is WorkerState.DISPOSED

    def _check_open(self) -> None:
        if self._state is WorkerState.DISPOSED:
            raise DisposedError("this worker was disposed")

    # -- scheduling -----------------------------------------------------------------------------------
    def schedule(self, *inputs: Any, outputs: Sequence[str] | None = None, profile: Profile | None = None,
                 **named: Any) -> Execution:
        """Schedule a run and return at once.

        Inputs are positional in model order, one mapping ``{name: array | Tensor}``, or keywords.
        They are checked against the model's declared (symbolic) shapes before anything is scheduled.

        Args:
            outputs: names of the values this run returns (``execution.outputs``,
                ``peek_output(name)``) instead of the model's outputs: any value of the optimized
                graph, intermediate ones included. They are kept alive for this run only; the
                model's outputs stay readable too. Every layer still runs.
            profile: record this run's steps in this `Profile` (besides any profile
                attached with `profile()`).

        Raises:
            InputError: a missing, extra, wrongly typed or wrongly shaped input; an output name
                the graph does not hold (the message says if the optimizer fused it away).
        """
        execution = self._new_execution(inputs, named, outputs, profile, self._run_mode.begin(timed=False).serial)
        execution.submit_all()
        self._latest = execution
        return execution

    def schedule_iterable(self, *inputs: Any, outputs: Sequence[str] | None = None,
                          profile: Profile | None = None, **named: Any) -> Iterator[str]:
        """Schedule one layer per step, yielding the name of the layer just scheduled.

        Inputs are checked when this is called, before the first step. Outputs can be peeked once
        the iteration is over. ``outputs`` and ``profile`` are those of `schedule()`.
        """
        self._run_mode.begin(timed=False)  # (runs its steps as they are scheduled: never serial)
        execution = self._new_execution(inputs, named, outputs, profile)

        def steps() -> Iterator[str]:
            self._latest = execution
            for step in execution.submit_iter():
                yield step.layer.name

        return steps()

    def schedule_iterable_async(self, *inputs: Any, outputs: Sequence[str] | None = None,
                                profile: Profile | None = None, **named: Any) -> AsyncIterator[str]:
        """Async form of [`schedule_iterable`][asyncinfer.Worker.schedule_iterable]: ``async for name in ...``
        schedules one layer per step and lets the event loop run other tasks between layers. Stopping early
        (``break``, cancellation) fails the layers never scheduled, so no output is left pending forever."""
        self._run_mode.begin(timed=False)
        execution = self._new_execution(inputs, named, outputs, profile)

        async def steps() -> AsyncIterator[str]:
            self._latest = execution
            iterator = execution.submit_iter()
            try:
                for step in iterator:
                    yield step.layer.name
                    await bridge.checkpoint()
            finally:
                iterator.close()

        return steps()

    def _new_execution(self, inputs: tuple, named: dict, outputs: Sequence[str] | None = None,
                       profile: Profile | None = None, serial: bool = False, borrow: bool = False) -> Execution:
        """A run of these inputs; ``serial``: its steps one after another (see runtime/tuning.py);
        ``borrow``: read the input arrays in place (a run the caller waits for, see `bind_inputs`),
        and, as it hands the caller only its outputs, let its steps write over values no later
        step reads (`Execution.private`)."""
        self._check_open()
        plan = self._plan if outputs is None else self._plans.get(outputs)
        if profile is not None and not isinstance(profile, Profile):
            raise TypeError(f"profile must be an asyncinfer.Profile, got {type(profile).__name__}")
        futures = bind_inputs(self.model, inputs, named, borrow)
        # the input signature, what both the shape plans and the quick-run choice go by (once a run)
        key = signature(futures) if self._shape_plans.enabled or self._quick_runs is not None else None
        observed = None
        if outputs is None and self._shape_plans.enabled:  # the shape arithmetic, once per input signature
            plan, observed = self._shape_plans.plan_for(key)
        if serial:
            plan = plan.for_serial_runs()
        # (a run the caller waits for sees only its outputs: its steps may write over dead values)
        execution = Execution(plan, futures, worker=self, recorder=self._recorder(profile), serial=serial,
                              private=borrow, signature=key)
        if observed is not None:
            execution.on_submitted(lambda: self._shape_plans.observe(observed, execution.step_future))
        return execution

    def _recorder(self, profile: Profile | None) -> RunRecorder | None:
        profiles = self._profiles if profile is None else (*self._profiles, profile)
        return RunRecorder(dict.fromkeys(profiles), self.model.name, self.backend_type.value) if profiles else None

    def _latest_execution(self) -> Execution:
        self._check_open()
        if self._latest is None:
            raise AsyncInferError("nothing scheduled yet: call schedule() first")
        return self._latest

    def peek_output(self, name: str | None = None) -> Tensor:
        """An output of the latest ``schedule`` (the first by default), possibly pending.

        It belongs to the worker: valid until the worker's next ``schedule`` or its disposal.
        """
        return self._latest_execution().peek_output(name)

    def take_output(self, name: str | None = None) -> Tensor:
        """Like ``peek_output``, but the caller owns the tensor (it survives the worker)."""
        return self._latest_execution().take_output(name)

    async def run(self, *inputs: Any, outputs: Sequence[str] | None = None, profile: Profile | None = None,
                  **named: Any) -> dict[str, np.ndarray]:
        """Schedule a run, await every output without blocking the loop, and return them as arrays.

        With ``outputs=[names]``, the values of those names, in that order (any value of the
        graph: see `schedule()`); ``profile`` records the run's steps in a `Profile`.
        Cancelling the awaiting task skips the layers that have not started.

        NumPy input arrays are read in place, not copied, as ONNX Runtime's ``run`` reads them:
        do not change one from another task or thread until the call returns (`schedule()`
        copies its inputs). A cancelled run's layers already running may still read them after.

        On the cpu backend, a run whose inputs' shapes measured at most 1 ms takes its steps on
        the loop's thread after yielding to it once: cheaper for the loop than handing it to a
        pool thread and back (see "How a model runs"; ``ASYNCINFER_QUICK_RUN_US``).
        """
        with self._run_mode.timed() as trial:
            start = time.perf_counter()
            execution = self._new_execution(inputs, named, outputs, profile, trial.serial, borrow=True)
            quick = self._quick_key(execution, outputs)
            here = quick is not None and not self._run_mode.deciding and self._quick_runs.here(quick)  # type: ignore[union-attr]
            if here:  # no hand-off to the pool and back (see tuning.QuickRuns)
                await bridge.checkpoint()  # the loop's other tasks go first, as if it were handed off
                start = time.perf_counter()  # (the run's own time: not the other tasks')
                self._backend.submit_here(execution.submit_all)
            else:
                execution.submit_all()
            try:
                arrays = await execution.read_outputs()
            except BaseException:
                execution.cancel()
                raise
            if quick is not None and profile is None and not self._profiles:  # (a profile's runs are slower)
                self._quick_runs.ran(quick, here, time.perf_counter() - start)  # type: ignore[union-attr]
            return arrays

    def _quick_key(self, execution: Execution, outputs: Sequence[str] | None) -> tuple | None:
        """What the quick-run choice of ``execution`` goes by (its input signature and
        ``outputs``), or None if it is no candidate (not on the cpu backend, or an input still
        pending)."""
        if self._quick_runs is None:
            return None
        key = execution.signature
        return None if key is None else (None if outputs is None else tuple(outputs), key)

    def run_blocking(self, *inputs: Any, outputs: Sequence[str] | None = None, profile: Profile | None = None,
                     **named: Any) -> dict[str, np.ndarray]:
        """Blocking twin of [`run`][asyncinfer.Worker.run]: waits on the calling thread, which meanwhile runs the
        run's first ready work on the cpu backend (no hand-off to a pool thread and back). Do not call it on an
        event loop. Its input arrays are read in place too (do not change them from another thread meanwhile)."""
        with self._run_mode.timed() as trial:
            execution = self._new_execution(inputs, named, outputs, profile, trial.serial, borrow=True)
            self._backend.submit_here(execution.submit_all)  # this thread waits anyway: it may run the first work
            return execution.read_outputs_blocking()

    async def warmup(self, *inputs: Any, **named: Any) -> None:
        """Run the model and discard the results, so the first real request finds the thread
        pool started, the allocator's pages warm and the kernels' scratch buffers made. On the
        cpu backend, for a model with branches, it also runs the model until the worker has timed
        its runs step after step against branches side by side and kept the faster (about a dozen
        runs, for at most `WARMUP_TUNING_S` seconds after the first, then it chooses from the runs
        timed by then; a model of one path runs step after step untuned; see the "How a model
        runs" docs).

        With no inputs, zeros of each input's declared type and shape are used (a symbolic or
        unknown dimension counts as 1); give example inputs for models whose layers depend on input
        values, or whose batch size changes what runs (warm up with the size you will serve).

        Raises:
            InputError: the example inputs do not fit the model, or none were given and an input's
                cannot be made up (a sequence input, or one whose rank is not declared).
            ExecutionError: the model failed on them (give example inputs that it accepts).
        """
        inputs = self._warmup_inputs(inputs, named)
        await self.run(*inputs, **named)
        start = time.perf_counter()
        while self._run_mode.deciding and time.perf_counter() - start < WARMUP_TUNING_S:
            await self.run(*inputs, **named)
        self._run_mode.settle()
        for _ in range(2):  # a quick model's first run on the loop's thread (tuning.QuickRuns)
            if self._quick_runs is None or self._quick_runs.settled():
                break
            await self.run(*inputs, **named)

    def _warmup_inputs(self, inputs: tuple, named: dict) -> tuple:
        """The positional inputs a warm-up runs: those given, or made-up examples when none were
        given at all (neither positionally nor by name)."""
        return inputs if inputs or named else (example_inputs(self.model),)

    def warmup_blocking(self, *inputs: Any, **named: Any) -> None:
        """Blocking twin of [`warmup`][asyncinfer.Worker.warmup]. Do not call it on an event loop."""
        inputs = self._warmup_inputs(inputs, named)
        self.run_blocking(*inputs, **named)
        start = time.perf_counter()
        while self._run_mode.deciding and time.perf_counter() - start < WARMUP_TUNING_S:
            self.run_blocking(*inputs, **named)
        self._run_mode.settle()

    # -- generation -----------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 stop: Sequence[int] | Sequence[Sequence[int]] | None = None) -> TokenStream:
        """Generate tokens from a decoder model, streamed as they come: returns at once.

        ```python
        async for token in worker.generate(prompt_ids, max_new_tokens=32):
            ...
        tokens = await worker.generate(prompt_ids, max_new_tokens=32).collect()
        ```

        Concurrent streams on one worker share its runs (continuous batching); the KV cache stays
        on the worker's backend between steps. See the "Streaming generation" page of the docs for
        the model conventions understood, batching and cancellation.

        Args:
            prompt_ids: the prompt's token ids.
            max_new_tokens: stop after this many tokens (or when the model's context is full).
            temperature: 0 picks the most likely token (greedy); above, tokens are sampled from the
                logits divided by it.
            top_k: sample among the ``top_k`` most likely tokens only.
            top_p: sample among the smallest set of most likely tokens whose probability reaches it.
            seed: the stream's own random generator (the same seed gives the same tokens).
            eos_token_id: token id(s) that end the stream (not yielded).
            stop: token-id sequence(s) that end the stream (not yielded; tokens that may begin one
                are held back until they cannot).

        Raises:
            InputError: a bad option or prompt (empty, an id beyond the vocabulary, longer than the
                model's context), or a model that fits no decoder convention (the message names
                what is missing).
        """
        return self._generation_engine().submit(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                                top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                                                stop=stop)

    def generate_blocking(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                          top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                          eos_token_id: int | Sequence[int] | None = None,
                          stop: Sequence[int] | Sequence[Sequence[int]] | None = None) -> list[int]:
        """Blocking twin of [`generate`][asyncinfer.Worker.generate]: waits on the calling thread for the whole
        stream and returns its tokens (``generate(...).collect_blocking()``; iterate ``generate(...)``
        with a plain ``for`` to stream them on a thread). Do not call it on an event loop."""
        return self.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, eos_token_id=eos_token_id, stop=stop).collect_blocking()

    def generate_text(self, prompt: str | Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                      top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                      eos_token_id: int | Sequence[int] | None = None, stop: str | Sequence[str] | None = None,
                      tokenizer: Any = None, add_special_tokens: bool = True,
                      skip_special_tokens: bool = True) -> TextStream:
        """Generate text from a decoder model, streamed in decoded pieces: returns at once.

        ```python
        async for piece in worker.generate_text("Once upon a time", max_new_tokens=64):
            print(piece, end="", flush=True)
        text = await worker.generate_text("Once upon a time", max_new_tokens=64).collect()
        ```

        Needs the ``tokenizers`` package (the ``text`` extra) and a ``tokenizer.json`` beside
        the model file, or ``tokenizer=``. The prompt is encoded (and the tokenizer loaded, off the
        event loop) by the stream's first iteration or ``await stream.start()``, which raise an
        error of the prompt or options. Options are those of `generate`, except:

        Args:
            prompt: the text (or its token ids, used as they are).
            eos_token_id: token id(s) that end the stream; default: the tokenizer folder's
                (``generation_config.json``, ``config.json``, else ``tokenizer_config.json``'s
                ``eos_token``); ``()`` for none.
            stop: string(s) that end the stream, matched on the text (neither the stop string nor
                anything after it is yielded).
            tokenizer: a path (``tokenizer.json`` or its folder), a ``tokenizers.Tokenizer`` or
                a `TextTokenizer`; default: the one beside the model, loaded once per worker.
            add_special_tokens: let the tokenizer add its own tokens (a BOS) to a text prompt.
            skip_special_tokens: leave special tokens out of the text.

        Raises:
            TokenizerUnavailableError: the ``tokenizers`` package is not installed.
            InputError: no tokenizer beside the model, a bad ``stop``, or a model that fits no
                decoder convention.
        """
        engine = self._generation_engine()
        source = TokenizerSource(tokenizer) if tokenizer is not None else self._model_tokenizer()
        return TextStream(engine.submit, source, prompt, stop=stop_strings(stop), eos_token_id=eos_token_id,
                          add_special_tokens=add_special_tokens, skip_special_tokens=skip_special_tokens,
                          options=dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                       top_p=top_p, seed=seed))

    def generate_text_blocking(self, prompt: str | Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                               eos_token_id: int | Sequence[int] | None = None,
                               stop: str | Sequence[str] | None = None, tokenizer: Any = None,
                               add_special_tokens: bool = True, skip_special_tokens: bool = True) -> str:
        """Blocking twin of [`generate_text`][asyncinfer.Worker.generate_text]: the whole text
        (``generate_text(...).collect_blocking()``; iterate ``generate_text(...)`` with a plain
        ``for`` to stream it on a thread). Do not call it on an event loop."""
        return self.generate_text(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed, eos_token_id=eos_token_id, stop=stop, tokenizer=tokenizer,
                                  add_special_tokens=add_special_tokens,
                                  skip_special_tokens=skip_special_tokens).collect_blocking()

    def _model_tokenizer(self) -> TokenizerSource:
        """The tokenizer beside the model file, loaded (once) by the first stream that needs it."""
        with self._state_lock:
            if self._tokenizer is None:
                self._tokenizer = TokenizerSource.for_model(self.model.source, self.model.name)
            return self._tokenizer

    def generation_stats(self) -> GenerationStats:
        """Counters of this worker's generation: runs, tokens, streams running, largest batch,
        bytes of KV cache held, whether streams share runs (and if not, why)."""
        return self._generation_engine().stats()

    def _generation_engine(self) -> GenerationEngine:
        self._check_open()
        with self._state_lock:
            if self._generation is None:
                self._generation = GenerationEngine(self.model, self._plan, self._schedule_generation)
            return self._generation

    def _schedule_generation(self, futures: dict[str, Any], plan: Plan | None, here: bool,
                             submitted: Callable[[Execution], None]) -> Execution:
        """A run of the generation engine: inputs it built and checked itself, possibly values
        still on this worker's backend (a device's upload step passes them through). ``plan``:
        the engine's own shape-specialised variant of this worker's plan (see generation/engine.py).
        ``submitted(execution)`` is called once every step has its future, before any runs.
        ``here``: the engine thread waits for this run and has nothing else to do meanwhile, so
        it may run the run's work itself (`Backend.submit_here`) and return once that is done."""
        self._check_open()
        self._run_mode.begin(timed=False)  # (a run() timed meanwhile would time both)
        # serial: a decode step's branches (q, k and v; the rotary halves) are a few small kernels
        # each, which on two threads only take turns at the GIL (Llama-style decoder on 2 cores:
        # 37.5 -> 33 ms a token); its GEMMs still split across every core.
        execution = Execution(plan or self._plan, futures, worker=self, recorder=self._recorder(None), serial=True)
        execution.on_submitted(lambda: submitted(execution))
        if here:
            self._backend.submit_here(execution.submit_all)
        else:
            execution.submit_all()
        return execution

    # -- profiling ------------------------------------------------------------------------------------
    def profile(self, profile: Profile | None = None) -> Profiling:
        """Record every run scheduled on this worker inside ``with`` or ``async with``:

        ```python
        with worker.profile() as profile:
            worker.run_blocking(x)
        profile.write_trace("trace.json")   # open it in ui.perfetto.dev
        print(profile.summary())
        ```

        A run scheduled inside the block is recorded whole, even the steps that finish after the
        block ends (read the profile once its outputs are in hand). Pass a `Profile` to
        collect several blocks or several workers into one; blocks may nest. To profile a single
        run among concurrent ones, pass ``profile=`` to that call instead.
        """
        self._check_open()
        return Profiling(self, Profile() if profile is None else profile)

    def _attach(self, profile: Profile) -> None:
        with self._state_lock:
            self._profiles = (*self._profiles, profile)

    def _detach(self, profile: Profile) -> None:
        with self._state_lock:
            profiles = list(self._profiles)
            profiles.remove(profile)
            self._profiles = tuple(profiles)

    # -- lifecycle ------------------------------------------------------------------------------------
    def dispose(self) -> None:
        """Stop the worker: threads end and worker-owned outputs are released.

        Layers of the latest run that have not started are skipped, unless the caller took one of
        its outputs with ``take_output``: runs with caller-owned outputs are finished first, so
        nothing the caller owns is lost (this may block until they complete;
        [`dispose_async`][asyncinfer.Worker.dispose_async] waits on a helper thread instead).
        """
        with self._state_lock:
            if self._state is WorkerState.DISPOSED:
                return
            self._state = WorkerState.DISPOSED
            owned = list(self._owned_runs)
            generation = self._generation
        if generation is not None:
            generation.close()
        if self._latest is not None and not self._latest.has_taken_outputs:
            self._latest.cancel()
        self._latest = None
        for execution in owned:
            execution.wait_blocking()
        self._close_backends()

    def _keep_until_done(self, execution: Execution) -> None:
        """Remember a run with caller-owned outputs: disposal finishes it instead of cancelling it."""
        with self._state_lock:
            self._owned_runs.add(execution)

    def _close_backends(self) -> None:
        self._backend.close()
        if self._fallback is not None:
            self._fallback.close()

    async def dispose_async(self) -> None:
        """Awaitable twin of [`dispose`][asyncinfer.Worker.dispose]: never blocks the event loop (threads are
        joined on a helper thread)."""
        import anyio.to_thread

        await anyio.to_thread.run_sync(self.dispose)

    async def aclose(self) -> None:
        """Deprecated alias of [`dispose_async`][asyncinfer.Worker.dispose_async] (removed in the next release)."""
        warnings.warn("Worker.aclose() is deprecated: use `await worker.dispose_async()`",
                      DeprecationWarning, stacklevel=2)
        await self.dispose_async()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.dispose()

    async def __aenter__(self) -> "Worker":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.dispose_async()

    def __repr__(self) -> str:
        return (f"<Worker {self.model.name!r} on {self.backend_type.value}, {len(self._plan.nodes)} layers, "
                f"{self._state.value}>")


class Profiling:
    """The block of `Worker.profile()`: attaches its `Profile` to the worker on entry
    (``with`` or ``async with``, which give the profile) and detaches it on exit."""

    def __init__(self, worker: Worker, profile: Profile):
        self.worker = worker
        self.profile = profile

    def __enter__(self) -> Profile:
        self.worker._attach(self.profile)
        return self.profile

    def __exit__(self, *exc: object) -> None:
        self.worker._detach(self.profile)

    async def __aenter__(self) -> Profile:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__()
